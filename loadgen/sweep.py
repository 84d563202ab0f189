"""A sweep: every load point on every target, targets in turn at each point (so noise on a shared host spreads
over all of them alike), then the report. A target is one way to reach servers: a Router over ZMQ replicas, or
one OpenAI-compatible server over HTTP (loadgen/openai_client.py) behind the same Router interface."""

from __future__ import annotations

import asyncio
import shlex
import sys
import time
from pathlib import Path

from specstep.loadgen.openai_client import OpenAIClient
from specstep.loadgen.router import NoReplicaError, Router


def _openai_router(url: str, model: str | None) -> Router:
    return Router([url], make_client=lambda address, _ctx: OpenAIClient(address, model))


async def sweep(args, settings: list[tuple[str, list[str]]], loads: list[float], workload) -> int:
    from rich.console import Console

    from specstep.engine.model_source import default_target, resolve_model
    from specstep.loadgen import report
    from specstep.loadgen.server import ServerProcess

    console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)  # logs: do not squeeze the table
    # A GGUF is converted once, here, for the servers and the prompts.
    args.model = str(resolve_model(args.model or default_target().reference))
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    config = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    if not settings:  # running servers: every --address (one router) and each --url, side by side
        targets = [("server" if not args.url else "zmq", Router(args.address))] if args.address else []
        targets += [(name, _openai_router(url, args.openai_model)) for name, url in args.url]
        try:
            results |= await _measure(args, targets, loads, workload, console)
        except NoReplicaError as e:
            console.print(f"[red]{e}[/]")
            return 1
        for result in results.values():
            result["serve_args"] = None
    for name, extra in settings:
        serve_args = ["--model", args.model, *shlex.split(args.server_args), *extra]
        console.print(f"[bold]{name}[/]: starting specstep serve {shlex.join(serve_args)}")
        server = ServerProcess(serve_args, log_path=out_dir / f"server-{name}.log", http=args.api != "zmq")
        try:
            address = await asyncio.get_running_loop().run_in_executor(None, server.start, args.startup_timeout)
        except (RuntimeError, TimeoutError) as e:
            console.print(f"[red]{name}: the server did not start[/]\n{e}")
            return 1
        try:  # from here on, whatever happens, the server is stopped
            if args.api != "zmq" and server.http_url is None:
                console.print(f"[red]{name}: the server serves no HTTP API (--http-port -1 in its arguments?)[/]")
                return 1
            targets = []
            if args.api in ("zmq", "both"):
                targets.append((name if args.api == "zmq" else f"{name}/zmq", Router([address])))
            if args.api in ("openai", "both"):
                targets.append((name if args.api == "openai" else f"{name}/openai",
                                _openai_router(server.http_url, args.openai_model)))
            measured = await _measure(args, targets, loads, workload, console)
        except NoReplicaError as e:
            console.print(f"[red]{name}: {e}[/]")
            return 1
        finally:
            server.stop()
        for result in measured.values():
            result["serve_args"] = serve_args
        results |= measured
    paths = report.write(out_dir, config, results, plots=not args.no_plots)
    console.print(report.table(results))
    if any(len(s["replicas"]) > 1 for s in results.values()):
        console.print(report.address_table(results))
    if args.workload == "long-prompt":
        console.print(report.long_prompt_table(results))
    console.print("wrote " + ", ".join(str(p) for p in paths))
    return 0


