"""The GGUF kernel (`engine/kernels/gguf_kernel.cpp`) and the linears that use it: results are the dequantised
weights' products up to fp32 rounding (with int8 activations: the quantised activations' products, the header's
arithmetic), and every row's bits are independent of the rows beside it and of the threads. Loading a checkpoint
onto it: `test_gguf_model_linears.py`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specstep.engine.models import gguf_kernel
from specstep.engine.models.gguf_kernel import (
    amx_pack,
    gguf_gemm,
    gguf_linear,
    lanes_pack,
    tiles_unavailable,
    unavailable,
    vnni_unavailable,
)
from specstep.engine.models.gguf_linear import dequantize

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=f"GGUF kernel unavailable: {unavailable()}")

FORMATS = ["Q4_1", "Q8_0"]
TILES = [pytest.param("int8-tiles", marks=pytest.mark.skipif(bool(tiles_unavailable()),
                                                              reason=f"AMX tiles: {tiles_unavailable()}"))]
NO_VNNI = pytest.mark.skipif(bool(vnni_unavailable()), reason=f"AVX-512 VNNI: {vnni_unavailable()}")
VNNI = [pytest.param("int8-vnni", marks=NO_VNNI)]
KERNEL_FORMATS = [*FORMATS, "Q4_1/int8", "Q8_0/int8", "Q4_1/int8-packed"] + [
    pytest.param(f"{f}/{a}", marks=m[0].marks)
    for f in FORMATS for a, m in (("int8-tiles", TILES), ("int8-vnni", VNNI))]


def weights_for(fmt: str, blocks: torch.Tensor, cols: int) -> torch.Tensor:
    """What kernel format `fmt` reads: the blocks, or their AMX tiles or lanes copy."""
    pack = amx_pack if fmt.endswith(("-tiles", "-vnni")) else lanes_pack if fmt.endswith("-packed") else None
    return blocks if pack is None else pack(blocks, fmt.split("/")[0], cols)


def quantised(fmt: str, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    import gguf

    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    blocks = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[fmt]))
    return blocks, dequantize(fmt, blocks, cols)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_is_the_dequantised_product_to_fp32_rounding(fmt):
    blocks, w = quantised(fmt, 200, 576)
    x, bias = torch.randn(9, 576), torch.randn(200)
    ref = x.double() @ w.double().T + bias.double()
    got = gguf_linear(x, blocks, 200, fmt, bias)
    fp32 = torch.nn.functional.linear(x, w, bias)
    # as close to the fp64 result as torch's own fp32 linear on the same weights (within 2x)
    assert (got.double() - ref).abs().max() <= 2 * (fp32.double() - ref).abs().max() + 1e-6
    assert got.shape == (9, 200) and got.dtype == torch.float32


def int8_reference(x: torch.Tensor, blocks: torch.Tensor, fmt: str, bias: torch.Tensor) -> torch.Tensor:
    """fp64 of `gguf_kernel.cpp`'s int8 arithmetic: each 32-value block of a row quantised in fp32 (d = amax / 127,
    q = round-half-even(x * (127 / amax)), s = d sum(q): llama.cpp's Q8_1), then sum_b d_w d_x (q_w . q_x) + m_w s."""
    xb = x.numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1)
    d_x = amax / np.float32(127)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q_x = np.rint(xb * inv[..., None]).astype(np.float64)  # fp32 product, then nearest-even
    raw = blocks.numpy().reshape(blocks.shape[0], xb.shape[1], -1)
    d_w = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    if fmt == "Q4_1":
        m_w = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        q_w = np.concatenate([raw[..., 4:] & 15, raw[..., 4:] >> 4], -1).astype(np.float64)
    else:
        m_w, q_w = np.zeros_like(d_w), raw[..., 2:].view(np.int8).astype(np.float64)
    dots = np.einsum("mbk,nbk->mnb", q_x, q_w)
    s_x = d_x.astype(np.float64) * q_x.sum(-1)
    y = (dots * d_x[:, None, :] * d_w[None]).sum(-1) + (m_w[None] * s_x[:, None]).sum(-1)
    return torch.from_numpy(y + bias.double().numpy())


