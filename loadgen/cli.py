"""`specstep loadgen`: throughput / latency sweeps against `specstep serve`, acting as an upstream router.

Against running servers (`--address`, one or several replicas; `--url`, OpenAI-compatible servers), or across
server settings in one command: each `--setting` starts its own server, runs every load point, and stops it.
Examples:

    specstep loadgen --address tcp://127.0.0.1:5555 --concurrency 1,4,16,32
    specstep loadgen --address tcp://10.0.0.1:5555 --address tcp://10.0.0.2:5555 --concurrency 8,32
    specstep loadgen --setting off --setting ngram --setting "mtp-k2=--spec mtp --num-spec-tokens 2" \\
        --workload mix --mode open --rate 2,4,8
    specstep loadgen --address tcp://127.0.0.1:5555 --url specstep=http://127.0.0.1:8000 \\
        --url llama.cpp=http://127.0.0.1:8080 --concurrency 1,4,16
    specstep loadgen --setting mtp --api both --concurrency 1,4,16
"""

from __future__ import annotations

import argparse
import shlex
import sys

from specstep.engine.engine_config import SPEC_KINDS
from specstep.loadgen.workloads import WORKLOADS


def add_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("servers")
    s.add_argument("--address", action="append", default=[], metavar="ADDRESS[,ADDRESS...]",
                   help="an already running server to measure (nothing is started). Repeat it or give a "
                        "comma-separated list to spread the load over several replicas as a router would: each "
                        "request goes to the replica with the fewest outstanding requests (ties: round-robin); "
                        "a replica not ok within --startup-timeout, or after a --timeout, is skipped until its "
                        "HEALTH is ok again (checked before each load point). Results are also given per "
                        "address (docs/replicas.md)")
    s.add_argument("--url", action="append", default=[], metavar="[NAME=]URL",
                   help="an OpenAI-compatible server to measure over HTTP (/v1/completions, streamed): specstep's "
                        "HTTP API, llama.cpp's llama-server, vLLM. Repeat it to measure several side by side (each "
                        "load point runs on each in turn, --address servers too); NAME labels its results "
                        "(default: the URL). docs/http.md")
    s.add_argument("--api", choices=["zmq", "openai", "both"], default="zmq",
                   help="how to reach servers started by --setting: the ZMQ protocol, the OpenAI-compatible HTTP "
                        "API, or both (each load point over ZMQ, then over HTTP, on the same server; results "
                        "NAME/zmq and NAME/openai). Default: %(default)s")
    s.add_argument("--openai-model", default=None,
                   help="model name sent to --url servers (default: the first the server lists in /v1/models)")
    s.add_argument("--setting", action="append", default=[], metavar="NAME[=SERVE ARGS]",
                   help="start `specstep serve SERVE ARGS` and measure it; NAME alone may be off or a proposer "
                        f"({', '.join(SPEC_KINDS)}). Repeat for a sweep across settings (default: off)")
    s.add_argument("--model", default=None,
                   help="target model for started servers and prompts (default: serve's default target)")
    s.add_argument("--server-args", default="", help="extra arguments for every started server (one string)")
    s.add_argument("--startup-timeout", type=float, default=600.0)
    w = p.add_argument_group("load")
    w.add_argument("--mode", choices=["closed", "open"], default="closed",
                   help="closed: fixed concurrency; open: Poisson arrivals at a fixed rate")
    w.add_argument("--concurrency", default="1,4,16,32", help="closed-loop concurrencies (comma-separated)")
    w.add_argument("--rate", default="1,2,4,8", help="open-loop arrival rates, requests/s (comma-separated)")
    w.add_argument("--num-requests", type=int, default=None,
                   help="requests per load point (default: max(8, 3 x concurrency) or max(16, 10 s of arrivals))")
    w.add_argument("--workload", choices=[*WORKLOADS, "long-prompt"], default="code",
                   help="code | random | mix, or long-prompt: --concurrency steady code streams while long "
                        "random prompts arrive one at a time (default: %(default)s)")
    w.add_argument("--long-prompt-tokens", type=int, default=4000, help="long-prompt: its length (default 4000)")
    w.add_argument("--long-prompts", type=int, default=2, help="long-prompt: how many, one after another")
    w.add_argument("--prompt-tokens", type=int, default=128)
    w.add_argument("--max-tokens", type=int, default=64)
    w.add_argument("--respect-eos", action="store_true", help="stop at EOS (default: always max-tokens)")
    w.add_argument("--warmup", type=int, default=2,
                   help="unmeasured requests (per replica) before each setting's first point")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--timeout", type=float, default=600.0,
                   help="per-request timeout, seconds: the request is aborted and counted as error code 0")
    o = p.add_argument_group("output")
    o.add_argument("--output-dir", default="loadgen-results", help="results.json, results.csv, *.png, server logs")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--quiet", action="store_true", help="no progress bars")


