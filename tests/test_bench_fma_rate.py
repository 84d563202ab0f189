"""`benchmarks/fma_rate.cpp` and `benchmarks/peak_rates.py`, the instruction peaks under `bench_steps`' arithmetic
floor: its ten chains are ten computations, each from its own start (chains that start equal are one computation to
the compiler, which then runs one latency-bound chain and the rate reads 10/8 of the real peak), in every width the
host runs; and the floor's rule."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.peak_rates import FMA_SEEDS, VNNI_BYTES, VNNI_SEEDS, arithmetic_floor, fma_rate, vnni_rate
from specstep.engine.native import cpu_flags


def chain(seed: float, iters: int) -> float:
    """a = fma(a, 0.9999, 1e-4) in float32, `iters` times (the product is exact in float64; one rounding after
    the add, as the FMA's single rounding, up to a rare double rounding)."""
    a, m, c = np.float32(seed), np.float64(np.float32(0.9999)), np.float64(np.float32(1e-4))
    for _ in range(iters):
        a = np.float32(np.float64(a) * m + c)
    return float(a)


@pytest.mark.parametrize("lanes", [8, 16])
def test_each_chain_runs_from_its_own_start(lanes):
    if lanes == 16 and "avx512f" not in cpu_flags():
        pytest.skip("this CPU has no AVX-512")
    measured = fma_rate(threads=1, repeats=1, iters=300, lanes=lanes)
    if measured is None:
        pytest.skip("the C++ kernels cannot run here")
    rate, finals = measured
    assert rate > 0
    assert len(set(finals)) == 10, finals
    np.testing.assert_allclose(finals, [chain(s, 300) for s in FMA_SEEDS], rtol=2e-7)


def dot4(x_bytes: int, y_bytes: int) -> int:
    """One lane's vpdpbusd sum: 4 unsigned bytes of x times 4 signed bytes of y."""
    xs = np.frombuffer(np.uint32(x_bytes).tobytes(), dtype=np.uint8).astype(np.int64)
    ys = np.frombuffer(np.int32(np.uint32(y_bytes).view(np.int32)).tobytes(), dtype=np.int8).astype(np.int64)
    return int((xs * ys).sum())


def test_vnni_chains_each_add_their_products():
    if not {"avx512f", "avx512_vnni"} <= cpu_flags():
        pytest.skip("this CPU has no AVX-512 VNNI")
    measured = vnni_rate(threads=2, repeats=1, iters=1000)
    if measured is None:
        pytest.skip("the C++ kernels cannot run here")
    rate, finals = measured
    assert rate > 0
    step = dot4(*VNNI_BYTES)
    assert step != 0
    # int32 wrapping arithmetic: seed + iters x the lane's dot product
    expect = [int(np.int64(s + 1000 * step).astype(np.int32)) for s in VNNI_SEEDS]
    assert finals == expect


def test_floor_counts_the_widest_instructions_the_activations_take():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))  # 2,048 multiply-adds a row
    rates = {"fma8": 1e9, "fma16": 1e9, "vnni": 1e9}
    assert arithmetic_floor(5, 4, model, "fp32", rates) == (4 * 2048 / 16 / 1e9, "fma16")
    assert arithmetic_floor(5, 4, model, "fp32", {"fma8": 1e9}) == (4 * 2048 / 8 / 1e9, "fma8")
    assert arithmetic_floor(5, 4, model, "fp32", {}) is None
    # int8 needs GGUF linears whose rows run in VNNI lanes: a torch model has none, so no bound
    assert arithmetic_floor(5, 4, model, "int8", rates) is None


@pytest.mark.parametrize("acts", ["int8-tiles", "int8-vnni", "int8-lanes"])
def test_the_int8_floor_holds_only_where_the_rows_run_in_vnni_lanes(acts, tiny_target, tmp_path, monkeypatch):
    """AMX tiles take the rows past the lanes' crossover (a tile multiply's rows cost their readout, not
    multiply-adds: no bound); the VNNI format runs every row count in lanes; AVX2 lanes are not counted."""
    from specstep.engine.cpu_kernels import CpuKernels
    from specstep.engine.gguf_checkpoint import converted_folder
    from specstep.engine.model_loader import load_model
    from specstep.engine.models.gguf_kernel import amx_lane_rows_now, tiles_unavailable, vnni_unavailable
    from specstep.engine.models.gguf_linear import GGUFLinear
    from tests.fixtures_gguf import pin_int8_form, write_gguf

    if acts == "int8-tiles" and tiles_unavailable():
        pytest.skip(f"AMX tiles: {tiles_unavailable()}")
    if acts == "int8-vnni" and vnni_unavailable():
        pytest.skip(f"AVX-512 VNNI: {vnni_unavailable()}")
    folder = converted_folder(write_gguf(tmp_path / "t.gguf", tiny_target, qtype="Q4_1"), cache=tmp_path)
    model = load_model(folder, "cpu", "float32", CpuKernels(activations=pin_int8_form(acts, monkeypatch)))
    rates = {"fma8": 1e9, "fma16": 1e9, "vnni": 1e9}
    if acts == "int8-lanes":
        assert arithmetic_floor(5, 4, model, "int8", rates) is None
        return
    fmts = {m.fmt for m in model.modules() if isinstance(m, GGUFLinear)}
    most = 64 if acts == "int8-vnni" else min(amx_lane_rows_now(f) for f in fmts)
    floor = arithmetic_floor(most, 4, model, "int8", rates)  # a call of `most` rows, 4 of them extra
    assert floor is not None and floor[1] == "vnni" and floor[0] > 0
    assert (arithmetic_floor(most + 1, 4, model, "int8", rates) is None) == (acts == "int8-tiles")
    assert arithmetic_floor(5, 4, model, "int8", {"fma8": 1e9}) is None  # no VNNI rate: no bound
