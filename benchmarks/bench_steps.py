"""Step costs from the engine's own step functions: a verify step of k + 1 tokens per request against a plain
decode step, per batch size and CPU kernel setting, side by side in one run (settings alternate every repetition).

    python -m benchmarks.bench_steps [--model M] [--batches 1,8] [--k 4] [--reps 30] [--modes auto/off,auto/on]

A mode is `--cpu-linear[/--batch-invariant[/--quantization[/--cpu-layers[/--activations[/--kv-cache-dtype]]]]]`:
auto/off is the
per-row kernel plan with SDPA attention, auto/on (the default) one oneDNN kernel for every row count with the
batch-invariant attention, and on a GGUF model the file's quantised blocks in the GGUF kernel (`--quantization
auto`) with the decoder layers in C++ (`--cpu-layers auto`); auto/on/none keeps the dequantised fp32 weights,
auto/on/auto/torch the GGUF kernel inside eager torch layers, auto/on/auto/auto/int8 the C++ layers with int8
activations, auto/on/auto/auto/int8/bfloat16 those over a bf16 KV cache.

A step here is `StepEngine.decode_context` + `run_decode` + reading the outputs back: batch building, the target
forward, logits, sampling / rejection sampling and the host sync, exactly what `EngineCore` runs per step.
Verify steps get k random draft tokens (their acceptance does not change the cost). Also prints the plain step
against the memory-bandwidth floor (weight bytes / this host's read bandwidth, measured at the start unless
--bandwidth is given: hosts of this kind read 17-31 GB/s with 2 threads, so a fixed figure misplaces it), the
lowest verify/decode the arithmetic allows at the measured decode step (`arithmetic_floor`: the verify step's extra
rows x the target's multiply-adds a row, at the fewest vector instructions the activations can take them in and
this host's peak rate of those, `fma_rate.cpp`: a step of several rows cannot cost less than that more than a
decode step) and,
with the target's shipped MTP head, one draft-loop iteration of it (head forward + logits + draw, per draft
token) against the plain step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

import numpy as np
import torch

from benchmarks.common import code_prompts, machine, table
from benchmarks.peak_rates import arithmetic_floor, peak_rates
from specstep.engine.engine_config import EngineConfig
from specstep.engine.model_loader import describe_cpu_kernels
from specstep.engine.model_source import default_draft, default_target, resolve_model
from specstep.engine.models.gguf_linear import GGUFLinear
from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler.build import build_engine
from specstep.scheduler.core.request import Request


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of one pass over a `gib` GiB float32 tensor (`x.sum()`, as CPU_NOTES.md measures it), the median of
    `repeats` (the first pass faults the pages in, so it is not counted)."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of weights a decode step reads: the parameters and GGUF blocks (or their AMX tiles copy, which the
    step reads instead), less an embedding whose lm_head reads blocks of its own (a lookup reads a few rows)."""
    tensors = {id(p): p for p in model.parameters()}
    tensors |= {id(w): w for w in (m.kernel_weights for m in model.modules() if isinstance(m, GGUFLinear))}
    if isinstance(getattr(model, "lm_head", None), GGUFLinear):
        tensors.pop(id(model.embed_tokens.weight), None)
    return sum(t.numel() * t.element_size() for t in tensors.values())


