"""The CPU kernel choices: the pure dtype rule with injected capabilities and timings (this host may not run
bf16), the AVX2 path for real, and the row independence of a step's other ops (norms, rotary, residuals, the
MLP's gate, logits' cast, greedy argmax): verified, not assumed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specstep.engine.config import RopeScaling
from specstep.engine.cpu_kernels import BF16_MARGIN, CpuKernels, choose_linear_dtype, invariant_linear_mode
from specstep.engine.errors import ConfigError
from specstep.engine.model_loader import describe_cpu_kernels, load_model
from specstep.engine.models.cpu_linear import CpuLinear, onednn_supports
from specstep.engine.models.llama import RMSNorm
from specstep.engine.models.rotary import RotaryEmbedding, apply_rotary
from specstep.engine.sampler import sample
from specstep.engine.sampling_params import SamplingParams, SamplingTensors


def test_fp32_when_asked_or_when_bf16_does_not_run():
    assert choose_linear_dtype("off", True, "AVX512_BF16", (10.0, 12.0), (5.0, 5.0)).dtype == "float32"
    choice = choose_linear_dtype("auto", False, "AVX2 only")
    assert choice.dtype == "float32" and choice.reason == "fp32 linears (AVX2 only: no bf16 kernels)"


def test_bf16_where_measured_clearly_faster_over_decode_and_verify():
    fast = choose_linear_dtype("auto", True, "AVX512_BF16", fp32_ms=(22.4, 25.4), bf16_ms=(17.5, 17.2))
    assert fast.dtype == "bfloat16"
    assert fast.reason.startswith("bf16 linears (AVX512_BF16: decode x0.78, verify x0.68 of fp32, verify/decode 0.98")
    assert "--dtype float32 for exact" in fast.reason  # bf16 changes the numerics: the ready line says so
    edge = 100.0 * BF16_MARGIN
    assert choose_linear_dtype("auto", True, "AMX_BF16", (50.0, 50.0), (edge / 2, edge / 2 + 0.1)).dtype == "float32"
    slow = choose_linear_dtype("auto", True, "AVX512_BF16", (16.6, 26.5), (22.9, 18.7))
    assert slow.dtype == "float32" and "bf16 measured no faster" in slow.reason
    with pytest.raises(ValueError, match="measured"):
        choose_linear_dtype("auto", True, "AVX512_BF16")


def test_batch_invariant_linears_run_onednn_and_refuse_matmul():
    assert invariant_linear_mode("auto", True) == "onednn"
    assert invariant_linear_mode("onednn", False) == "onednn"  # plan_for then refuses it where it cannot run
    assert invariant_linear_mode("auto", False) == "matmul"  # no invariant kernel: reported, not hidden
    with pytest.raises(ConfigError, match="not batch-invariant"):
        invariant_linear_mode("matmul", True)
    with pytest.raises(ValueError):
        CpuKernels("fast")


@pytest.mark.skipif(onednn_supports(torch.bfloat16), reason="this host runs bf16 linears: the AVX2 path is not its")
def test_an_avx2_host_keeps_fp32_linears_and_says_why(tiny_target):
    """`--dtype auto` on a host without bf16 oneDNN kernels: fp32 weights, one oneDNN kernel for every row count."""
    model = load_model(tiny_target, "cpu", "auto", CpuKernels("auto", "auto"))
    linears = [m for m in model.modules() if isinstance(m, CpuLinear)]
    assert linears and all(m.plan.dtype == "float32" and m.plan.batch_invariant for m in linears)
    text = describe_cpu_kernels(model)
    assert text.startswith("fp32 linears (") and "no bf16 kernels" in text and "batch-invariant" in text


def rows_alone_and_together(fn, x: torch.Tensor) -> None:
    """Row 0 of x computed alone, with 4, with 7 and with 39 other rows: the same bits."""
    alone = fn(x[:1])
    for n in (5, 8, 40):
        assert torch.equal(fn(x[:n])[:1], alone), (fn, n)


def test_norms_rotary_residuals_and_gates_are_row_independent():
    g = torch.Generator().manual_seed(0)
    d, heads, head_dim = 576, 12, 64
    x = torch.randn(40, d, generator=g)
    norm = RMSNorm(d, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=g))
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, RopeScaling())
    positions = torch.full((40,), 123)
    qk = torch.randn(40, heads, head_dim, generator=g)
    y = torch.randn(40, d, generator=g)
    gate_up = torch.randn(40, 2 * 1536, generator=g)
    with torch.inference_mode():
        rows_alone_and_together(norm, x)
        rows_alone_and_together(lambda t: apply_rotary(t, *rope.cos_sin(positions[: t.shape[0]], t.dtype)), qk)
        rows_alone_and_together(lambda t: t + y[: t.shape[0]], x)
        rows_alone_and_together(lambda t: F.silu(t[:, :1536]) * t[:, 1536:], gate_up)
        rows_alone_and_together(lambda t: t.bfloat16().float(), x)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9)],
                         ids=["greedy", "sampled"])
def test_sampling_is_row_independent(params):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 49152, generator=g)

    def draw(t):
        n = t.shape[0]
        st = SamplingTensors.build([params] * n, list(range(n)), t.shape[1], "cpu")
        return sample(t, st, torch.arange(n))

    rows_alone_and_together(draw, logits)
