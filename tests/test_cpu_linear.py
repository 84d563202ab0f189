"""CPU linears: per-row-count dispatch between MKL matmul and prepacked oneDNN, the same values either way, a
tied lm_head with storage of its own, and engines whose greedy speculation still equals plain decoding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specstep.engine.errors import ConfigError
from specstep.engine.models.cpu_linear import (
    PROBE_ROWS,
    CpuLinear,
    LinearPlan,
    onednn_available,
    onednn_supports,
    plan_linears,
)
from specstep.engine.sampling_params import SamplingParams
from tests.helpers import make_checkpoint, make_core, run_to_completion

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


def ops_called(fn) -> set[str]:
    with torch.profiler.profile() as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def test_dispatch_follows_the_plan_by_row_count():
    lin = nn.Linear(64, 96, bias=True)
    ref = lin.weight.detach().clone(), lin.bias.detach().clone()
    plan = LinearPlan(tuple(r >= 5 for r in PROBE_ROWS))  # matmul for 1-2 rows, oneDNN from 5 rows
    fast = CpuLinear(lin.weight, lin.bias, plan)
    with torch.inference_mode():
        for rows, onednn in ((1, False), (2, False), (5, True), (40, True)):
            x = torch.randn(rows, 64)
            called = ops_called(lambda x=x: fast(x))
            assert ("mkldnn::_linear_pointwise" in called) == onednn, (rows, called)
            assert ("aten::addmm" in called) != onednn, (rows, called)
            assert torch.allclose(fast(x), x @ ref[0].t() + ref[1], atol=1e-4)


def test_autograd_takes_the_matmul_path():
    lin = nn.Linear(16, 8, bias=False)
    fast = CpuLinear(lin.weight, None, LinearPlan((True,) * len(PROBE_ROWS)))
    x = torch.randn(5, 16, requires_grad=True)
    fast(x).sum().backward()
    assert torch.allclose(x.grad, lin.weight.detach().sum(0).expand(5, -1))


def test_tied_lm_head_gets_its_own_fast_storage():
    emb = nn.Embedding(100, 16)
    model = nn.ModuleDict({"embed_tokens": emb, "lm_head": nn.Linear(16, 100, bias=False)})
    model["lm_head"].weight = emb.weight
    plan_linears(model, "matmul")
    head = model["lm_head"]
    assert isinstance(head, CpuLinear) and head.weight is emb.weight  # still tied for state dicts and training
    assert head._mm.data_ptr() != emb.weight.data_ptr()
    assert head._mm.t().is_contiguous()  # the [in, out] buffer MKL reads fast
    assert emb.weight.is_contiguous()  # the lookup keeps its row-major table
    x = torch.randn(3, 16)
    torch.testing.assert_close(head(x), x @ emb.weight.t())  # the copy sums in another order: not bit-equal


def test_measured_plan_covers_every_probe():
    model = nn.Sequential(nn.Linear(64, 128, bias=False))
    plans = plan_linears(model, "auto")
    assert len(plans["0"].onednn) == len(PROBE_ROWS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_plans_only_kernels_this_cpu_runs(dtype):
    """oneDNN's half-precision linears need AVX-512 or AVX-NE-CONVERT (an AVX2-only host's reorder raises): `auto`
    packs only where they run, and a forced `onednn` where they do not is a ConfigError at load, not a crash."""
    torch.manual_seed(0)
    x = torch.randn(5, 64, dtype=dtype)
    auto = nn.Sequential(nn.Linear(64, 128, bias=False)).to(dtype)
    want = auto(x)
    plans = plan_linears(auto, "auto")
    assert onednn_supports(dtype) or not plans["0"].needs_pack
    with torch.inference_mode():
        torch.testing.assert_close(auto(x), want)
    forced = nn.Sequential(nn.Linear(64, 128, bias=False)).to(dtype)
    if onednn_supports(dtype):
        plan_linears(forced, "onednn")
        assert isinstance(forced[0], CpuLinear) and forced[0].plan.needs_pack
    else:
        with pytest.raises(ConfigError, match="--cpu-linear onednn"):
            plan_linears(forced, "onednn")


@pytest.mark.parametrize("mode,invariant", [("onednn", True), ("auto", True), ("matmul", False)])
def test_greedy_speculation_equals_plain_with_either_kernel(mode, invariant, tmp_path):
    """MKL (matmul) is not batch-invariant: it runs only with invariance off (equal here, with no near-ties)."""
    target = make_checkpoint(tmp_path / "t", seed=0, hidden_size=128, intermediate_size=256)
    prompts = [[5, 17, 99, 3, 5, 17, 99, 3], [7, 8, 9, 10, 7, 8, 9, 10]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    cfg = dict(cpu_linear=mode, batch_invariant=invariant)
    plain = run_to_completion(make_core(target, **cfg), prompts, params)
    spec = run_to_completion(make_core(target, spec="ngram", spec_policy="fixed", **cfg), prompts, params)
    assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in plain]
    core = make_core(target, **cfg)
    linears = [m for m in core.engine.target.modules() if isinstance(m, CpuLinear)]
    assert linears and all(m.plan.needs_pack == (mode != "matmul") for m in linears)
    assert all(m.plan.batch_invariant == invariant for m in linears)