@pytest.mark.parametrize("acts", ["int8", *TILES, *VNNI])
def test_int8_q4_1_errs_as_the_quantised_activations_product(acts):
    """Quality: Q4_1 times int8 activations errs from the exact product as the dequantised weights times the
    dequantised activations do (llama.cpp's arithmetic), not more. Its offset must multiply the quantised x: with x's
    exact sum instead, the error is the uncentred nibbles' (d u) times x's rounding, about twice as large."""
    blocks, w = quantised("Q4_1", 256, 576, seed=5)
    x = torch.randn(16, 576) * torch.rand(1, 576) * 3  # channels of different scales, as hidden states have
    got = gguf_linear(x, weights_for(f"Q4_1/{acts}", blocks, 576), 256, f"Q4_1/{acts}").double()
    xb = x.numpy().reshape(16, -1, 32)
    d_x = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    x_hat = torch.from_numpy((np.rint(xb / d_x) * d_x).reshape(16, 576)).double()
    exact = x.double() @ w.double().T
    ref_err = (x_hat @ w.double().T - exact).norm()
    assert (got - exact).norm() <= 1.05 * ref_err


@pytest.mark.parametrize("acts", ["int8", *TILES, *VNNI])
@pytest.mark.parametrize("fmt", FORMATS)
def test_int8_activations_compute_the_quantised_product(fmt, acts):
    """`--activations int8`: the kernel's result is the quantised activations' product with the blocks (fp64
    reference of the header's arithmetic) to fp32 rounding, a row of zeros and a block of ties included, and it
    is the fp32 product to within int8 quantisation's error; in AVX2 lanes, in AMX tiles and in AVX-512 VNNI lanes
    over the tiles' copy (200 outputs: 12 whole 16-row groups and a partial one)."""
    blocks, w = quantised(fmt, 200, 576, seed=3)
    x, bias = torch.randn(9, 576), torch.randn(200)
    x[3] = 0.0  # amax = 0: d = 0, q = 0
    x[4, :32] = torch.tensor([127.0, 0.5, -0.5, 1.5, -2.5] + [0.25] * 27)  # x * 127 / amax lands on .5: ties
    ref = int8_reference(x, blocks, fmt, bias)
    got = gguf_linear(x, weights_for(f"{fmt}/{acts}", blocks, 576), 200, f"{fmt}/{acts}", bias)
    assert got.dtype == torch.float32 and got.shape == (9, 200)
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(got[3], bias)
    gaussian = [0, 1, 2, 5, 6, 7, 8]  # (row 4's outlier makes its first block coarse)
    exact = x[gaussian].double() @ w.double().T + bias.double()
    err = (got[gaussian].double() - exact).abs().max() / exact.abs().max()
    assert 1e-4 < err < 3e-2  # quantised (not the fp32 product), and close to it


def test_int8_activations_reject_inputs_wider_than_the_kernel_takes():
    blocks, _ = quantised("Q8_0", 2, 32 * 1025)
    with pytest.raises(gguf_kernel.KernelError, match="returned -1"):
        gguf_linear(torch.randn(1, 32 * 1025), blocks, 2, "Q8_0/int8")
    assert gguf_linear(torch.randn(1, 32 * 1025), blocks, 2, "Q8_0").shape == (1, 2)