class StepTimer:
    """One engine with `batch` requests prefilled; times decode and verify steps at their current position."""

    def __init__(self, cfg: EngineConfig, prompts: list[list[int]], k: int) -> None:
        self.core, _, self.info = build_engine(cfg)
        self.k = k
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        for i, p in enumerate(prompts):
            self.core.add_request(Request(str(i), list(p), params, seed=i))
        self.core.step()  # prefill (reserves k + 1 look-ahead pages per request)
        self.seqs = list(self.core.running)
        self.rng = np.random.default_rng(0)
        self.engine = self.core.engine

    def step(self, k: int) -> float:
        b = len(self.seqs)
        num_draft = np.full(b, k, dtype=np.int64)
        drafts = self.rng.integers(0, self.info.vocab_size, size=(b, k)).tolist() if k else None
        t0 = time.perf_counter()
        ctx = self.engine.decode_context(self.seqs, num_draft, drafts)
        with torch.inference_mode():  # as the engine's device stream runs it
            out = self.engine.run_decode(ctx)
        out.num_accepted.tolist(), out.out_tokens.tolist()  # the step's host sync
        return time.perf_counter() - t0

    def draft_forward(self) -> float:
        """One draft-loop iteration of a model proposer for the batch: its forward over one token per request,
        its logits and the draw, as (propose k drafts - propose 1 draft) / (k - 1); draft 1 comes from the
        carried logits without a forward."""
        prop = self.engine.proposer
        times = {}
        for k in (1, self.k):
            ctx = self.engine.decode_context(self.seqs, np.full(len(self.seqs), k, dtype=np.int64))
            t0 = time.perf_counter()
            with torch.inference_mode():
                drafts, _ = prop.propose(ctx.inputs)
                drafts.tolist()
            times[k] = time.perf_counter() - t0
        return (times[self.k] - times[1]) / (self.k - 1)

    def close(self) -> None:
        self.core.stream.close()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the serving default target")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--modes", default="auto/off,auto/on",
                    help="--cpu-linear[/--batch-invariant on|off[/--quantization auto|none[/--cpu-layers auto|torch"
                         "[/--activations[/--kv-cache-dtype]]]]] settings to compare")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bandwidth", type=float, default=None,
                    help="GB/s for the floor (default: measured here, `read_bandwidth`)")
    ap.add_argument("--busy-core", action="store_true",
                    help="run a busy loop in another process while timing (a core taken by other work: what "
                         "OMP_WAIT_POLICY=PASSIVE and the kernels' thread choice are for)")
    ap.add_argument("--json", help="write the figures here")
    return ap