async def _measure(args, targets: list[tuple[str, Router]], loads: list[float], workload, console) -> dict[str, dict]:
    """Each load point on each target in turn; every target gets the same requests."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specstep.loadgen.metrics import summarize
    from specstep.loadgen.runner import LoadPoint, run_point
    from specstep.loadgen.workloads import build_requests

    reported: dict[str, dict[str, str]] = {name: {} for name, _ in targets}
    try:
        for name, router in targets:
            try:
                await router.connect(args.startup_timeout)
            except NoReplicaError as e:
                raise NoReplicaError(f"{name}: {e}") from None
            _report_down(console, name, router, reported[name])
            _check_models(console, name, router)
        first = targets[0][1]
        health = first.health[first.live[0]]  # prompts are built for this one's vocabulary
        vocab_size = health.vocab_size or _local_vocab_size(args.model)
        model_dir = args.model if Path(args.model).is_dir() else None
        if args.warmup:  # `--warmup` requests for every replica
            for name, router in targets:
                n = args.warmup * len(router.live)
                warm = build_requests(workload, n, vocab_size, model_dir)
                await run_point(router, LoadPoint("closed", n), warm, f"{name}-warmup", timeout_s=args.timeout)
        points: dict[str, list[dict]] = {name: [] for name, _ in targets}
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, disable=args.quiet) as progress:
            for load in loads:
                point = LoadPoint(args.mode, load)
                n = args.num_requests or (max(8, 3 * int(load)) if args.mode == "closed" else max(16, int(10 * load)))
                reqs = build_requests(workload, n, vocab_size, model_dir)
                for name, router in targets:
                    await router.refresh(60)
                    _report_down(console, name, router, reported[name])
                    tag = f"{name}-{point.label}-{time.monotonic_ns()}"
                    if args.workload == "long-prompt":
                        points[name].append(await _long_prompt_point(args, router, point, reqs, vocab_size, tag))
                        continue
                    task = progress.add_task(f"{name} {point.label}", total=n)
                    run = await run_point(router, point, reqs, tag, on_done=lambda _r, t=task: progress.advance(t),
                                          timeout_s=args.timeout, seed=args.seed)
                    points[name].append(summarize(run, router.addresses))
        out = {}
        for name, router in targets:
            stats = await router.stats()
            _report_down(console, name, router, reported[name])
            replicas = {a: {"health": _plain(router.health.get(a)), "server_stats": _plain(stats.get(a)),
                            "down": router.down.get(a)} for a in router.addresses}
            lead = next(a for a in router.addresses if a in router.health)
            # `health` and `server_stats`: the first replica's (the only one's, against one server).
            out[name] = {"health": replicas[lead]["health"], "points": points[name],
                         "server_stats": replicas[lead]["server_stats"], "replicas": replicas}
        return out
    finally:
        for _, router in targets:
            router.close()


def _check_models(console, name: str, router: Router) -> None:
    health = router.health[router.live[0]]
    if any((h.model, h.vocab_size) != (health.model, health.vocab_size) for h in router.health.values()):
        console.print(f"[yellow]{name}: the replicas serve different models: "
                      + ", ".join(f"{a}: {h.model} ({h.vocab_size} tokens)" for a, h in router.health.items())
                      + "[/]")


def _local_vocab_size(model: str) -> int:
    """The vocabulary of the local model (for random prompts to a server that does not report its own)."""
    from specstep.engine.tokenizer import Tokenizer

    return Tokenizer.from_folder(model).vocab_size


def _report_down(console, name: str, router: Router, reported: dict[str, str]) -> None:
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


async def _long_prompt_point(args, router: Router, point, stream_reqs, vocab_size: int, tag: str) -> dict:
    from specstep.loadgen.long_prompt import (
        LongPromptLoad,
        long_requests,
        run_long_prompt_point,
        summarize_long_prompt,
    )
    from specstep.loadgen.metrics import summarize

    load = LongPromptLoad(args.long_prompt_tokens, args.long_prompts)
    lp = await run_long_prompt_point(router, int(point.load), stream_reqs,
                                     long_requests(load, vocab_size, args.seed), tag, args.timeout)
    return summarize(lp.run, router.addresses) | summarize_long_prompt(lp)


def _plain(obj):
    """A reply struct as a dict of its fields (the wire form is positional arrays)."""
    if hasattr(obj, "__struct_fields__"):
        return {f: _plain(getattr(obj, f)) for f in obj.__struct_fields__}
    return obj
