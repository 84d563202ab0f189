"""Aten ops per decode step by sampling setting (what sampling costs beside the model): greedy,
temperature only, temperature with top-k, counted with torch's profiler over one speculative decode step of the
pretrained default with its MTP head, on the CPU graph stand-in (the same step function a CUDA graph captures).
Every aten op is counted, nested ones included; the table gives each setting's ratio to greedy.

    python -m benchmarks.bench_sampling_ops [--model M] [--batch 4] [--k 4] [--graphs on|off]  (on: the stand-in)
"""

from __future__ import annotations

import argparse

import torch

from specstep.engine.engine_config import EngineConfig
from specstep.engine.model_source import default_target, resolve_model
from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler.build import build_engine
from specstep.scheduler.core.request import Request

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 1.0": dict(temperature=1.0),
    "temperature 1.0, top_k 20": dict(temperature=1.0, top_k=20),
}


def ops_per_step(model: str, batch: int, k: int, graphs: str, params: SamplingParams) -> int:
    core, _, _ = build_engine(EngineConfig(model=model, spec="mtp", num_spec_tokens=k, spec_policy="fixed",
                                           graph_standin=graphs == "on", device="cpu", max_batch_size=batch,
                                           kv_cache_tokens=4096, overlap=False, threads=2))
    for i in range(batch):
        core.add_request(Request(str(i), [3, 1, 4, 1, 5, 9, 2, 6], params, seed=i))
    core.step()  # prefill
    core.step()  # a first decode step (warm)
    with torch.profiler.profile() as prof:
        core.step()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--graphs", choices=["on", "off"], default="on")
    args = p.parse_args()
    model = str(resolve_model(args.model or default_target().reference))
    counts = {name: ops_per_step(model, args.batch, args.k, args.graphs,
                                 SamplingParams(max_tokens=16, ignore_eos=True, **kw))
              for name, kw in SETTINGS.items()}
    for name, n in counts.items():
        print(f"{name:28s} {n:6d} aten ops a decode step   {n / counts['greedy']:.2f}x greedy")


if __name__ == "__main__":
    main()
