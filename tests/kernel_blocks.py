"""Random GGUF blocks of every format the kernel layer reads, with edge values: zero scales, extreme quants
(all-0 and all-max nibbles), extreme sub-block scales and mins, negative Q6_K and Q3_K scales. Built byte by
byte in numpy (any byte pattern is a valid block once its fp16 fields are finite)."""

from __future__ import annotations

import numpy as np

BLOCK = {"Q4_0": (32, 18), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q2_K": (256, 84), "Q3_K": (256, 110),
         "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "F16": (32, 64), "BF16": (32, 64),
         "Q4_1": (32, 20), "Q8_0": (32, 34)}
# where each format keeps its fp16 scales (byte offsets in a block)
HALVES = {"Q4_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2),
          "Q5_K": (0, 2), "Q6_K": (208,), "Q4_1": (0, 2), "Q8_0": (0,)}
# each format's bytes other than its fp16 scales: quants, sub-block scales and mins
DATA = {"Q2_K": slice(0, 80), "Q3_K": slice(0, 108), "Q6_K": slice(0, 192)}


def random_blocks(fmt: str, rows: int, in_features: int, seed: int = 0, edges: bool = True) -> np.ndarray:
    """uint8 [rows, in_features / qk * block bytes]: random quants and finite scales; with `edges`, some blocks
    with a zero scale, all-zero or all-ones quant bytes, and all-max sub-block scales."""
    rng = np.random.default_rng(seed)
    qk, nbytes = BLOCK[fmt]
    nblk = in_features // qk
    if fmt == "F16":
        return rng.standard_normal((rows, in_features)).astype(np.float16).view(np.uint8)
    if fmt == "BF16":
        w = rng.standard_normal((rows, in_features)).astype(np.float32)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    blk = rng.integers(0, 256, size=(rows, nblk, nbytes), dtype=np.uint8)
    for off in HALVES[fmt]:
        blk[..., off:off + 2] = rng.uniform(-0.05, 0.05, (rows, nblk)).astype(np.float16).view(np.uint8) \
            .reshape(rows, nblk, 2)
    if edges and rows * nblk >= 8:
        flat = blk.reshape(-1, nbytes)
        first = HALVES[fmt][0]
        flat[0, first:first + 2] = 0  # a zero scale
        data = DATA.get(fmt, slice(max(HALVES[fmt]) + 2, None))
        flat[1, data] = 0  # every quant 0 (and, for K-quants, every sub-block scale and min 0)
        flat[2, data] = 0xFF  # every quant at its maximum; K-quants: every scale and min 63
        if fmt == "Q6_K":
            flat[3, 192:208] = 0x80  # scales -128
            flat[4, 192:208] = 0x7F  # scales 127
    return blk.reshape(rows, nblk * nbytes)
