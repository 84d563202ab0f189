"""Graph decode steps at a short and a long max_model_len, same short prompts (a graph step's attention
work follows the batch's lengths, not max_model_len). Each setting builds an engine with graphs
on (the CPU stand-in replays the same step function a CUDA graph captures), prefills the same prompts, then
times decode steps; settings alternate in rounds and the table gives medians with the spread, and the ratio of
each long-context setting to the short one. `one width` is the old behaviour (page tables always at
max_model_len's width), for contrast.

    python -m benchmarks.bench_graph_kv [--model M] [--batch 4] [--long 8192] [--steps 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

from specstep.engine import step_engine
from specstep.engine.engine_config import EngineConfig
from specstep.engine.model_source import default_target, resolve_model
from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler.build import build_engine
from specstep.scheduler.core.request import Request


def build(model: str, batch: int, max_len: int, one_width: bool):
    cfg = EngineConfig(model=model, graph_standin=True, device="cpu", max_batch_size=batch, max_model_len=max_len,
                       kv_cache_tokens=4096, overlap=False, threads=2)
    if one_width:
        with mock.patch.object(step_engine, "kv_page_buckets", lambda max_pages, ps: (max_pages,)):
            return build_engine(cfg)[0]
    return build_engine(cfg)[0]


def step_times(core, batch: int, steps: int) -> list[float]:
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        core.add_request(Request(f"{time.monotonic_ns()}-{i}", [3, 1, 4, 1, 5, 9, 2, 6] * 4, params, seed=i))
    core.step()  # prefill
    core.step()  # first decode step (the stand-in probes it)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    while core.has_unfinished():
        core.step()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--short", type=int, default=512)
    p.add_argument("--long", type=int, default=8192)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    model = str(resolve_model(args.model or default_target().reference))
    settings = {f"max_model_len {args.short}": (args.short, False),
                f"max_model_len {args.long}": (args.long, False),
                f"max_model_len {args.long}, one width": (args.long, True)}
    cores = {name: build(model, args.batch, ml, one) for name, (ml, one) in settings.items()}
    times: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.rounds):  # alternate, so host noise lands on every setting alike
        for name, core in cores.items():
            times[name].append(statistics.median(step_times(core, args.batch, args.steps)))
    base = statistics.median(times[next(iter(settings))])
    print(f"graph decode step, batch {args.batch}, {args.rounds} rounds x {args.steps} steps (median, range)")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:34s} {med * 1e3:7.1f} ms  ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})  {med / base:.2f}x")


if __name__ == "__main__":
    main()
