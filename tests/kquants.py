"""K-quant blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) from fp32 weights in numpy, for test checkpoints (the `gguf` package
dequantises these formats but does not quantise them). Plain min/max scales, not llama.cpp's search: any blocks
are a valid checkpoint; these are near the weights they came from."""

from __future__ import annotations

import numpy as np


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0)


def _scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins [n, 8] -> 12 bytes [n, 12] (gguf's Q4_K.get_scale_min, inverted)."""
    s = np.zeros((sc.shape[0], 12), np.uint8)
    for j in range(4):
        s[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        s[:, j + 4] = (mn[:, j] & 63) | ((mn[:, j + 4] >> 4) << 6)
        s[:, j + 8] = (sc[:, j + 4] & 15) | ((mn[:, j + 4] & 15) << 4)
    return s


def _k_min_max(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """x [n, 8, 32] -> d, dmin (fp16 [n]), scales, mins (uint8 [n, 8]), q [n, 8, 32]."""
    lo, hi = np.minimum(x.min(-1), 0), x.max(-1)
    scale = (hi - lo) / levels
    d, dmin = _f16(scale.max(-1) / 63), _f16((-lo).max(-1) / 63)
    sc = np.clip(np.rint(_div(scale, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_div(-lo, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.rint(_div(x + offset[..., None], step[..., None])), 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """q [n, 8, 32] (< 16) -> 128 bytes: sub-blocks 2c and 2c + 1 in the low and high nibbles of bytes 32 c.."""
    return np.concatenate([q[:, 2 * c] | (q[:, 2 * c + 1] << 4) for c in range(4)], axis=1)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    x = w.reshape(-1, 8, 32).astype(np.float32)
    d, dmin, sc, mn, q = _k_min_max(x, 15)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                             _scales_k4(sc, mn), _nibbles(q)], axis=1)
    return blocks.reshape(w.shape[0], -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    x = w.reshape(-1, 8, 32).astype(np.float32)
    d, dmin, sc, mn, q = _k_min_max(x, 31)
    qh = np.zeros((x.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= ((q[:, j] >> 4) & 1) << j
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                             _scales_k4(sc, mn), qh, _nibbles(q & 15)], axis=1)
    return blocks.reshape(w.shape[0], -1)


def _symmetric(w: np.ndarray, levels: int, most_scale: int) -> tuple[np.ndarray, ...]:
    """Per 16 values a signed scale (at most `most_scale` steps of a block's fp16 d) and quants -levels..levels - 1,
    stored plus `levels`: d [n], sc [n, 16] int64, q [n, 256] uint8."""
    x = w.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / levels
    d = _f16(scale.max(-1) / most_scale)
    sc = np.clip(np.rint(_div(scale, d.astype(np.float32)[:, None])), -most_scale - 1, most_scale).astype(np.int64)
    step = d.astype(np.float32)[:, None] * sc
    q = (np.clip(np.rint(_div(x, step[..., None])), -levels, levels - 1) + levels).astype(np.uint8)
    return d, sc, q.reshape(-1, 256)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    d, sc, q = _symmetric(w, 32, 127)
    sc = sc.astype(np.int8)
    n = q.shape[0]
    ql, qh = np.zeros((n, 128), np.uint8), np.zeros((n, 64), np.uint8)
    for h in range(2):
        for r in range(128):
            v = q[:, 128 * h + r]
            ql[:, 64 * h + r % 64] |= (v & 15) << (4 * (r // 64))
            qh[:, 32 * h + r % 32] |= (v >> 4) << (2 * (r // 32))
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(w.shape[0], -1)


def _plane2(q: np.ndarray) -> np.ndarray:
    """q [n, 256] (< 4) -> 64 bytes: value 128 h + 32 s + l in bits 2 s of byte 32 h + l."""
    out = np.zeros((q.shape[0], 64), np.uint8)
    for v in range(256):
        out[:, 32 * (v // 128) + v % 32] |= q[:, v] << (2 * ((v // 32) % 4))
    return out


def quantize_q2_k(w: np.ndarray) -> np.ndarray:
    """Per 16 values a 4-bit scale and min over a block's fp16 d and dmin; 2-bit quants."""
    x = w.reshape(-1, 16, 16).astype(np.float32)
    lo, hi = np.minimum(x.min(-1), 0), x.max(-1)
    scale = (hi - lo) / 3
    d, dmin = _f16(scale.max(-1) / 15), _f16((-lo).max(-1) / 15)
    sc = np.clip(np.rint(_div(scale, d.astype(np.float32)[:, None])), 0, 15).astype(np.uint8)
    mn = np.clip(np.rint(_div(-lo, dmin.astype(np.float32)[:, None])), 0, 15).astype(np.uint8)
    step, offset = d.astype(np.float32)[:, None] * sc, dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.rint(_div(x + offset[..., None], step[..., None])), 0, 3).astype(np.uint8).reshape(-1, 256)
    blocks = np.concatenate([sc | (mn << 4), _plane2(q), d.view(np.uint8).reshape(-1, 2),
                             dmin.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(w.shape[0], -1)


def quantize_q3_k(w: np.ndarray) -> np.ndarray:
    """Per 16 values a signed 6-bit scale over a block's fp16 d; quants -4..3 (low 2 bits, and a high bit that is
    set unless the value is negative)."""
    d, sc, q = _symmetric(w, 4, 31)
    hmask = np.zeros((q.shape[0], 32), np.uint8)
    for v in range(256):
        hmask[:, v % 32] |= (q[:, v] >> 2) << (v // 32)
    s6 = (sc + 32).astype(np.uint8)
    scales = np.zeros((q.shape[0], 12), np.uint8)
    for j in range(16):
        scales[:, j % 8] |= (s6[:, j] & 15) << (4 * (j // 8))
        scales[:, 8 + j % 4] |= (s6[:, j] >> 4) << (2 * (j // 4))
    blocks = np.concatenate([hmask, _plane2(q & 3), scales, d.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(w.shape[0], -1)


QUANTIZERS = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k,
              "Q6_K": quantize_q6_k}
