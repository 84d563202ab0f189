"""The C++ attention kernel alone, its AVX2 form against its AVX-512 form, over fp32 and bf16 caches
(`--kv-cache-dtype`): a step's 30 layers of paged attention over SmolLM2-135M's heads (9 query heads, 3 KV heads of
64), every lane at --keys keys in pages scattered over the cache, per batch and query rows a lane (1: decode, 5: a
verify step of k = 4), side by side in one run (the settings alternate every repetition).

    python -m benchmarks.bench_attention [--batches 1,8] [--rows 1,5] [--keys 150] [--reps 15] [--threads 2]
                                         [--kv-dtypes float32,bfloat16]

Between two layers' calls a pass over 2.3 MB (a layer's Q4_1 weights) pushes the caches out as a step's linears
do; it is not timed. Each call is a ctypes call from Python (~20-30 us of it a call, 30 a step, in both forms), so
the ratio understates the kernels' own; bench_steps gives the step's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import specstep.engine.batch_builder as bb
from benchmarks.common import machine, table
from specstep.engine.attention import cpu_attention

HEADS, KV_HEADS, HEAD_DIM, PAGE, LAYERS = 9, 3, 64, 16, 30
LAYER_WEIGHTS = 2_300_000  # bytes of one SmolLM2 layer's Q4_1 linears


def paged_step(batch: int, rows: int, keys: int, seed: int = 0) -> tuple:
    """q, per-layer K and V caches and the step's metadata: `batch` lanes of `rows` query rows after `keys` keys,
    their pages a random permutation of the cache's."""
    g = torch.Generator().manual_seed(seed)
    pages = -(-(keys + rows) // PAGE)
    order = (torch.randperm(batch * pages, generator=g) + 1).tolist()  # page 0 is the dummy page
    tables = [order[i * pages: (i + 1) * pages] for i in range(batch)]
    slots = (batch * pages + 1) * PAGE
    k = [torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    v = [torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    q = torch.randn(batch * rows, HEADS * HEAD_DIM, generator=g)
    meta = bb.build_forward_batch([[0] * rows] * batch, [keys] * batch, tables, PAGE, "cpu").attn
    return q, k, v, meta


def as_dtype(step: tuple, dtype: torch.dtype) -> tuple:
    """The step with its caches in `dtype`."""
    q, k, v, meta = step
    return q, [c.to(dtype) for c in k], [c.to(dtype) for c in v], meta


def step_seconds(step: tuple, threads: int, flush: torch.Tensor) -> float:
    q, k, v, meta = step
    total = 0.0
    for layer in range(LAYERS):
        flush.sum()
        t0 = time.perf_counter()
        cpu_attention.cpu_attention(q, k[layer], v[layer], meta, HEADS, HEAD_DIM ** -0.5, threads=threads)
        total += time.perf_counter() - t0
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rows", default="1,5")
    ap.add_argument("--keys", type=int, default=150)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-dtypes", default="float32", help="cache dtypes to compare: float32, bfloat16")
    args = ap.parse_args()
    dtypes = {name: getattr(torch, name, None) for name in args.kv_dtypes.split(",")}
    if not set(dtypes.values()) <= set(cpu_attention.KV_DTYPES):
        raise SystemExit(f"--kv-dtypes: the kernel reads float32 and bfloat16, got {args.kv_dtypes}")
    if cpu_attention.unavailable():
        raise SystemExit(f"the attention kernel cannot run here: {cpu_attention.unavailable()}")
    lib = cpu_attention._build()[0]
    forms = ["avx2"] + (["avx512"] if lib.cpu_attention_use_avx512(1) else [])
    cases = [(b, r) for b in map(int, args.batches.split(",")) for r in map(int, args.rows.split(","))]
    steps = {(c, d): as_dtype(paged_step(*c, args.keys), dtype) for c in cases for d, dtype in dtypes.items()}
    settings = [(f, d) for f in forms for d in dtypes]
    flush = torch.ones(LAYER_WEIGHTS // 4)
    seconds: dict = {(c, f, d): [] for c in cases for f, d in settings}
    for _ in range(args.reps):
        for c in cases:
            for f, d in settings:
                lib.cpu_attention_use_avx512(int(f == "avx512"))
                seconds[c, f, d].append(step_seconds(steps[c, d], args.threads, flush))
    lib.cpu_attention_use_avx512(1)
    rows = []
    for c in cases:
        base = statistics.median(seconds[(c, *settings[0])])
        for f, d in settings:
            s = seconds[c, f, d]
            med = statistics.median(s)
            rows.append([f, d, c[0], c[1], f"{med * 1e3:.2f} [{min(s) * 1e3:.2f}-{max(s) * 1e3:.2f}]",
                         f"{base / med:.2f}"])
    table(f"attention kernel, {LAYERS} layers a step, {args.keys} keys a lane, medians of {args.reps} "
          f"({machine()}; {args.threads} threads)",
          ["form", "cache", "batch", "rows a lane", "ms a step", f"speed vs {' '.join(settings[0])}"], rows)


if __name__ == "__main__":
    main()
