"""`specstep loadgen`: throughput / latency sweeps against `specstep serve`, acting as an upstream router.

Against running servers (`--address`, one or several replicas), or across server settings in one command: each
`--setting` starts its own server, runs every load point, and stops it. Examples:

    specstep loadgen --address tcp://127.0.0.1:5555 --concurrency 1,4,16,32
    specstep loadgen --address tcp://10.0.0.1:5555 --address tcp://10.0.0.2:5555 --concurrency 8,32
    specstep loadgen --setting off --setting ngram --setting "mtp-k2=--spec mtp --num-spec-tokens 2" \\
        --workload mix --mode open --rate 2,4,8
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from pathlib import Path

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
        settings = [parse_setting(s) for s in args.setting] or ([] if args.address else [parse_setting("off")])
        if args.address and args.setting:
            raise ValueError("give --address or --setting, not both")
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

    return uvloop.run(_sweep(args, settings, loads, workload))


async def _sweep(args, settings: list[tuple[str, list[str]]], loads: list[float], workload) -> int:
    from rich.console import Console

    from specstep.loadgen import report
    from specstep.loadgen.router import NoReplicaError
    from specstep.loadgen.server import ServerProcess

    console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)  # logs: do not squeeze the table
    from specstep.engine.model_source import default_target, resolve_model

    # A GGUF is converted once, here, for the servers and the prompts.
    args.model = str(resolve_model(args.model or default_target().reference))
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    config = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    targets = [(name, extra) for name, extra in settings] or [("server", None)]
    for name, extra in targets:
        server = None
        serve_args = None
        if extra is not None:
            serve_args = ["--model", args.model, *shlex.split(args.server_args), *extra]
            console.print(f"[bold]{name}[/]: starting specstep serve {shlex.join(serve_args)}")
            server = ServerProcess(serve_args, log_path=out_dir / f"server-{name}.log")
            try:
                addresses = [await asyncio.get_running_loop().run_in_executor(None, server.start,
                                                                              args.startup_timeout)]
            except (RuntimeError, TimeoutError) as e:
                console.print(f"[red]{name}: the server did not start[/]\n{e}")
                return 1
        else:
            addresses = args.address
        try:
            results[name] = await _measure(args, name, addresses, loads, workload, console)
            results[name]["serve_args"] = serve_args
        except NoReplicaError as e:
            console.print(f"[red]{name}: {e}[/]")
            return 1
        finally:
            if server is not None:
                server.stop()
    paths = report.write(out_dir, config, results, plots=not args.no_plots)
    console.print(report.table(results))
    if any(len(s["replicas"]) > 1 for s in results.values()):
        console.print(report.address_table(results))
    if args.workload == "long-prompt":
        console.print(report.long_prompt_table(results))
    console.print("wrote " + ", ".join(str(p) for p in paths))
    return 0


async def _measure(args, name: str, addresses: list[str], loads: list[float], workload, console) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specstep.loadgen.metrics import summarize
    from specstep.loadgen.router import Router
    from specstep.loadgen.runner import LoadPoint, run_point
    from specstep.loadgen.workloads import build_requests

    router = Router(addresses)
    reported: dict[str, str] = {}
    try:
        await router.connect(args.startup_timeout)
        _report_down(console, name, router, reported)
        health = router.health[router.live[0]]  # prompts are built for this one's vocabulary
        if any((h.model, h.vocab_size) != (health.model, health.vocab_size) for h in router.health.values()):
            console.print(f"[yellow]{name}: the replicas serve different models: "
                          + ", ".join(f"{a}: {h.model} ({h.vocab_size} tokens)" for a, h in router.health.items())
                          + "[/]")
        model_dir = args.model if Path(args.model).is_dir() else None
        points = []
        if args.warmup:  # `--warmup` requests for every replica
            n = args.warmup * len(router.live)
            warm = build_requests(workload, n, health.vocab_size, model_dir)
            await run_point(router, LoadPoint("closed", n), warm, f"{name}-warmup", timeout_s=args.timeout)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, disable=args.quiet) as progress:
            for load in loads:
                point = LoadPoint(args.mode, load)
                n = args.num_requests or (max(8, 3 * int(load)) if args.mode == "closed" else max(16, int(10 * load)))
                reqs = build_requests(workload, n, health.vocab_size, model_dir)
                await router.refresh(60)
                _report_down(console, name, router, reported)
                tag = f"{name}-{point.label}-{time.monotonic_ns()}"
                if args.workload == "long-prompt":
                    points.append(await _long_prompt_point(args, router, point, reqs, health, tag))
                    continue
                task = progress.add_task(f"{name} {point.label}", total=n)
                run = await run_point(router, point, reqs, tag, on_done=lambda _r, t=task: progress.advance(t),
                                      timeout_s=args.timeout, seed=args.seed)
                points.append(summarize(run, router.addresses))
        stats = await router.stats()
        _report_down(console, name, router, reported)
        replicas = {a: {"health": _plain(router.health.get(a)), "server_stats": _plain(stats.get(a)),
                        "down": router.down.get(a)} for a in router.addresses}
        first = next(a for a in router.addresses if a in router.health)
        # `health` and `server_stats`: the first replica's (the only one's, against one server).
        return {"health": replicas[first]["health"], "points": points,
                "server_stats": replicas[first]["server_stats"], "replicas": replicas}
    finally:
        router.close()


def _report_down(console, name: str, router, reported: dict[str, str]) -> None:
    """Print each replica newly down, or down for a new reason, or back up."""
    for address in router.addresses:
        why = router.down.get(address)
        if why is not None and reported.get(address) != why:
            console.print(f"[red]{name}: replica {address} is down, no requests go to it: {why}[/]")
        elif why is None and address in reported:
            console.print(f"{name}: replica {address} is back")
        if why is None:
            reported.pop(address, None)
        else:
            reported[address] = why


async def _long_prompt_point(args, router, point, stream_reqs, health, tag: str) -> dict:
    from specstep.loadgen.long_prompt import (
        LongPromptLoad,
        long_requests,
        run_long_prompt_point,
        summarize_long_prompt,
    )
    from specstep.loadgen.metrics import summarize

    load = LongPromptLoad(args.long_prompt_tokens, args.long_prompts)
    lp = await run_long_prompt_point(router, int(point.load), stream_reqs,
                                     long_requests(load, health.vocab_size, args.seed), tag, args.timeout)
    return summarize(lp.run, router.addresses) | summarize_long_prompt(lp)


def _plain(obj):
    """A reply struct as a dict of its fields (the wire form is positional arrays)."""
    if hasattr(obj, "__struct_fields__"):
        return {f: _plain(getattr(obj, f)) for f in obj.__struct_fields__}
    return obj
