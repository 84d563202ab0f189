"""The decode linears of a model shape in each GGUF format the kernel layer reads, per activation arithmetic and
ISA, against fp32 weights (what a format without a native kernel ran as: its blocks dequantised to fp32 at load).

A Q4_K_M mix by default (llama.cpp's: Q6_K for attn_v and ffn_down, Q4_K elsewhere) in Qwen2.5-1.5B's shapes;
random blocks (the speed does not depend on the values). Each pass runs every linear of `--layers` layers once at
`rows` rows; the figure is the median of alternating repeats, with the weights' bytes over the time.

    python -m benchmarks.bench_kernel_formats [--layers 4] [--rows 1,5] [--repeats 7]

Timings on a shared host are noisy: compare figures from one run (the forms alternate within it).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from specstep.engine.kernels import binding  # noqa: E402
from tests.kernel_blocks import random_blocks  # noqa: E402


def layer_shapes(hidden: int, inter: int, kv: int) -> list[tuple[str, int, int, str]]:
    """(name, out, in, Q4_K_M's format) of one decoder layer's linears, q/k/v apart (their formats differ)."""
    return [("q", hidden, hidden, "Q4_K"), ("k", kv, hidden, "Q4_K"), ("v", kv, hidden, "Q6_K"),
            ("o", hidden, hidden, "Q4_K"), ("gate_up", 2 * inter, hidden, "Q4_K"), ("down", hidden, inter, "Q6_K")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--inter", type=int, default=8960)
    ap.add_argument("--kv", type=int, default=256, help="k and v rows (kv heads x head dim)")
    ap.add_argument("--model-layers", type=int, default=28, help="to project a whole model's linears per token")
    ap.add_argument("--rows", default="1,5")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--format", default="Q4_K_M", help="Q4_K_M, or one format for every linear")
    args = ap.parse_args()
    shapes = layer_shapes(args.hidden, args.inter, args.kv)
    linears = []
    for layer in range(args.layers):
        for _name, n, k, fmt in shapes:
            fmt = fmt if args.format == "Q4_K_M" else args.format
            blocks = torch.from_numpy(random_blocks(fmt, n, k, seed=layer * 10 + len(linears)))
            linears.append((fmt, n, k, blocks))
    block_bytes = sum(b.numel() for *_, b in linears)
    fp32 = [torch.from_numpy(binding.dequantize(fmt, b).reshape(n, k)) for fmt, n, k, b in linears]
    fp32_bytes = sum(w.numel() * 4 for w in fp32)
    forms: dict[str, tuple[int, object]] = {"fp32 weights (F.linear)": (fp32_bytes, None)}
    for arith in ("fp32", "int8"):
        for isa in binding.ISAS:
            if binding.isa_runs(isa) and all(binding.runs(fmt, arith) for fmt, *_ in linears):
                forms[f"blocks, {arith} activations, {isa}"] = (
                    block_bytes, [binding.linear_kernel(fmt, arith, isa) for fmt, *_ in linears])
    flags = sorted(f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8")
                   if f in open("/proc/cpuinfo").read())
    print(f"{args.format} linears of {args.layers} layers ({block_bytes / 2**20:.0f} MB of blocks, "
          f"{fp32_bytes / 2**20:.0f} MB as fp32), {torch.get_num_threads()} threads, {platform.processor() or ''} "
          f"flags: {' '.join(flags)}")
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, max(args.hidden, args.inter))
        times: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(args.repeats):
            for name, (_, kernels) in forms.items():
                t0 = time.perf_counter()
                if kernels is None:
                    for w in fp32:
                        F.linear(x[:, :w.shape[1]], w)
                else:
                    for (_fmt, n, k, blocks), kern in zip(linears, kernels):
                        binding.linear(x[:, :k], blocks, n, kern)
                times[name].append(time.perf_counter() - t0)
        for name, (nbytes, _) in forms.items():
            med = statistics.median(times[name])
            per_token = med / args.layers * args.model_layers
            print(f"  rows {rows:3d}  {name:36s} {med * 1e3:8.2f} ms  {nbytes / med / 1e9:6.1f} GB/s  "
                  f"({args.model_layers} layers' linears: {per_token * 1e3:7.1f} ms a step)")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
