"""The block formats' prompt GEMM with int8 activations (`engine/kernels/int8_gemm.inc`): llama.cpp's arithmetic
with exact integer totals a block, bit for bit the numpy model's (`int8_model.gemm`), every row's bits its own
whatever the rows beside it and the threads, and the decode kernel's results to fp32 rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specstep.engine.kernels import binding
from tests import int8_model
from tests.kernel_blocks import random_blocks

pytestmark = pytest.mark.skipif(bool(binding.unavailable()), reason="the kernel layer does not build here")

FORMATS = ("Q4_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
N, K = 67, 512  # 67 weight rows: four whole panels of 16 and a partial one (a tile of two panels, then one)


def _kernels(fmt: str) -> list[binding.LinearKernel]:
    """The format's int8 rows on every ISA this CPU runs (each with its prompt GEMM)."""
    kernels = [binding.linear_kernel(fmt, "int8", isa) for isa in binding.ISAS if binding.isa_runs(isa)]
    assert kernels and all(k.gemm for k in kernels)
    return kernels


def _x(rows: int, k: int = K, seed: int = 1) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[min(2, rows - 1), : 256] = 0.0  # a block of zeros (dx = 0)
    x[0, 3] = 40.0  # an outlier: the other values of its block quantise to few levels
    return x


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_prompt_gemm_is_the_numpy_models_bitwise(fmt: str) -> None:
    """On every ISA: the same bits, the model's (AVX2 lanes of 8 weight rows, AVX-512 of 16)."""
    raw = random_blocks(fmt, N, K)
    bias = torch.randn(N)
    for kernel in _kernels(fmt):
        for rows in (1, 5, 6, 7, 64):  # tiles of 6 rows: whole ones and every remainder's form
            x = _x(rows)
            got = binding.gemm(x, torch.from_numpy(raw), N, kernel, bias).numpy()
            model = int8_model.gemm(fmt, x.numpy(), raw, bias.numpy())
            assert np.array_equal(got.view(np.uint32), model.view(np.uint32)), (fmt, kernel.isa, rows)


@pytest.mark.parametrize("fmt", ("Q4_0", "Q4_K", "Q6_K"))
def test_long_rows_and_one_panel(fmt: str) -> None:
    """11 K-quant blocks a row (88 legacy ones), and 13 weight rows (one partial panel: a tile of one panel)."""
    k = 11 * 256
    raw = random_blocks(fmt, 13, k, seed=5)
    x = _x(9, k, seed=6)
    model = int8_model.gemm(fmt, x.numpy(), raw)
    for kernel in _kernels(fmt):
        got = binding.gemm(x, torch.from_numpy(raw), 13, kernel).numpy()
        assert np.array_equal(got.view(np.uint32), model.view(np.uint32)), kernel.isa


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_are_batch_and_thread_invariant_and_near_the_kernels(fmt: str) -> None:
    raw = torch.from_numpy(random_blocks(fmt, N, K, seed=3))
    x = _x(64, seed=4)
    for kernel in _kernels(fmt):
        full = binding.gemm(x, raw, N, kernel, threads=2)
        for rows in (1, 2, 7, 13):
            for start in (0, 64 - rows):
                assert torch.equal(binding.gemm(x[start:start + rows], raw, N, kernel, threads=1),
                                   full[start:start + rows]), (kernel.isa, rows, start)
        # the same integers as the decode kernel's, summed in another fp32 order
        lanes = binding.linear(x, raw, N, kernel)
        assert not torch.equal(full, lanes)
        assert (full - lanes).abs().max() <= 1e-5 * lanes.abs().max()


def test_a_kernel_without_the_gemm_is_refused() -> None:
    kernel = binding.linear_kernel("Q4_0", "fp32", "avx2")
    assert not kernel.gemm
    with pytest.raises(binding.KernelError, match="no prompt GEMM"):
        binding.gemm(torch.randn(2, 64), torch.zeros(4, 2 * 18, dtype=torch.uint8), 4, kernel)


def test_the_c_entry_refuses_fewer_than_one_thread() -> None:
    """Each thread's weight panels are sized by the thread count: 0 or -1 threads (OpenMP would still start its
    default team) are refused, not run past the scratch."""
    from specstep.engine.kernels.library import load

    lib = load()[0]
    kernel = _kernels("Q4_K")[-1]
    raw = torch.from_numpy(random_blocks("Q4_K", N, K))
    x, y = _x(6), torch.empty(6, N)
    for threads in (0, -1):
        assert lib.sk_gemm(kernel.row, x.data_ptr(), 6, K, raw.data_ptr(), N, None, y.data_ptr(), threads) == -1
    assert lib.sk_gemm(kernel.row, x.data_ptr(), 6, K, raw.data_ptr(), N, None, y.data_ptr(), 1) == 0
