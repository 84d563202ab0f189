"""The GGUF kernel alone, fp32 against int8 activations: one pass over a SmolLM2-135M-shaped stack of Q4_1
weights (30 layers of qkv, o, gate_up and down: 66 MB of blocks, past the L3 cache, as a decode step reads them),
per row count and thread count, side by side in one run (settings alternate every repetition).

    python -m benchmarks.bench_gguf_kernel [--rows 1,5,8] [--threads 1,2] [--reps 15] [--activations fp32,int8]

Activations: fp32, int8 (AVX2 lanes over the blocks as they are), int8-packed (the same lanes and bits over
`lanes_pack`'s copy: what the loader runs on AVX2 hosts), where the host has AMX-INT8 int8-tiles (the tiles at every
row count: their crossover with int8-vnni sets `gguf_amx.cpp`'s default), and where it has AVX-512 VNNI int8-vnni
(`amx_pack`'s copy and the tiles' bits in AVX-512 VNNI lanes at every row count: what the loader runs there
without AMX). The prompt GEMMs the C++ layers give prompt rows: gemm-fp32 (the dequantised blocks in fp32 panels,
`gguf_gemm.cpp`) and, where the host has AMX-BF16, gemm-bf16-tiles (bf16 weights and rows in AMX-BF16 tiles over
`amx_pack`'s copy, `gguf_amx_bf16.cpp`: prompt rows of int8-tiles); compare them with int8-tiles at prompt row
counts (`--rows 128,1024`).

Answers "is it the kernel or the step around it" when a step-level figure (bench_steps) moves on a new host.
The blocks are random nibbles with fixed scales: the kernel's time does not depend on the values. Each linear is
its own call here (121 a pass), where a step's C++ layers make one call: with several threads and
OMP_WAIT_POLICY=PASSIVE each call wakes sleeping threads, so compare activations at one thread count, and trust
threads=1 for the kernel's own rate.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from benchmarks.common import machine, table
from specstep.engine.models.gguf_kernel import (
    amx_lane_rows,
    amx_pack,
    bf16_tiles_unavailable,
    gguf_gemm,
    gguf_linear,
    kernel_fmt,
    lanes_pack,
    tiles_unavailable,
    unavailable,
    vnni_unavailable,
)

BLOCK, Q4_1_BYTES = 32, 20  # a Q4_1 block: fp16 d, fp16 m, 16 bytes of nibbles for 32 weights
HIDDEN, INTERMEDIATE, LAYERS, KV = 576, 1536, 30, 192  # SmolLM2-135M
# (out, in) of one layer's linears as the engine merges them
LAYER_SHAPES = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def q4_1_blocks(out_features: int, in_features: int, rng: np.random.Generator) -> torch.Tensor:
    nb = in_features // BLOCK
    raw = rng.integers(0, 256, size=(out_features, nb, Q4_1_BYTES), dtype=np.uint8)
    scales = np.array([0.01, -0.08], dtype=np.float16).view(np.uint8)  # d, m: finite, like a real file's
    raw[:, :, :4] = scales
    return torch.from_numpy(raw.reshape(out_features, nb * Q4_1_BYTES))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,5,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--activations", default="fp32,int8", help="of fp32, int8, int8-packed, int8-tiles, int8-vnni, "
                    "gemm-fp32, gemm-bf16-tiles")
    args = ap.parse_args()
    acts = args.activations.split(",")
    amx = [a for a in acts if a in ("int8-tiles", "int8-vnni", "gemm-bf16-tiles")]  # the forms over amx_pack's copy
    if "gemm-bf16-tiles" in acts and bf16_tiles_unavailable():
        raise SystemExit(f"gemm-bf16-tiles: AMX-BF16 tiles cannot run here: {bf16_tiles_unavailable()}")
    if "int8-tiles" in acts and tiles_unavailable():
        raise SystemExit(f"int8-tiles: AMX tiles cannot run here: {tiles_unavailable()}")
    if "int8-vnni" in acts and vnni_unavailable():
        raise SystemExit(f"int8-vnni: AVX-512 VNNI lanes cannot run here: {vnni_unavailable()}")
    if unavailable():
        raise SystemExit(f"GGUF kernel unavailable: {unavailable()}")
    rng = np.random.default_rng(0)
    stack = [(q4_1_blocks(o, i, rng), o, i) for _ in range(LAYERS) for o, i in LAYER_SHAPES]
    tiles = [amx_pack(b, "Q4_1", i) for b, _, i in stack] if amx else None  # the same bytes a weight
    lanes = [lanes_pack(b, "Q4_1", i) for b, _, i in stack] if "int8-packed" in acts else None
    nbytes = sum(b.numel() for b, _, _ in stack)
    settings = [(act, rows, threads) for act in acts for rows in map(int, args.rows.split(","))
                for threads in map(int, args.threads.split(","))]
    xs = {r: {i: torch.randn(r, i) for i in (HIDDEN, INTERMEDIATE)} for r in map(int, args.rows.split(","))}

    def one_pass(act: str, rows: int, threads: int) -> float:
        gemm = act.startswith("gemm-")
        fmt = kernel_fmt("Q4_1", "int8-tiles" if act == "gemm-bf16-tiles" else "fp32" if gemm else act)
        weights = tiles if act in amx else lanes if act == "int8-packed" else [b for b, _, _ in stack]
        run = gguf_gemm if gemm else gguf_linear
        if act == "int8-tiles":
            amx_lane_rows(0)
        try:
            t0 = time.perf_counter()
            for w, (_, out, inp) in zip(weights, stack):
                run(xs[rows][inp], w, out, fmt, threads=threads)
            return time.perf_counter() - t0
        finally:
            if act == "int8-tiles":
                amx_lane_rows(-1)

    times: dict[tuple, list[float]] = {s: [] for s in settings}
    for s in settings:  # warm: builds, first touches
        one_pass(*s)
    for _ in range(args.reps):
        for s in settings:
            times[s].append(one_pass(*s))
    rows = []
    for act, r, th in settings:
        med = statistics.median(times[(act, r, th)])
        fp32 = statistics.median(times[(acts[0], r, th)])
        lo, hi = min(times[(act, r, th)]), max(times[(act, r, th)])
        rows.append([act, r, th, f"{med * 1e3:.2f} [{lo * 1e3:.2f}-{hi * 1e3:.2f}]", f"{nbytes / med / 1e9:.1f}",
                     f"{fp32 / med:.2f}"])
    table(f"GGUF kernel, one pass over {LAYERS} SmolLM2-shaped layers of Q4_1 ({nbytes / 1e6:.0f} MB), medians of "
          f"{args.reps} [min-max] ({machine()})",
          ["activations", "rows", "threads", "ms a pass", "GB/s", f"speed vs {acts[0]}"], rows)


if __name__ == "__main__":
    main()