@contextmanager
def busy_core(on: bool):
    """A spinning process beside the timing (one core's worth of other work), stopped afterwards."""
    if not on:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    args = _parser().parse_args()
    model = str(resolve_model(args.model or default_target().reference))
    head = default_draft("mtp", resolve_model(model))
    batches = [int(b) for b in args.batches.split(",")]
    prompts = code_prompts(max(batches), args.prompt_tokens, seed=3, model=model)
    # The host is shared: its load average before and after says how much the figures can be trusted.
    results: dict = {"machine": machine(), "model": model, "k": args.k, "rows": {},
                     "load_average": {"before": os.getloadavg()}}
    rows = []
    results["busy_core"] = args.busy_core
    with busy_core(args.busy_core):
        for b in batches:
            rows += _measure_batch(args, model, head is not None, prompts, b, max(batches), results)
    results["load_average"]["after"] = os.getloadavg()
    load = ", ".join(f"{k} {v[0]:.1f}" for k, v in results["load_average"].items())
    peaks = ", ".join(f"{name} {rate / 1e9:.2f} G/s" for name, rate in results["peak_rates"].items())
    table(f"step costs, k={args.k} (verify = k + 1 tokens per request), medians of {args.reps} ({machine()}; "
          f"load average {load}; floor at {results['bandwidth_gb_s']:.1f} GB/s"
          f"{f'; peaks {peaks}' if peaks else ''}"
          f"{'; a busy loop on another core' if args.busy_core else ''})",
          ["kernels", "batch", "decode ms", "verify ms", "verify/decode", "arithmetic floor of it", "% of floor",
           "MTP draft/decode"],
          rows)
    for m, text in results["kernels"].items():
        print(f"{m}: {text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def mode_config(mode: str, model: str, spec: str, k: int, threads: int, max_batch: int) -> EngineConfig:
    """The engine a mode names (`--cpu-linear[/--batch-invariant[/--quantization[/--cpu-layers[/--activations
    [/--kv-cache-dtype]]]]]`), inline, greedy-ready, for batches up to `max_batch`."""
    parts = mode.split("/")
    defaults = ["on", "auto", "auto", "fp32", "auto"][len(parts) - 1:]
    linear, invariant, quantization, layers, activations, kv = (parts + defaults)[:6]
    return EngineConfig(model=model, spec=spec, num_spec_tokens=k, overlap=False, threads=threads,
                        cpu_linear=linear, batch_invariant=invariant != "off", quantization=quantization,
                        cpu_layers=layers, activations=activations, kv_cache_dtype=kv, max_batch_size=max_batch)


def _measure_batch(args: argparse.Namespace, model: str, with_mtp: bool, prompts: list[list[int]], b: int,
                   max_batch: int, results: dict) -> list[list]:
    """Table rows for batch size `b`, one per mode; its figures go into `results` (and, on the first call, the
    bandwidth the floor is taken at)."""
    modes = args.modes.split(",")

    # Target steps through the n-gram proposer (host drafts: the step is the target's alone); the MTP head's
    # draft cost from an engine with the head, on the last mode's kernels.
    def timer(m: str, spec: str) -> StepTimer:
        return StepTimer(mode_config(m, model, spec, args.k, args.threads, max_batch), prompts[:b], args.k)

    timers = {m: timer(m, "ngram") for m in modes}
    mtp = timer(modes[-1], "mtp") if with_mtp else None
    if "bandwidth_gb_s" not in results:  # once the engines set torch's threads
        results["bandwidth_gb_s"] = args.bandwidth or read_bandwidth()
        results["peak_rates"] = peak_rates(torch.get_num_threads())
    floors = {m: weight_bytes(t.engine.target) / (results["bandwidth_gb_s"] * 1e9) for m, t in timers.items()}
    # what each mode's engine chose (dtype and why, kernels): the ready line's words, so a figure names its plan
    results.setdefault("kernels", {}).update({m: describe_cpu_kernels(t.engine.target) for m, t in timers.items()})
    samples = _sample(timers, mtp, modes[-1], args.reps, args.k)
    rows = []
    for m, t in timers.items():
        floor_s = floors[m]
        med = {kind: statistics.median(v) for kind, v in samples[m].items() if v}
        spread = {kind: (min(v), max(v)) for kind, v in samples[m].items() if v}
        ratio = med["verify"] / med["decode"]
        draft = med.get("draft")
        # the extra rows' arithmetic at the host's peak (`arithmetic_floor`)
        activations = "fp32" if (m.split("/")[4:] or ["fp32"])[0] == "fp32" else "int8"
        bound = arithmetic_floor(b * (args.k + 1), b * args.k, t.engine.target, activations, results["peak_rates"])
        ratio_floor = 1 + bound[0] / med["decode"] if bound else None
        rows.append([m, b, med["decode"] * 1e3, med["verify"] * 1e3, ratio,
                     f"{ratio_floor:.2f} ({bound[1]})" if bound else "-",
                     f"{100 * floor_s / med['decode']:.0f}%" if b == 1 else "",
                     f"{draft / med['decode']:.3f}" if draft else "-"])
        results["rows"][f"{m}_b{b}"] = {"decode_ms": med["decode"] * 1e3, "verify_ms": med["verify"] * 1e3,
                                         "verify_over_decode": ratio, "floor_ms": floor_s * 1e3,
                                         "verify_over_decode_floor": ratio_floor,
                                         "floor_counts": bound[1] if bound else None,
                                         "draft_over_decode": draft / med["decode"] if draft else None,
                                         "spread_ms": {k: [x * 1e3 for x in v] for k, v in spread.items()}}
        t.close()
    if mtp is not None:
        mtp.close()
    return rows


def _sample(timers: dict[str, StepTimer], mtp: StepTimer | None, mtp_mode: str, reps: int, k: int) -> dict:
    """Seconds per step, by mode and kind (decode, verify; draft under `mtp_mode`, with an MTP engine)."""
    samples: dict = {m: {"decode": [], "verify": [], "draft": []} for m in timers}
    for t in timers.values():
        t.step(0), t.step(k)  # warm-up
    for _ in range(reps):
        for m, t in timers.items():  # alternate settings and step kinds every repetition
            samples[m]["decode"].append(t.step(0))
            samples[m]["verify"].append(t.step(k))
        if mtp is not None:
            samples[mtp_mode]["draft"].append(mtp.draft_forward())
    return samples


if __name__ == "__main__":
    main()
