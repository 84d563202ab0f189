"""The C++ layers' prompt GEMMs (`gguf_kernel.gguf_gemm`): the fp32 one over the blocks (`gguf_gemm.cpp`) and,
for the AMX tiles' format, the AMX-BF16 one over their copy (`gguf_amx_bf16.cpp`): each the product it states,
and every row's bits its own whatever the rows beside it and the threads."""

from __future__ import annotations

import pytest
import torch

from specstep.engine.models.gguf_kernel import amx_pack, bf16_tiles_unavailable, gguf_gemm, unavailable
from tests.test_gguf_linear import FORMATS, quantised

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=f"GGUF kernel unavailable: {unavailable()}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_prompt_gemm_is_the_fp32_product_and_row_invariant(fmt):
    """The prompt GEMM computes the converted checkpoint's fp32 weights' product (to rounding, 3x torch's error
    at most: a running sum per 32 k), every row's bits alone whatever the rows beside it (tiles of 6, panels of
    16: 67 outputs end in a partial panel) and the threads."""
    blocks, w = quantised(fmt, 67, 576, seed=2)
    x, bias = torch.randn(130, 576), torch.randn(67)
    ref = x.double() @ w.double().T + bias.double()
    got = gguf_gemm(x, blocks, 67, fmt, bias)
    assert (got.double() - ref).abs().max() <= 3 * (torch.nn.functional.linear(x, w, bias).double() - ref).abs().max()
    alone = torch.cat([gguf_gemm(x[i: i + 1], blocks, 67, fmt, bias, threads=1) for i in range(130)])
    for m, start in [(130, 0), (7, 3), (64, 66), (1, 129)]:
        assert torch.equal(gguf_gemm(x[start: start + m], blocks, 67, fmt, bias, threads=2), alone[start: start + m])


@pytest.mark.skipif(bool(bf16_tiles_unavailable()), reason=f"AMX-BF16: {bf16_tiles_unavailable()}")
@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_prompt_gemm_is_the_bf16_operands_product_and_row_invariant(fmt):
    """The AMX formats' prompt GEMM (AMX-BF16 tiles over `amx_pack`'s copy): the product of x and the weights each
    rounded to bf16 (to fp32 summation error, against fp64 of the same bf16 operands), the exact fp32 product's
    neighbour (bf16's 8 bits: about 1% of a typical output), every row's bits alone whatever the rows beside it
    (passes of 32 rows, 16-row tiles: 130 rows end in a partial tile; 67 outputs in a partial group, an odd group
    count in a panel of two) and the threads."""
    blocks, w = quantised(fmt, 67, 576, seed=2)
    packed = amx_pack(blocks, fmt, 576)
    x, bias = torch.randn(130, 576), torch.randn(67)
    wb = w.to(torch.bfloat16)  # fma(d, q, m) in fp32 (d * q is exact), then bf16
    ref = x.to(torch.bfloat16).double() @ wb.double().T + bias.double()
    got = gguf_gemm(x, packed, 67, f"{fmt}/int8-tiles", bias)
    fp32_err = (torch.nn.functional.linear(x, w, bias).double() - (x.double() @ w.double().T + bias.double())).abs()
    assert (got.double() - ref).abs().max() <= 4 * fp32_err.max()
    exact = x.double() @ w.double().T + bias.double()
    assert 1e-4 < (got.double() - exact).abs().max() / exact.abs().max() < 0.02  # bf16, not fp32 (nor garbage)
    alone = torch.cat([gguf_gemm(x[i: i + 1], packed, 67, f"{fmt}/int8-tiles", bias, threads=1) for i in range(130)])
    for m, start in [(130, 0), (7, 3), (64, 66), (33, 97), (1, 129)]:
        assert torch.equal(gguf_gemm(x[start: start + m], packed, 67, f"{fmt}/int8-tiles", bias, threads=2),
                           alone[start: start + m])
    # fewer outputs than a group, no bias
    got = gguf_gemm(x[:20], packed[: len(packed) // 5], 13, f"{fmt}/int8-tiles")  # the first group's blocks
    assert torch.allclose(got.double(), x[:20].to(torch.bfloat16).double() @ wb[:13].double().T, rtol=0, atol=1e-4)
