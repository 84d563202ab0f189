"""A numpy model of the kernel layer's int8 arithmetic (`engine/kernels/formats.h`, `quantize.h`, `linear.inc`),
written from the GGUF block layouts: the integer quants, sub-block scales, offsets and mins of each block, the
activations' per-block quantisation, then per block the exact integer dot product in the SIMD layer's 8 lanes, each
lane's products added into 8 fp32 lanes (`_lanes`, llama.cpp's accumulation); and the K-quants' prompt GEMM
(`int8_gemm.inc`), with exact integer totals a block (`gemm`). The kernels must match it bit for bit."""

from __future__ import annotations

import numpy as np
from gguf.quants import Q4_K

GROUP = 16


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(raw[:, at:at + 2]).view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int64)


def _high_bits(raw: np.ndarray, at: int) -> np.ndarray:
    qh = np.ascontiguousarray(raw[:, at:at + 4]).view(np.uint32)[:, 0]
    return ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64)


def unpack(fmt: str, blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """blocks [nblk, bytes] -> u [nblk, qk], sc / off / mn [nblk, qk / 16] (int64), d / dm [nblk] (float32):
    w = d (sc u - off) + dm mn, per 16-value group. The legacy formats' offsets are in u (u - off, signed: their
    arithmetic's lanes hold sum (u - off) q), with off 0."""
    n = blocks.shape[0]
    ones, zeros = np.ones((n, 2), np.int64), np.zeros((n, 2), np.int64)
    if fmt == "Q4_0":
        return _nibbles(blocks[:, 2:18]) - 8, ones, zeros, zeros, _f16(blocks, 0), np.zeros(n, np.float32)
    if fmt == "Q5_0":
        u = _nibbles(blocks[:, 6:22]) | (_high_bits(blocks, 2) << 4)
        return u - 16, ones, zeros, zeros, _f16(blocks, 0), np.zeros(n, np.float32)
    if fmt == "Q5_1":
        u = _nibbles(blocks[:, 8:24]) | (_high_bits(blocks, 4) << 4)
        return u, ones, zeros, ones, _f16(blocks, 0), _f16(blocks, 2)
    if fmt in ("Q4_K", "Q5_K"):
        sc, mn = (np.repeat(a.astype(np.int64), 2, axis=1) for a in Q4_K.get_scale_min(blocks[:, 4:16].copy()))
        qs = blocks[:, 16:144] if fmt == "Q4_K" else blocks[:, 48:176]
        u = np.concatenate([_nibbles(qs[:, 32 * c:32 * c + 32]) for c in range(4)], axis=1)
        if fmt == "Q5_K":
            qh = blocks[:, 16:48].astype(np.int64)
            u = u | np.concatenate([((qh >> j) & 1) << 4 for j in range(8)], axis=1)
        return u, sc, np.zeros_like(sc), mn, _f16(blocks, 0), -_f16(blocks, 2)
    if fmt in ("Q2_K", "Q3_K"):
        qs = blocks[:, 16:80] if fmt == "Q2_K" else blocks[:, 32:96]
        u = np.zeros((n, 256), np.int64)
        for v in range(256):  # value 128 h + 32 s + l: bits 2 s of byte 32 h + l
            h, s_, lane = v // 128, (v // 32) % 4, v % 32
            u[:, v] = (qs[:, 32 * h + lane].astype(np.int64) >> (2 * s_)) & 3
        if fmt == "Q2_K":
            sc, mn = (blocks[:, :16] & 15).astype(np.int64), (blocks[:, :16] >> 4).astype(np.int64)
            return u, sc, np.zeros_like(sc), mn, _f16(blocks, 80), -_f16(blocks, 82)
        for v in range(256):  # the high bit of value 32 c + l: bit c of byte l
            u[:, v] |= ((blocks[:, v % 32].astype(np.int64) >> (v // 32)) & 1) << 2
        s8 = blocks[:, 96:108].astype(np.int64)
        sc = np.stack([((s8[:, j % 8] >> (4 * (j // 8))) & 15) | (((s8[:, 8 + j % 4] >> (2 * (j // 4))) & 3) << 4)
                       for j in range(16)], axis=1) - 32
        return u, sc, 4 * sc, np.zeros_like(sc), _f16(blocks, 108), np.zeros(n, np.float32)
    if fmt == "Q6_K":
        ql, qh = blocks[:, :128].astype(np.int64), blocks[:, 128:192].astype(np.int64)
        u = np.zeros((n, 256), np.int64)
        for h in range(2):
            for r in range(128):
                lo = (ql[:, 64 * h + r % 64] >> (4 * (r // 64))) & 15
                hi = (qh[:, 32 * h + r % 32] >> (2 * (r // 32))) & 3
                u[:, 128 * h + r] = lo | (hi << 4)
        sc = blocks[:, 192:208].view(np.int8).astype(np.int64)
        return u, sc, 32 * sc, np.zeros_like(sc), _f16(blocks, 208), np.zeros(n, np.float32)
    raise ValueError(f"no int8 arithmetic for {fmt}")


def quantize(x: np.ndarray, qk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [M, K] float32 -> q [M, K / qk, qk], dx [M, K / qk] float32, bs [M, K / 16] int64."""
    m, k = x.shape
    xb = x.reshape(m, k // qk, qk)
    amax = np.abs(xb).max(axis=-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int64)
    return q, (amax / np.float32(127)).astype(np.float32), q.reshape(m, k // GROUP, GROUP).sum(-1)


def linear(fmt: str, qk: int, x: np.ndarray, blocks: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x [M, K] float32 @ W.T by the int8 arithmetic, W as blocks [N, K / qk * bytes] uint8."""
    m, k = x.shape
    n, nb = blocks.shape[0], k // qk
    u, sc, off, mn, d, dm = unpack(fmt, blocks.reshape(n * nb, -1))
    g = qk // GROUP
    u, sc, off, mn = u.reshape(n, nb, qk), sc.reshape(n, nb, g), off.reshape(n, nb, g), mn.reshape(n, nb, g)
    d, dm = d.reshape(n, nb), dm.reshape(n, nb)
    q, dx, bs = quantize(x, qk)
    bs = bs.reshape(m, nb, g)
    acc = _lanes(q, dx, bs, u, sc, off, mn, d, dm, fmt in ("Q5_1", "Q2_K", "Q4_K", "Q5_K"), legacy=qk == 32)
    return acc if bias is None else acc + bias[None, :].astype(np.float32)


def _lanes(q, dx, bs, u, sc, off, mn, d, dm, has_min: bool, legacy: bool) -> np.ndarray:
    """The accumulation: 8 int32 lanes a block and row, lane l holding values 32 c + 4 l .. + 3 of every 32-value
    chunk c (times their group's scale) less groups 2 l and 2 l + 1's offset terms; each lane times d dx (and the
    min terms' lanes times dm dx) added into 8 fp32 lanes, which end in the SIMD layer's fixed horizontal sum (lanes
    l and l + 4, then those pairs 2 apart, then the two left). A legacy block (one 32-value chunk, its offset in u)
    has one min, and its min terms' lane l is the sum of q over lane l's 4 values."""
    m, nb = dx.shape
    n, qk, g = u.shape[0], u.shape[2], sc.shape[2]
    lanes = np.zeros((m, n, 8), np.float32)
    group_of = np.arange(qk) // GROUP
    lane_of = (np.arange(qk) % 32) // 4
    for b in range(nb):
        prod = q[:, None, b, :] * (u[None, :, b, :] * sc[None, :, b, group_of])  # [m, n, qk]
        tot = np.stack([prod[..., lane_of == ln].sum(-1) for ln in range(8)], axis=-1)

        def pair(t, b=b):  # groups 2 l and 2 l + 1's terms in lane l (this block's)
            out = np.zeros((m, n, 8), np.int64)
            out[..., :g // 2] = bs[:, None, b, 0::2] * t[None, :, b, 0::2] + bs[:, None, b, 1::2] * t[None, :, b, 1::2]
            return out

        tot = tot - pair(off)
        lanes = lanes + (d[None, :, b, None] * dx[:, None, b, None]) * tot.astype(np.float32)
        if has_min:
            if legacy:
                mins = np.stack([q[:, b, lane_of == ln].sum(-1) for ln in range(8)], axis=-1)[:, None, :]
            else:
                mins = pair(mn)
            lanes = lanes + (dm[None, :, b, None] * dx[:, None, b, None]) * mins.astype(np.float32)
    s4 = lanes[..., :4] + lanes[..., 4:]
    s2 = s4[..., :2] + s4[..., 2:]
    return s2[..., 0] + s2[..., 1]


def gemm(fmt: str, x: np.ndarray, blocks: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x [M, K] float32 @ W.T by the prompt GEMM (`int8_gemm.inc`): per block the exact integer totals
    S = sum_j sc_j (sum_i u_i q_i) - sum_j off_j bs_j and T = sum_j mn_j bs_j (a legacy block: S = sum (u - off) q,
    T = sum q), then in fp32, each operation rounded, acc + float(S) (d dx) and, for formats with a min,
    + float(T) (dm dx), over the blocks in order; then the bias."""
    qk = 32 if fmt in ("Q4_0", "Q5_0", "Q5_1") else 256
    m, k = x.shape
    n, nb, g = blocks.shape[0], k // qk, qk // GROUP
    u, sc, off, mn, d, dm = unpack(fmt, blocks.reshape(n * nb, -1))
    u, sc, off, mn = u.reshape(n, nb, qk), sc.reshape(n, nb, g), off.reshape(n, nb, g), mn.reshape(n, nb, g)
    d, dm = d.reshape(n, nb), dm.reshape(n, nb)
    q, dx, bs = quantize(x, qk)
    bs = bs.reshape(m, nb, g)
    has_min = fmt in ("Q2_K", "Q4_K", "Q5_K", "Q5_1")
    acc = np.zeros((m, n), np.float32)
    for b in range(nb):
        dots = (q[:, None, b, :] * u[None, :, b, :]).reshape(m, n, g, GROUP).sum(-1)  # [m, n, groups]
        s = (dots * sc[None, :, b, :]).sum(-1) - (bs[:, None, b, :] * off[None, :, b, :]).sum(-1)
        acc = acc + s.astype(np.float32) * (d[None, :, b] * dx[:, None, b])
        if has_min:
            t = (bs[:, None, b, :] * mn[None, :, b, :]).sum(-1)
            acc = acc + t.astype(np.float32) * (dm[None, :, b] * dx[:, None, b])
    return acc if bias is None else acc + bias[None, :].astype(np.float32)
