"""The kernel layer's bf16 arithmetic (`engine/kernels/bf16_dot.cpp`): BF16 weights times activations rounded to
bf16 (nearest even) in AVX-512 BF16 dot products, on hosts that have them. Against an fp64 product of the rounded
activations with the weights (the dot products' bf16 products are exact; only their fp32 sums round), every row's
bits independent of the rows beside it and of the threads; a bf16 folder takes it by default there, and speculative
output is plain output."""

from __future__ import annotations

import pytest
import torch

from specstep.engine.kernels import binding
from specstep.engine.models.gguf_linear import GGUFLinear, table_arith
from tests.kernel_blocks import random_blocks

pytestmark = pytest.mark.skipif(bool(binding.unavailable()), reason="the kernel layer does not build here")
needs_bf16 = pytest.mark.skipif(binding.unavailable() == "" and not binding.runs_here("BF16", "bf16"),
                                reason="this CPU has no AVX-512 BF16 dot products")

N = 41  # (odd: a weight row left beside the tiles of two)


def _x(rows: int, k: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0
    return x


def _exact(x: torch.Tensor, raw: torch.Tensor, k: int, bias: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The fp64 product of x rounded to bf16 (torch's nearest even) with the BF16 weights, and a bound on fp32
    summation error (a few ulps of the sum of |x w| over the row)."""
    w = raw.view(torch.bfloat16).reshape(-1, k).double()
    xb = x.to(torch.bfloat16).double()
    exact = xb @ w.T + (0.0 if bias is None else bias.double())
    return exact, 1e-5 * (xb.abs() @ w.abs().T) + 1e-6


@needs_bf16
@pytest.mark.parametrize("k", (96, 512))  # (96: its last 32 values outside the 64-value steps)
def test_bf16_rows_are_the_rounded_activations_exact_product(k: int) -> None:
    raw = torch.from_numpy(random_blocks("BF16", N, k, seed=2))
    bias = torch.randn(N)
    kernel = binding.linear_kernel("BF16", "bf16")
    for rows in (1, 3, 9, 64):
        x = _x(rows, k)
        y = binding.linear(x, raw, N, kernel, bias).double()
        exact, bound = _exact(x, raw, k, bias)
        assert ((y - exact).abs() <= bound).all(), rows
        # rounding x by truncation instead would be ~100x the bound away on some output
        truncated = (x.view(torch.int32) & -65536).view(torch.float32)
        assert not torch.allclose(_exact(truncated, raw, k, bias)[0], exact, rtol=0, atol=float(bound.max()))


@needs_bf16
def test_bf16_rows_are_batch_invariant_and_thread_invariant() -> None:
    k = 512
    raw = torch.from_numpy(random_blocks("BF16", N, k, seed=3))
    x = _x(64, k, seed=4)
    kernel = binding.linear_kernel("BF16", "bf16")
    full = binding.linear(x, raw, N, kernel, threads=2)
    for rows in (1, 2, 7, 13):
        for start in (0, 64 - rows):
            part = binding.linear(x[start:start + rows], raw, N, kernel, threads=1)
            assert torch.equal(part, full[start:start + rows]), (rows, start)


@needs_bf16
@pytest.mark.parametrize("k", (96, 576))
def test_the_prompt_gemm_is_the_rounded_activations_exact_product_and_row_invariant(k: int) -> None:
    """Prompt rows' GEMM (`gemm_range`: 16 weight rows in the lanes, one fp32 sum an output): the same bound against
    the fp64 product, its own bits (not the kernel's two chains), and every row's bits alone whatever the rows
    beside it (tiles of 8 rows by 2 panels of 16: 41 outputs end in a partial panel) and the threads."""
    raw = torch.from_numpy(random_blocks("BF16", N, k, seed=6))
    bias = torch.randn(N)
    kernel = binding.linear_kernel("BF16", "bf16")
    assert kernel.gemm
    x = _x(70, k, seed=7)
    full = binding.gemm(x, raw, N, kernel, bias, threads=2)
    exact, bound = _exact(x, raw, k, bias)
    assert ((full.double() - exact).abs() <= bound).all()
    assert not torch.equal(full, binding.linear(x, raw, N, kernel, bias))
    for rows in (1, 7, 8, 9, 13):
        for start in (0, 70 - rows):
            part = binding.gemm(x[start:start + rows], raw, N, kernel, bias, threads=1)
            assert torch.equal(part, full[start:start + rows]), (rows, start)


@needs_bf16
def test_a_bf16_linear_takes_bf16_dot_products_unless_fp32_is_asked() -> None:
    assert table_arith("BF16", "auto") == "bf16" and table_arith("BF16", "int8") == "bf16"
    assert table_arith("BF16", "fp32") == "fp32"
    assert table_arith("F16", "auto") == "fp32"  # (no fp16 dot products: the exact widening)
    assert table_arith("Q4_K", "auto") == "int8"
    raw = torch.from_numpy(random_blocks("BF16", N, 96, seed=5))
    lin = GGUFLinear("BF16", raw, 96, None, activations="auto")
    assert lin.activations == "bf16" and lin.kernel_fmt == f"BF16/bf16/{binding.host_isa()}"


def test_kernels_pinned_off_avx512_take_fp32_for_bf16_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(binding.ISA_ENV, "avx2")  # (the row is AVX-512's: pinned off it, it does not run)
    assert not binding.runs_here("BF16", "bf16")
    assert table_arith("BF16", "auto") == "fp32"
    with pytest.raises(binding.KernelError, match="no kernel for BF16 weights with bf16"):
        binding.linear_kernel("BF16", "bf16")
