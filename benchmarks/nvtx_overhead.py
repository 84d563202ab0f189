"""Microbenchmark: what a `Tracer.range` costs on the hot path (ns per range), with and without NVTX/recording.

    python benchmarks/nvtx_overhead.py [--n 200000]

Not a timed test: numbers vary with the machine. What to look for: with no profiler attached and no recorder,
a range costs about as much as an empty `with` on a shared no-op object, i.e. nothing measurable next to a
decode step (tens of microseconds on a GPU, milliseconds here). Under `nsys profile` the NVTX path is taken
(the "forced nvtx path" row approximates its Python-side cost; the tool adds its own).
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext

from specstep.traces import ranges
from specstep.traces.tracer import NULL_TRACER, Tracer, TraceRecorder, nvtx_active


def per_call_ns(fn, n: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter_ns()
        fn()
        best = min(best, (time.perf_counter_ns() - t) / n)
    return best


def loop(make, n: int):
    def run():
        for _ in range(n):
            with make():
                pass
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200_000)
    n = p.parse_args().n
    name = ranges.BUILD_BATCH
    rows = []
    null_ctx = nullcontext()
    rows.append(("empty `with nullcontext()`", per_call_ns(loop(lambda: null_ctx, n), n)))
    rows.append(("NULL_TRACER.range", per_call_ns(loop(lambda: NULL_TRACER.range(name), n), n)))
    tr = Tracer(None, nvtx=True)
    rows.append((f"Tracer(nvtx=True), profiler attached={nvtx_active()}",
                 per_call_ns(loop(lambda: tr.range(name, batch=8), n), n)))
    try:
        import nvtx

        forced = Tracer(None, nvtx=False)
        forced._domain = nvtx.get_domain("specstep")  # the NVTX code path, whatever the profiler state
        rows.append(("forced nvtx path (domain push/pop)", per_call_ns(loop(lambda: forced.range(name), n), n)))

        def raw():
            for _ in range(n):
                nvtx.push_range(name)
                nvtx.pop_range()
        rows.append(("raw nvtx.push_range/pop_range", per_call_ns(raw, n)))
    except ImportError:
        rows.append(("nvtx not installed", float("nan")))
    rec_n = min(n, 50_000)
    rec_tr = Tracer(TraceRecorder(), nvtx=False)
    rows.append(("Tracer with recorder", per_call_ns(loop(lambda: rec_tr.range(name, batch=8), rec_n), rec_n)))
    width = max(len(r[0]) for r in rows)
    for label, ns in rows:
        print(f"{label:<{width}}  {ns:8.0f} ns/range")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
