"""Prefill costs: a batch of fresh prompts through the engine's own steps (the prompt forward, the first token's
logits and draw) until each has its first token, per batch size and CPU kernel setting, side by side in one run
(settings alternate every repetition). Time to first token without the frontend, and the share of a short
generation a prefill takes (bench_peers' figures include it).

    python -m benchmarks.bench_prefill [--batches 1,8] [--prompt-tokens 128] [--reps 10] [--modes M1,M2]

Modes as `bench_steps`' (`--cpu-linear[/--batch-invariant[/--quantization[/--cpu-layers[/--activations]]]]`; default
auto/on,auto/on/auto/auto/int8: fp32 and int8 activations over the GGUF blocks). Held-out code prompts, one
engine per mode (plain decoding: a proposer's own prefill is not what this times).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.bench_steps import mode_config
from benchmarks.common import code_prompts, drive, machine, table
from specstep.engine.model_loader import describe_cpu_kernels
from specstep.engine.model_source import default_target, resolve_model
from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler.build import build_engine


def prefill_seconds(core, prompts: list[list[int]], seed0: int) -> float:
    """Seconds until every prompt of the batch has its first token (all added at once; request ids from seed0)."""
    t0 = time.perf_counter()
    drive(core, prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), len(prompts), seed0)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the serving default target")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--modes", default="auto/on,auto/on/auto/auto/int8")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    model = str(resolve_model(args.model or default_target().reference))
    batches = [int(b) for b in args.batches.split(",")]
    prompts = code_prompts(max(batches), args.prompt_tokens, seed=3, model=model)
    modes = args.modes.split(",")
    cores = {m: build_engine(mode_config(m, model, "none", 4, args.threads, max(batches)))[0] for m in modes}
    load = os.getloadavg()[0]
    rows = []
    for b in batches:
        samples: dict[str, list[float]] = {m: [] for m in modes}
        for core in cores.values():  # warm-up: builds, thread choices, first touches
            for _ in range(2):
                prefill_seconds(core, prompts[:b], 10**6)
        for r in range(args.reps):
            for m, core in cores.items():
                samples[m].append(prefill_seconds(core, prompts[:b], 1000 * r))
        base = statistics.median(samples[modes[0]])
        for m in modes:
            med = statistics.median(samples[m])
            rows.append([m, b, f"{med * 1e3:.1f} [{min(samples[m]) * 1e3:.1f}-{max(samples[m]) * 1e3:.1f}]",
                         f"{b * args.prompt_tokens / med:.0f}", f"{base / med:.2f}"])
    table(f"prefill of {args.prompt_tokens}-token prompts to the first token, medians of {args.reps} [min-max] "
          f"({machine()}; load average {load:.1f} before)",
          ["kernels", "batch", "ms", "prompt tok/s", f"speed vs {modes[0]}"], rows)
    for m, core in cores.items():
        print(f"{m}: {describe_cpu_kernels(core.engine.target)}")
        core.stream.close()


if __name__ == "__main__":
    main()
