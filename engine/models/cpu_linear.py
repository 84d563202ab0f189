"""CPU linears whose kernel is chosen per weight shape and row count, by measurement at load.

Two kernels compute the same `x @ W.T` (CPU_NOTES.md):
  * `matmul`: MKL over a pre-transposed contiguous weight (`W` stored as the transpose of an [in, out] buffer).
    Fastest at one row (a GEMV), but its cost grows with the rows: 5 rows of SmolLM2's lm_head cost ~3x one.
  * `onednn`: torch's oneDNN linear over a weight reordered once into oneDNN's blocked layout. A fixed ~0.06 ms a
    call, then rows are nearly free up to a few dozen: a verify step of k + 1 rows costs about a decode step.
Which wins depends on the shape, the rows and the thread count, so `plan_linears` times both on each distinct
(shape, rows) of the model (on cold weights, as a forward reads them; the plans are cached on disk per machine)
and every linear then dispatches on its input's row count. The packing hint only
matters as 1 vs more (oneDNN picks a GEMV-style layout for 1), so one packed copy serves every row count > 1.

Only the CPU uses this; CUDA keeps `nn.Linear`. The weight parameter stays (state dicts, autograd, a tied
embedding); the packed copy is extra memory (a tied `lm_head` thereby stops reading the embedding's storage,
itself a 2x slowdown). Autograd always takes the matmul path: the oneDNN op has no backward.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specstep.engine.errors import ConfigError
from specstep.engine.model_source import cache_root

MODES = ("auto", "matmul", "onednn")
PROBE_ROWS = (1, 2, 5, 8, 16, 32)  # decode, small verify, verify at k=4, batches; beyond 32 the 32 choice holds
PACK_HINT = 16
COLD_BYTES = 64 << 20  # timing cycles through this many bytes of weight copies: more than a last-level cache
MAX_COPIES = 64  # ... but no more copies than this (tiny weights are dispatch-bound, hot or cold)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs in `dtype` on this CPU. Its half-precision kernels need AVX-512
    (BF16 / FP16) or AVX-NE-CONVERT: on an AVX2-only host `_reorder_linear_weight` refuses bf16 and fp16 weights."""
    if not onednn_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


@dataclass(frozen=True, slots=True)
class LinearPlan:
    """rows <= PROBE_ROWS[i] use `onednn[i]`; past the last probe, the last choice."""

    onednn: tuple[bool, ...]

    def use_onednn(self, rows: int) -> bool:
        for bound, choice in zip(PROBE_ROWS, self.onednn):
            if rows <= bound:
                return choice
        return self.onednn[-1]

    @property
    def needs_pack(self) -> bool:
        return any(self.onednn)


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
        self._packed = pack(weight.detach()) if plan.needs_pack else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        onednn = self._by_rows[rows] if rows < len(self._by_rows) else self._by_rows[-1]
        if onednn and self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self._mm, self.bias)

    def extra_repr(self) -> str:
        rows = [r for r in PROBE_ROWS if self.plan.use_onednn(r)]
        return f"in={self.in_features}, out={self.out_features}, onednn_rows={rows}"


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_HINT)


def matmul_storage(weight: torch.Tensor) -> torch.Tensor:
    """The same values, stored as the transpose of a contiguous [in, out] buffer: MKL's fast layout."""
    return weight.t().contiguous().t()


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3