@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_threads(fmt):
    """Every row count a step can have (1 to 40: decode, verify, mixed) and prompts of 130 and 1,100 rows (past the
    kernel's 256-row blocks at this width), every row position, 1 and 2 threads: bitwise the row alone."""
    blocks, _ = quantised(fmt.split("/")[0], 67, 192, seed=1)  # 67 rows: a partial last work item
    blocks = weights_for(fmt, blocks, 192)
    x = torch.randn(1100, 192)
    alone = torch.cat([gguf_linear(x[i: i + 1], blocks, 67, fmt, threads=1) for i in range(1100)])
    for m in [*range(1, 18), 40, 130, 1100]:
        for start in {0, 3, 1100 - m}:
            if start + m <= 1100:
                got = gguf_linear(x[start: start + m], blocks, 67, fmt, threads=2)
                assert torch.equal(got, alone[start: start + m]), (m, start)


@pytest.mark.parametrize("fmt", FORMATS)
def test_amx_pack_holds_every_block_byte_once_in_the_tile_layout(fmt):
    """The AMX copy (`gguf_amx.cpp`'s layout, on any host): per 16-row group and block, the rows' d's, m's (Q4_1)
    and quantised bytes in 4-byte columns; rows past the last are zeros."""
    k, n = 96, 35
    blocks, _ = quantised(fmt, n, k, seed=4)
    raw = blocks.numpy().reshape(n, k // 32, -1)
    size = raw.shape[-1]
    packed = amx_pack(blocks, fmt, k).numpy()
    groups, nblk = 3, k // 32
    pad = np.zeros((groups * 16, nblk, size), np.uint8)
    pad[:n] = raw
    per = packed.reshape(groups, nblk, -1)  # [group, block, bytes]
    by_row = pad.reshape(groups, 16, nblk, size).transpose(0, 2, 1, 3)  # [group, block, row, block bytes]
    heads = 4 if fmt == "Q4_1" else 2  # d (and m)
    assert np.array_equal(per[..., :32], by_row[..., 0:2].reshape(groups, nblk, 32))
    if fmt == "Q4_1":
        assert np.array_equal(per[..., 32:64], by_row[..., 2:4].reshape(groups, nblk, 32))
    qs = by_row[..., heads:].reshape(groups, nblk, 16, -1, 4).transpose(0, 1, 3, 2, 4)  # [.., column k, row, 4]
    assert np.array_equal(per[..., 16 * heads:], qs.reshape(groups, nblk, -1))
    assert packed.size == groups * nblk * (20 if fmt == "Q4_1" else 34) * 16


def test_lanes_pack_lays_out_a_rows_block_pairs_then_its_ds_and_ms():
    """The lanes copy of Q4_1 (`gguf_int8.cpp`): per weight row, its blocks in pairs of 32 bytes (weight j of block
    2p in byte j's low nibble, of block 2p + 1 in its high one; an odd last block pairs with zeros), then its d's
    and its m's as fp16, each zero-padded to whole 8-block chunks. Another GGML type is refused."""
    k, n = 96, 5  # 3 blocks: a pair and an odd one
    blocks, _ = quantised("Q4_1", n, k, seed=4)
    raw = blocks.numpy().reshape(n, k // 32, 20)
    packed = lanes_pack(blocks, "Q4_1", k).numpy().reshape(n, -1)
    assert packed.shape[1] == 2 * 32 + 8 * 2 * 2
    qs = raw[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [row, block, weight j] in index order
    q = np.concatenate([q, np.zeros((n, 1, 32), np.uint8)], axis=1)  # the odd block's empty partner
    assert np.array_equal(packed[:, :64].reshape(n, 2, 32), q[:, 0::2] | (q[:, 1::2] << 4))
    d, m = packed[:, 64:80].reshape(n, 8, 2), packed[:, 80:96].reshape(n, 8, 2)
    assert np.array_equal(d[:, :3], raw[..., 0:2]) and np.array_equal(m[:, :3], raw[..., 2:4])
    assert not d[:, 3:].any() and not m[:, 3:].any()
    with pytest.raises(gguf_kernel.KernelError, match="gguf_lanes_pack"):
        lanes_pack(quantised("Q8_0", n, k)[0], "Q8_0", k)


@pytest.mark.parametrize("k", [576, 544, 64, 32])
def test_lanes_copy_gives_the_blocks_bits(k):
    """Q4_1 with int8 activations reads `lanes_pack`'s copy ("int8-packed", what the loader uses): every output is
    bitwise the same call's over the blocks as they are ("int8"), at 1-17 and 40 rows (the tiles of 1 row x 4
    weight rows, 2 x 2, up to 8 x 1, the software prefetch at few rows), 1 and 2 threads, a partial last tile of
    weight rows and a bias; even and odd block counts and one block; a row of zeros and a block of ties."""
    blocks, _ = quantised("Q4_1", 67, k, seed=7)
    packed, bias = lanes_pack(blocks, "Q4_1", k), torch.randn(67)
    x = torch.randn(40, k)
    x[2] = 0.0
    x[5, :32] = torch.tensor([127.0, 0.5, -0.5, 1.5, -2.5] + [0.25] * 27)
    for rows in [*range(1, 18), 40]:
        for threads in (1, 2):
            want = gguf_linear(x[:rows], blocks, 67, "Q4_1/int8", bias, threads=threads)
            got = gguf_linear(x[:rows], packed, 67, "Q4_1/int8-packed", bias, threads=threads)
            assert torch.equal(got, want), (rows, threads)


@pytest.mark.skipif(bool(tiles_unavailable()), reason=f"AMX tiles: {tiles_unavailable()}")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [576, 544, 64, 32])
def test_amx_formats_give_the_same_bits_in_lanes_and_in_tiles(fmt, k):
    """Few rows of the AMX formats run in AVX-512 VNNI lanes over the tile layout (Q8_0's weights sign-flipped to
    unsigned and each block's sum corrected by -128 sum(q_x)): every output is bitwise the tiles', at 1-8 rows, 1
    and 2 threads, a partial last 16-row group and a bias; and both are the quantised product (fp64 reference of
    the arithmetic), a row of zeros and a block of saturating activations included. Even and odd block counts
    (the tiles take blocks in two sets in turn, each read out two blocks later), one block, and calls of more
    rows than lanes take (several tile passes) against each row alone."""
    blocks, _ = quantised(fmt, 67, k, seed=7)
    tiles, bias = amx_pack(blocks, fmt, k), torch.randn(67)
    x = torch.randn(40, k)
    x[2] = 0.0
    x[5, :32] = 50.0 * torch.sign(torch.randn(32))  # q_x = +-127 throughout a block: Q8_0's correction at its most
    kfmt = f"{fmt}/int8-tiles"
    ref = int8_reference(x[:8], blocks, fmt, bias)
    try:
        for rows in range(1, 9):
            for threads in (1, 2):
                gguf_kernel.amx_lane_rows(0)
                in_tiles = gguf_linear(x[:rows], tiles, 67, kfmt, bias, threads=threads)
                gguf_kernel.amx_lane_rows(8)
                in_lanes = gguf_linear(x[:rows], tiles, 67, kfmt, bias, threads=threads)
                assert torch.equal(in_lanes, in_tiles), (rows, threads)
                assert (in_lanes.double() - ref[:rows]).abs().max() <= 1e-5 * ref.abs().max(), (rows, threads)
        gguf_kernel.amx_lane_rows(1)
        alone = torch.cat([gguf_linear(x[r:r + 1], tiles, 67, kfmt, bias) for r in range(40)])
        gguf_kernel.amx_lane_rows(-1)
        for rows in (9, 16, 17, 40):
            assert torch.equal(gguf_linear(x[:rows], tiles, 67, kfmt, bias, threads=2), alone[:rows]), rows
    finally:
        gguf_kernel.amx_lane_rows(-1)


@NO_VNNI
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [576, 544, 64, 32])
def test_vnni_format_is_the_tiles_arithmetic_at_every_row_count(fmt, k):
    """"int8-vnni" (AVX-512 VNNI lanes over the tile layout at every row count, for hosts without AMX): the
    quantised product (fp64 reference) at 1-17 and 40 rows, a row of zeros and a block of saturating activations
    included; every row bitwise itself alone whatever the rows beside it (passes of at most 8 rows a group, of
    near-equal sizes) and the threads; and where the host has AMX, bitwise the tiles' at every row count. Q8_0 past
    the corrections' stack buffer (8,192 block sums: prompts' rows in chunks) too."""
    blocks, _ = quantised(fmt, 67, k, seed=7)
    packed, bias = amx_pack(blocks, fmt, k), torch.randn(67)
    x = torch.randn(40, k)
    x[2] = 0.0
    x[5, :32] = 50.0 * torch.sign(torch.randn(32))
    kfmt = f"{fmt}/int8-vnni"
    ref = int8_reference(x, blocks, fmt, bias)
    alone = torch.cat([gguf_linear(x[r:r + 1], packed, 67, kfmt, bias, threads=1) for r in range(40)])
    assert (alone.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    for rows in [*range(1, 18), 40]:
        for start in {0, 40 - rows}:
            for threads in (1, 2):
                got = gguf_linear(x[start:start + rows], packed, 67, kfmt, bias, threads=threads)
                assert torch.equal(got, alone[start:start + rows]), (rows, start, threads)
    if not tiles_unavailable():
        try:
            gguf_kernel.amx_lane_rows(0)
            for rows in (1, 5, 8, 9, 17, 40):
                tiles = gguf_linear(x[:rows], packed, 67, f"{fmt}/int8-tiles", bias, threads=2)
                assert torch.equal(tiles, alone[:rows]), rows
        finally:
            gguf_kernel.amx_lane_rows(-1)
    if fmt == "Q8_0" and k == 576:  # 18 blocks a row: 455 rows fill the stack buffer, 1,000 take three chunks
        big = torch.randn(1000, k)
        got = gguf_linear(big, packed, 67, kfmt, bias, threads=2)
        want = torch.cat([gguf_linear(big[r:r + 8], packed, 67, kfmt, bias, threads=1) for r in range(0, 1000, 8)])
        assert torch.equal(got, want)


@pytest.mark.skipif(gguf_kernel.kernel_isa() != "avx512", reason="this CPU has no AVX-512")
@pytest.mark.parametrize("fmt", FORMATS)
def test_avx512_forms_give_the_avx2_forms_bits(fmt):
    """fp32 activations on an AVX-512 CPU take two weight rows a register (`gguf_avx512.cpp`), and the prompt GEMM
    a panel's 16 outputs a register: every output is bitwise the AVX2 forms', at every row count (lone rows,
    tiles, a lone last weight row, a partial last panel) and thread count."""
    lib = gguf_kernel._build()[0]
    blocks, _ = quantised(fmt, 67, 192, seed=5)
    bias = torch.randn(67)
    try:
        for rows in [1, 2, 5, 8, 13, 40, 130]:
            x = torch.randn(rows, 192)
            for threads in (1, 2):
                lib.gguf_use_avx512(0)
                avx2 = gguf_linear(x, blocks, 67, fmt, bias, threads=threads)
                avx2_gemm = gguf_gemm(x, blocks, 67, fmt, bias, threads=threads)
                lib.gguf_use_avx512(1)
                assert torch.equal(gguf_linear(x, blocks, 67, fmt, bias, threads=threads), avx2), (rows, threads)
                assert torch.equal(gguf_gemm(x, blocks, 67, fmt, bias, threads=threads), avx2_gemm), (rows, threads)
    finally:
        lib.gguf_use_avx512(1)


def test_kernel_rejects_a_width_that_is_not_whole_blocks():
    blocks, _ = quantised("Q8_0", 4, 64)
    with pytest.raises(gguf_kernel.KernelError, match="returned -1"):
        gguf_linear(torch.randn(2, 48), blocks, 4, "Q8_0")
