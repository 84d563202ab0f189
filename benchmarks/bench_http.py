"""What the OpenAI-compatible HTTP API costs against the ZMQ protocol, on one `specstep serve`.

The same closed-loop load (loadgen's code workload) goes over ZMQ and over HTTP in alternating rounds. Besides
each round's throughput (wall clock: noisy on a shared host), it reads the CPU time the frontend process (ZMQ
ROUTER, HTTP server, tokenizing, detokenizing) and the scheduler process spent (/proc/PID/stat), per output
token: CPU time is what the HTTP layer adds, and it moves much less than wall time when other work shares the
cores. Rounds alternate and the table gives medians over them.

    python -m benchmarks.bench_http [--model M] [--concurrency 16] [--requests 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from pathlib import Path

from specstep.loadgen.metrics import summarize
from specstep.loadgen.openai_client import OpenAIClient
from specstep.loadgen.router import Router
from specstep.loadgen.runner import LoadPoint, run_point
from specstep.loadgen.server import ServerProcess
from specstep.loadgen.workloads import Workload, build_requests

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def child_pid(pid: int) -> int:
    """The scheduler process: the frontend's one child."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(children[0])


async def measure(args, server: ServerProcess) -> dict[str, list[dict]]:
    from specstep.engine.model_source import resolve_model

    model_dir = str(resolve_model(args.model)) if args.model else None
    routers = {"zmq": Router([server.address]),
               "http": Router([server.http_url], make_client=lambda a, _ctx: OpenAIClient(a))}
    frontend, scheduler = server.pid, child_pid(server.pid)
    rounds: dict[str, list[dict]] = {name: [] for name in routers}
    try:
        for r in routers.values():
            await r.connect(args.startup_timeout)
        vocab = routers["zmq"].health[server.address].vocab_size
        workload = Workload("code", args.prompt_tokens, args.max_tokens, True, 0)
        reqs = build_requests(workload, args.requests, vocab, model_dir)
        for name, r in routers.items():  # warm-up: each path once
            await run_point(r, LoadPoint("closed", args.concurrency), reqs[:args.concurrency], f"warm-{name}")
        for i in range(args.rounds):
            for name, r in routers.items():
                await routers["zmq"].refresh(60)  # both paths reach the same scheduler: wait until it is idle
                f0, s0 = cpu_s(frontend), cpu_s(scheduler)
                run = await run_point(r, LoadPoint("closed", args.concurrency), reqs, f"{name}-{i}")
                f1, s1 = cpu_s(frontend), cpu_s(scheduler)
                p = summarize(run)
                tokens = max(p["output_tokens"], 1)
                rounds[name].append({"tok_s": p["output_tokens_per_s"], "ok": p["num_ok"],
                                     "frontend_ms_per_tok": 1000 * (f1 - f0) / tokens,
                                     "scheduler_ms_per_tok": 1000 * (s1 - s0) / tokens})
                print(f"round {i} {name}: {rounds[name][-1]}", flush=True)
    finally:
        for r in routers.values():
            r.close()
    return rounds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: serve's default target")
    p.add_argument("--server-args", default="", help="extra serve arguments (one string)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=48, help="requests per round and path")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    args = p.parse_args()
    serve = (["--model", args.model] if args.model else []) + args.server_args.split()
    with ServerProcess(serve + ["--metrics-port", "-1"], http=True) as server:
        rounds = asyncio.run(measure(args, server))
    print(f"\nconcurrency {args.concurrency}, {args.requests} requests of {args.max_tokens} tokens a round, "
          f"medians of {args.rounds} alternating rounds")
    print("| path | output tok/s | frontend CPU ms/token | scheduler CPU ms/token |")
    print("| --- | ---: | ---: | ---: |")
    for name, rs in rounds.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("tok_s", "frontend_ms_per_tok",
                                                                  "scheduler_ms_per_tok")}
        print(f"| {name} | {med['tok_s']:.1f} | {med['frontend_ms_per_tok']:.3f} | "
              f"{med['scheduler_ms_per_tok']:.2f} |")


if __name__ == "__main__":
    main()