def measure_plan(out_features: int, in_features: int, dtype: torch.dtype, budget_ms: float = 250.0) -> LinearPlan:
    """Time both kernels on random data of this shape at each probe row count (alternating, median).

    In a forward every weight is read once and is cold (a model's weights are many times the last-level cache),
    so the timing cycles through enough copies of the weight to exceed the cache: timed on one hot copy, MKL looks
    better than it is for small weights at several rows (it re-reads them), and the plan picks it wrongly."""
    w = torch.randn(out_features, in_features, dtype=dtype)
    copies = min(MAX_COPIES, max(1, -(-COLD_BYTES // (w.numel() * w.element_size()))))
    w_mm = [matmul_storage(w) for _ in range(copies)]
    w_dnn = [pack(w) for _ in range(copies)]
    choices = []
    with torch.inference_mode():
        for rows in PROBE_ROWS:
            x = torch.randn(rows, in_features, dtype=dtype)
            mm = lambda x=x: [F.linear(x, m) for m in w_mm]  # noqa: E731
            dnn = lambda x=x: [torch.ops.mkldnn._linear_pointwise(x, d, None, "none", [], "") for d in w_dnn]  # noqa: E731
            one = _median_ms(mm, 1)
            reps = max(1, min(15, int(budget_ms / len(PROBE_ROWS) / 6 / max(one, 1e-3))))
            a, b = [], []
            for _ in range(3):  # alternate so machine noise hits both alike
                a.append(_median_ms(mm, reps))
                b.append(_median_ms(dnn, reps))
            choices.append(sorted(b)[1] < 0.97 * sorted(a)[1])  # onednn must clearly win
    return LinearPlan(tuple(choices))


_PLANS: dict[str, LinearPlan] = {}  # every layer of a model shares its shapes: measured once per process


def _plan_cache() -> Path:
    """Measured plans persist per machine (keyed by shape, threads, torch and CPU): only a first start pays."""
    return cache_root() / f"linear_plans-{torch.__version__}-{platform.machine()}-{os.cpu_count()}.json"


def plan_for(out_features: int, in_features: int, dtype: torch.dtype, mode: str) -> LinearPlan:
    """`auto` measures where oneDNN supports the dtype and takes matmul elsewhere (F.linear runs every dtype);
    `onednn` where it does not is an error at load, not a crash at the first pack."""
    if mode == "onednn" and not onednn_supports(dtype):
        what = "is not built into this torch" if not onednn_available() else f"has no {dtype} linear on this CPU"
        raise ConfigError(f"--cpu-linear onednn: oneDNN {what} (half precision needs AVX-512 BF16/FP16 or "
                          "AVX-NE-CONVERT); use --cpu-linear auto or matmul")
    if mode == "matmul" or not onednn_supports(dtype):
        return LinearPlan((False,) * len(PROBE_ROWS))
    if mode == "onednn":
        return LinearPlan((True,) * len(PROBE_ROWS))
    key = f"{out_features}x{in_features}:{str(dtype)}:t{torch.get_num_threads()}:rows{','.join(map(str, PROBE_ROWS))}"
    if key not in _PLANS:
        path = _plan_cache()
        try:
            stored = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            stored = {}
        if key in stored:
            _PLANS[key] = LinearPlan(tuple(bool(c) for c in stored[key]))
        else:
            _PLANS[key] = measure_plan(out_features, in_features, dtype)
            stored[key] = list(_PLANS[key].onednn)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(stored, indent=1))
                tmp.replace(path)  # atomic: concurrent starts never read half a file
            except OSError:
                pass  # a read-only home: measure again next time
    return _PLANS[key]


def plan_linears(module: nn.Module, mode: str = "auto") -> dict[str, LinearPlan]:
    """Replace every `nn.Linear` of `module` by a `CpuLinear` with a measured plan; returns the plans by name.

    Weights shared with an embedding keep their storage (the lookup wants contiguous rows; the linear gets a copy);
    every other weight moves to the matmul layout in place, as the matmul path is what a plan falls back to.
    """
    if mode not in MODES:
        raise ValueError(f"cpu linear mode must be one of {', '.join(MODES)}, got {mode!r}")
    shared = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    plans: dict[str, LinearPlan] = {}
    for name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            weight = child.weight
            if id(weight) not in shared:
                weight.data = matmul_storage(weight.data)
            plan = plan_for(child.out_features, child.in_features, weight.dtype, mode)
            setattr(parent, child_name, CpuLinear(weight, child.bias, plan, shared=id(weight) in shared))
            plans[f"{name}.{child_name}".lstrip(".")] = plan
    return plans