def parse_setting(text: str) -> tuple[str, list[str]]:
    name, sep, rest = text.partition("=")
    name = name.strip()
    if sep:
        return name, shlex.split(rest)
    if name in ("off", "none"):
        return name, ["--spec", "none"]
    if name in SPEC_KINDS:
        return name, ["--spec", name]
    raise ValueError(f"--setting {text!r}: give NAME=SERVE ARGS, or one of off, {', '.join(SPEC_KINDS)}")


def parse_addresses(values: list[str]) -> list[str]:
    addresses = [a.strip() for v in values for a in v.split(",") if a.strip()]
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"--address: an address is given twice in {', '.join(addresses)}")
    return addresses


def parse_urls(values: list[str]) -> list[tuple[str, str]]:
    """(name, url) per --url: `NAME=URL`, or the URL naming itself."""
    out = []
    for v in values:
        name, sep, url = v.partition("=")
        name, url = (name.strip(), url.strip()) if sep and not name.startswith("http") else (v.strip(), v.strip())
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--url {v!r}: give an http:// or https:// URL")
        out.append((name, url))
    if len({n for n, _ in out}) != len(out):
        raise ValueError("--url: two servers have the same name")
    return out


def parse_loads(text: str, what: str) -> list[float]:
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} must be comma-separated numbers, got {text!r}") from None
    if not loads or any(x <= 0 for x in loads):
        raise ValueError(f"--{what} needs positive numbers")
    return loads


def run(args: argparse.Namespace) -> int:
    try:
        args.address = parse_addresses(args.address)
        args.url = parse_urls(args.url)
        running = bool(args.address or args.url)
        settings = [parse_setting(s) for s in args.setting] or ([] if running else [parse_setting("off")])
        if running and args.setting:
            raise ValueError("give --address / --url or --setting, not both")
        if args.api != "zmq" and running:
            raise ValueError("--api is for servers started by --setting; running servers are named by --address "
                             "(ZMQ) and --url (HTTP)")
        loads = parse_loads(args.concurrency if args.mode == "closed" else args.rate,
                            "concurrency" if args.mode == "closed" else "rate")
        from specstep.loadgen.workloads import Workload

        kind = "code" if args.workload == "long-prompt" else args.workload  # long-prompt streams: code
        workload = Workload(kind, args.prompt_tokens, args.max_tokens, not args.respect_eos, args.seed)
        if args.workload == "long-prompt" and (args.mode != "closed" or args.long_prompts < 1
                                               or args.long_prompt_tokens < 1):
            raise ValueError("--workload long-prompt runs closed-loop streams (--concurrency) and needs "
                             "--long-prompts >= 1 and --long-prompt-tokens >= 1")
    except ValueError as e:
        print(f"specstep loadgen: error: {e}", file=sys.stderr)
        return 2
    import uvloop

    from specstep.loadgen.sweep import sweep

    return uvloop.run(sweep(args, settings, loads, workload))
