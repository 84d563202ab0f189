"""The kernel layer's block formats (engine/kernels) against numpy references, per format, arithmetic and every ISA
this host runs: fp32 activations against an fp32 matmul of `gguf.quants.dequantize`'s weights (and its dequantiser
bit for bit), int8 activations bit for bit against a numpy model of the arithmetic; random blocks with edge
values, 1 to 64 rows, every row's bits independent of the rows beside it and of the threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from specstep.engine.errors import ConfigError
from specstep.engine.kernels import binding
from tests import int8_model
from tests.kernel_blocks import BLOCK, random_blocks

pytestmark = pytest.mark.skipif(bool(binding.unavailable()), reason="the kernel layer does not build here")

FORMATS = ("Q4_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16")
INT8_FORMATS = FORMATS[:8]
N, K = 24, 512


def _isas() -> list[str]:
    return [isa for isa in binding.ISAS if not binding.unavailable() and binding.isa_runs(isa)]


def _x(rows: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # a block of zeros: its activation scale is 0
    if rows > 1:
        x[1, 40] = 1e4  # one outlier sets its block's scale
    return x


def _reference(fmt: str, raw: np.ndarray) -> np.ndarray:
    return quants.dequantize(raw, GGMLQuantizationType[fmt]).reshape(raw.shape[0], K).astype(np.float32)


def test_table_has_every_format_arithmetic_and_isa() -> None:
    names = set(binding.table())
    for fmt in FORMATS:
        for isa in binding.ISAS:
            assert f"{fmt}/fp32/{isa}" in names
            assert (f"{fmt}/int8/{isa}" in names) == (fmt in INT8_FORMATS)
    with pytest.raises(binding.KernelError, match="no kernel for F16 weights with int8"):
        binding.linear_kernel("F16", "int8")


@pytest.mark.parametrize("fmt", (*FORMATS, "Q4_1", "Q8_0"))  # (Q4_1, Q8_0: dequantisation only)
def test_dequantize_is_gguf_bit_for_bit(fmt: str) -> None:
    raw = random_blocks(fmt, N, K)
    assert np.array_equal(binding.dequantize(fmt, raw).view(np.uint32),
                          _reference(fmt, raw).reshape(-1).view(np.uint32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp32_activations_equal_the_dequantised_matmul(fmt: str) -> None:
    raw = random_blocks(fmt, N, K)
    w = torch.from_numpy(_reference(fmt, raw)).double()
    bias = torch.randn(N)
    for isa in _isas():
        kernel = binding.linear_kernel(fmt, "fp32", isa)
        for rows in (1, 5, 64):
            x = _x(rows)
            y = binding.linear(x, torch.from_numpy(raw), N, kernel, bias)
            exact = x.double() @ w.T + bias.double()
            bound = 1e-5 * (x.double().abs() @ w.abs().T).max() + 1e-6
            assert (y.double() - exact).abs().max() <= bound, (fmt, isa, rows)


@pytest.mark.parametrize("fmt", INT8_FORMATS)
def test_the_int8_models_unpacking_is_the_gguf_weights(fmt: str) -> None:
    """The numpy model's integer terms, d (sc u - off) + dm mn per 16 values, are the weights `gguf` dequantises
    (to fp32 rounding): the model the kernels are held to reads each layout as gguf does."""
    raw = random_blocks(fmt, N, K)
    qk = BLOCK[fmt][0]
    u, sc, off, mn, d, dm = int8_model.unpack(fmt, raw.reshape(-1, BLOCK[fmt][1]))
    g = np.arange(qk) // 16
    w = d[:, None].astype(np.float64) * (sc[:, g] * u - off[:, g]) + dm[:, None].astype(np.float64) * mn[:, g]
    ref = _reference(fmt, raw).reshape(-1, qk).astype(np.float64)
    assert np.allclose(w, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("fmt", INT8_FORMATS)
def test_int8_activations_equal_the_numpy_model_bitwise(fmt: str) -> None:
    raw = random_blocks(fmt, N, K)
    qk = BLOCK[fmt][0]
    bias = torch.randn(N)
    for isa in _isas():
        kernel = binding.linear_kernel(fmt, "int8", isa)
        for rows in (1, 3, 64):
            x = _x(rows)
            y = binding.linear(x, torch.from_numpy(raw), N, kernel, bias).numpy()
            model = int8_model.linear(fmt, qk, x.numpy(), raw, bias.numpy())
            assert np.array_equal(y.view(np.uint32), model.view(np.uint32)), (fmt, isa, rows)


@pytest.mark.parametrize("fmt", ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))
def test_int8_long_k_quant_rows_equal_the_numpy_model_bitwise(fmt: str) -> None:
    # 11 super-blocks a row: a decode row's blocks go 8 at a time, so a full group and a partial one
    k = 11 * 256
    raw = random_blocks(fmt, 8, k, seed=5)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(6))
    x[0, 300:600] = 0.0  # a super-block of zeros in the middle of the row
    for isa in _isas():
        kernel = binding.linear_kernel(fmt, "int8", isa)
        for rows in (1, 2, 3, 5):
            y = binding.linear(x[:rows], torch.from_numpy(raw), 8, kernel).numpy()
            model = int8_model.linear(fmt, 256, x[:rows].numpy(), raw, None)
            assert np.array_equal(y.view(np.uint32), model.view(np.uint32)), (fmt, isa, rows)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arith", ("fp32", "int8"))
def test_rows_are_batch_invariant_and_thread_invariant(fmt: str, arith: str) -> None:
    if arith == "int8" and fmt not in INT8_FORMATS:
        pytest.skip("fp32 only")
    raw = torch.from_numpy(random_blocks(fmt, N, K, seed=3))
    x = _x(64, seed=4)
    results = []
    for isa in _isas():
        kernel = binding.linear_kernel(fmt, arith, isa)
        full = binding.linear(x, raw, N, kernel, threads=2)
        results.append(full)
        for rows in (1, 2, 7, 13):
            for start in (0, 64 - rows):
                part = binding.linear(x[start:start + rows], raw, N, kernel, threads=1)
                assert torch.equal(part, full[start:start + rows]), (isa, rows, start)
    assert all(torch.equal(r, results[0]) for r in results)  # every ISA: the same bits


def test_isa_override_names_a_runnable_isa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(binding.ISA_ENV, "avx2")
    assert binding.host_isa() == "avx2"
    monkeypatch.setenv(binding.ISA_ENV, "sse2")
    with pytest.raises(ConfigError, match="one of avx512, avx2 or amx"):
        binding.host_isa()


@pytest.mark.parametrize("fmt", ("Q4_1", "Q8_0"))
def test_q4_1_and_q8_0_embedding_rows_come_from_the_kernel_layer(fmt: str) -> None:
    from specstep.engine.models.gguf_embedding import GGUFEmbedding

    raw = random_blocks(fmt, N, K, seed=7)
    emb = GGUFEmbedding(fmt, torch.from_numpy(raw), K)
    assert emb._in_table  # (not the gguf package's Python dequantiser)
    ids = torch.tensor([[3, 0, 23, 3]])
    assert torch.equal(emb(ids)[0], torch.from_numpy(_reference(fmt, raw)[[3, 0, 23, 3]]))
