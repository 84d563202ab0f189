"""Eager against compiled decode steps (`--graphs compiled`) on the same model, side by side in one process:
start-up (compile, then a second build from the disk cache) and ms a step, steps alternating every repetition.

    python -m benchmarks.bench_compiled [--model M] [--batches 1] [--ks 0,4] [--reps 30] [--max-model-len 512]

To bound start-up, only the greedy flavour is compiled (`step_graphs.SAMPLING` is narrowed here: the engine
compiles greedy, sampled and general) at the k values measured, at one page-table width (`--max-model-len`
512). A step is `StepEngine.decode_context` + `run_decode` + reading the outputs back (`bench_steps.StepTimer`),
target through the n-gram proposer with k random drafts for a verify step. The compiled engine is built twice: the
first build compiles (into a fresh cache unless `--keep-cache`), the second loads from the disk cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import specstep.engine.step_graphs as step_graphs
import specstep.scheduler.build as build
from benchmarks.bench_steps import StepTimer
from benchmarks.common import code_prompts, machine, table
from specstep.engine.engine_config import EngineConfig
from specstep.engine.model_source import default_target, resolve_model


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the serving default target")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--ks", default="0,4", help="k values to compile and time (0: a plain decode step)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep-cache", action="store_true", help="use the specstep cache as it is")
    ap.add_argument("--json", help="write the figures here")
    return ap


def main() -> None:
    args = _parser().parse_args()
    if not args.keep_cache:
        os.environ["SPECSTEP_CACHE"] = tempfile.mkdtemp(prefix="specstep-bench-compiled-")
    ks = tuple(int(k) for k in args.ks.split(","))
    step_graphs.SAMPLING = ("greedy",)
    build.graph_ks = lambda k_max: ks
    model = str(resolve_model(args.model or default_target().reference))
    batches = [int(b) for b in args.batches.split(",")]
    prompts = code_prompts(max(batches), args.prompt_tokens, seed=3, model=model)
    results: dict = {"machine": machine(), "model": model, "ks": ks, "rows": {}, "builds": {},
                     "load_average": {"before": os.getloadavg()}}
    rows = []
    for b in batches:
        rows += _measure_batch(args, model, prompts[:b], b, ks, results)
    results["load_average"]["after"] = os.getloadavg()
    load = ", ".join(f"{k} {v[0]:.1f}" for k, v in results["load_average"].items())
    table(f"eager vs compiled steps, medians of {args.reps} (range) ({machine()}; load average {load})",
          ["batch", "k", "eager ms", "compiled ms", "compiled/eager"], rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def _measure_batch(args: argparse.Namespace, model: str, prompts: list[list[int]], b: int, ks: tuple[int, ...],
                   results: dict) -> list[list]:
    """Table rows for batch size `b`, one per k; its build times and step figures go into `results`."""
    eager, compiled, builds = _build_engines(args, model, prompts, b, ks)
    results["builds"][f"b{b}"] = builds
    timers = {"eager": eager, "compiled": compiled}
    samples = _sample(timers, ks, args.reps)
    rows = []
    for k in ks:
        med = {m: statistics.median(samples[m, k]) * 1e3 for m in timers}
        spread = {m: (min(samples[m, k]) * 1e3, max(samples[m, k]) * 1e3) for m in timers}
        rows.append([b, k, f"{med['eager']:.1f} ({spread['eager'][0]:.1f}-{spread['eager'][1]:.1f})",
                     f"{med['compiled']:.1f} ({spread['compiled'][0]:.1f}-{spread['compiled'][1]:.1f})",
                     f"{med['compiled'] / med['eager']:.2f}"])
        results["rows"][f"b{b}_k{k}"] = {"eager_ms": med["eager"], "compiled_ms": med["compiled"],
                                         "spread_ms": spread}
    for t in timers.values():
        t.close()
    print(f"batch {b}: builds eager {builds['eager_s']:.1f} s, compiled {builds['compile_s']:.1f} s "
          f"({builds['first']}), again {builds['cached_s']:.1f} s ({compiled.engine.graphs.backend.describe()})",
          flush=True)
    return rows


def _build_engines(args: argparse.Namespace, model: str, prompts: list[list[int]], b: int,
                   ks: tuple[int, ...]) -> tuple[StepTimer, StepTimer, dict]:
    """The eager engine, then the compiled one twice (compiling, then from the disk cache): the eager and the
    second compiled engine, and how long each build took."""
    def timer(graphs: str) -> tuple[StepTimer, float]:
        t0 = time.perf_counter()
        cfg = EngineConfig(model=model, spec="ngram", num_spec_tokens=max(max(ks), 1), spec_policy="fixed",
                           overlap=False, threads=args.threads, max_batch_size=b,
                           max_model_len=args.max_model_len, graphs=graphs)
        return StepTimer(cfg, prompts, max(ks)), time.perf_counter() - t0

    eager, eager_s = timer("off")
    first, first_s = timer("compiled")
    note = first.engine.graphs.backend.describe()
    first.close()
    compiled, second_s = timer("compiled")
    return eager, compiled, {"eager_s": eager_s, "compile_s": first_s, "cached_s": second_s, "graphs": len(ks),
                             "first": note, "second": compiled.engine.graphs.backend.describe()}


def _sample(timers: dict[str, StepTimer], ks: tuple[int, ...], reps: int) -> dict:
    """Seconds per step by (engine, k), the engines and k values alternating every repetition."""
    samples = {(m, k): [] for m in timers for k in ks}
    for t in timers.values():
        for k in ks:
            t.step(k)  # warm-up
    for _ in range(reps):
        for m, t in timers.items():
            for k in ks:
                samples[m, k].append(t.step(k))
    return samples


if __name__ == "__main__":
    main()
