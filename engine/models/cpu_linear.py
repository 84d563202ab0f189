"""CPU linears whose kernel and weight dtype are chosen per host by measurement at load (`cpu_linear_plans`).

`plan_linears` swaps every `nn.Linear` of a model for a `CpuLinear` that dispatches on its input's row count
(`LinearPlan`): with batch invariance on (`CpuKernels.batch_invariant`, the default) every row count runs the
same row-invariant kernel (oneDNN's prepacked linear), so a row's bits never depend on the rows beside it; off,
each row count takes whichever kernel was measured faster. Where this CPU's oneDNN runs bf16 faster (AVX512_BF16,
AMX) and `--dtype auto` allows it, the linears read bf16 copies of the weights, activations cast to bf16 and back:
numerics change (a dequantised Q4_1 weight needs more than bf16's 8 mantissa bits); `--dtype float32` is exact.

Only the CPU uses this; CUDA keeps `nn.Linear`. The weight parameter stays (state dicts, autograd, a tied
embedding); the packed copy is extra memory (a tied `lm_head` thereby stops reading the embedding's storage,
itself a 2x slowdown). Autograd always takes the matmul path: the oneDNN op has no backward.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from specstep.engine.cpu_kernels import CpuKernels, DtypeChoice, choose_linear_dtype, invariant_linear_mode
from specstep.engine.models.cpu_linear_plans import (  # noqa: F401 (re-exported: the module's interface)
    DTYPE_ROWS,
    DTYPES,
    PROBE_ROWS,
    LinearPlan,
    cpu_isa,
    dtype_timings,
    matmul_storage,
    onednn_available,
    onednn_supports,
    pack,
    plan_for,
)

MODES = ("auto", "matmul", "onednn")


class CpuLinear(nn.Module):
    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, plan: LinearPlan,
                 shared: bool = False) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.plan = plan
        # A weight shared with an embedding is stored [V, d] row-major, which MKL reads at a third of the speed:
        # the matmul kernel gets its own copy in the fast layout (only if the plan uses it).
        uses_matmul = not all(plan.onednn)
        self._mm = matmul_storage(weight.detach()) if shared and uses_matmul else weight
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        # Rows -> kernel, precomputed so the hot path is one tuple lookup.
        self._by_rows = tuple(plan.use_onednn(r) for r in range(PROBE_ROWS[-1] + 1))
        self._kdtype = DTYPES[plan.dtype]  # the packed weight's dtype (bf16: activations cast to it)
        kernel_weight = weight.detach().to(self._kdtype)
        self._packed = pack(kernel_weight) if plan.needs_pack else None
        self._bias = bias.detach().to(self._kdtype) if bias is not None and self._kdtype != weight.dtype else bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        onednn = self._by_rows[rows] if rows < len(self._by_rows) else self._by_rows[-1]
        if onednn and self._packed is not None:
            return self._onednn(x)
        return F.linear(x, self._mm, self.bias)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        if self._kdtype != x.dtype:
            return torch.ops.mkldnn._linear_pointwise(x.to(self._kdtype), self._packed, self._bias, "none", [],
                                                      "").to(x.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        rows = [r for r in PROBE_ROWS if self.plan.use_onednn(r)]
        return f"in={self.in_features}, out={self.out_features}, onednn_rows={rows}, dtype={self.plan.dtype}"


def _linears(module: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    return [(f"{name}.{child_name}".lstrip("."), parent, child_name, child)
            for name, parent in module.named_modules() for child_name, child in parent.named_children()
            if type(child) is nn.Linear]


def linear_dtype(linears: list[nn.Linear], kernels: CpuKernels) -> DtypeChoice:
    """fp32 or bf16 weights for a float32 model's linears, one choice for the model (`choose_linear_dtype`) from
    each shape's measured times, summed over its linears. The fp32 side is the plan that would run: oneDNN with
    batch invariance, else the faster kernel at each row count."""
    if kernels.half == "off" or any(lin.weight.dtype != torch.float32 for lin in linears):
        return choose_linear_dtype("off", False, "")
    bf16_runs = onednn_supports(torch.bfloat16)
    if not bf16_runs or kernels.linear == "matmul":
        return choose_linear_dtype(kernels.half, False, cpu_isa() if not bf16_runs else "--cpu-linear matmul")
    fp32, bf16 = [0.0] * len(DTYPE_ROWS), [0.0] * len(DTYPE_ROWS)
    for (out_f, in_f), n in Counter((lin.out_features, lin.in_features) for lin in linears).items():
        t = dtype_timings(out_f, in_f)
        for i in range(len(DTYPE_ROWS)):
            fp32[i] += n * (t["fp32_onednn"][i] if kernels.batch_invariant or kernels.linear == "onednn"
                            else min(t["fp32_onednn"][i], t["fp32_matmul"][i]))
            bf16[i] += n * t["bf16_onednn"][i]
    return choose_linear_dtype(kernels.half, True, cpu_isa(), (fp32[0], fp32[1]), (bf16[0], bf16[1]))


def plan_linears(module: nn.Module, kernels: CpuKernels | str = "auto") -> dict[str, LinearPlan]:
    """Replace every `nn.Linear` of `module` by a `CpuLinear` with a measured plan; returns the plans by name
    (`describe_linears` summarises them). `kernels`: a `CpuKernels`, or a bare `--cpu-linear` mode: that plan as
    it ran before batch invariance existed (invariance off, fp32 weights).

    Weights shared with an embedding keep their storage (the lookup wants contiguous rows; the linear gets a copy);
    every other weight moves to the matmul layout in place, as the matmul path is what a plan falls back to.
    """
    if isinstance(kernels, str):
        if kernels not in MODES:
            raise ValueError(f"cpu linear mode must be one of {', '.join(MODES)}, got {kernels!r}")
        kernels = CpuKernels(kernels, batch_invariant=False)
    shared = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    found = _linears(module)
    if not found:  # every linear reads GGUF blocks (`gguf_linear`), or there are none
        return {}
    choice = linear_dtype([child for *_, child in found], kernels)
    plans: dict[str, LinearPlan] = {}
    for full, parent, child_name, child in found:
        weight = child.weight
        if id(weight) not in shared:
            weight.data = matmul_storage(weight.data)
        kernel_dtype = DTYPES[choice.dtype] if choice.dtype != "float32" else weight.dtype
        mode = kernels.linear
        if kernels.batch_invariant:  # refuses matmul; oneDNN where it runs in this dtype (plan_for checks)
            mode = invariant_linear_mode(mode, onednn_supports(kernel_dtype))
        plan = plan_for(child.out_features, child.in_features, weight.dtype, mode, kernels.batch_invariant,
                        kernel_dtype)
        plan = dataclasses.replace(plan, note=choice.reason)
        setattr(parent, child_name, CpuLinear(weight, child.bias, plan, shared=id(weight) in shared))
        plans[full] = plan
    return plans


def describe_linears(module: nn.Module) -> str:
    """For the ready line: the linears' dtype and why, and whether every row count runs one kernel."""
    linears = [m for m in module.modules() if isinstance(m, CpuLinear)]
    if not linears:
        return ""
    text = linears[0].plan.note or f"{linears[0].plan.dtype} linears"
    if all(m.plan.batch_invariant for m in linears):
        return f"{text}; oneDNN at every row count (batch-invariant)"
    if not any(m.plan.needs_pack for m in linears):
        return f"{text}; MKL (not batch-invariant)"
    return f"{text}; MKL or oneDNN by row count (not batch-invariant)"
