"""`benchmarks/fma_rate.cpp`, the FMA peak under `bench_steps`' arithmetic floor: its ten chains are ten
computations, each from its own start (chains that start equal are one computation to the compiler, which then
runs one latency-bound chain and the rate reads 10/8 of the real peak)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.bench_steps import FMA_SEEDS, fma_rate


def chain(seed: float, iters: int) -> float:
    """a = fma(a, 0.9999, 1e-4) in float32, `iters` times (the product is exact in float64; one rounding after
    the add, as the FMA's single rounding, up to a rare double rounding)."""
    a, m, c = np.float32(seed), np.float64(np.float32(0.9999)), np.float64(np.float32(1e-4))
    for _ in range(iters):
        a = np.float32(np.float64(a) * m + c)
    return float(a)


def test_each_chain_runs_from_its_own_start():
    measured = fma_rate(threads=1, repeats=1, iters=300)
    if measured is None:
        pytest.skip("the C++ kernels cannot run here")
    rate, finals = measured
    assert rate > 0
    assert len(set(finals)) == 10, finals
    np.testing.assert_allclose(finals, [chain(s, 300) for s in FMA_SEEDS], rtol=2e-7)
