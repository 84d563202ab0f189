"""Which kernel and dtype a CPU linear runs, measured on this host at load and cached on disk per machine.

Two kernels compute the same `x @ W.T` (CPU_NOTES.md):
  * `matmul`: MKL over a pre-transposed contiguous weight (`W` stored as the transpose of an [in, out] buffer).
    Fastest at one row (a GEMV), but its cost grows with the rows: 5 rows of SmolLM2's lm_head cost ~3x one;
    and a row's bits change with the number of rows (not batch-invariant).
  * `onednn`: torch's oneDNN linear over a weight reordered once into oneDNN's blocked layout. A fixed ~0.06 ms a
    call, then rows are nearly free up to a few dozen: a verify step of k + 1 rows costs about a decode step.
    A row's bits do not depend on the rows beside it (measured at 1-600 rows): the batch-invariant kernel.
Which wins depends on the shape, the rows and the thread count, so with batch invariance off `measure_plan`
times both on each distinct (shape, rows) of the model (on cold weights, as a forward reads them) and every
linear dispatches on its input's row count. With it on, every row count runs oneDNN. Where oneDNN runs bf16
(AVX512_BF16, AMX), `measure_dtypes` times fp32 against bf16 weights and `engine.cpu_kernels` decides.
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

from specstep.engine.errors import ConfigError
from specstep.engine.model_source import cache_root

PROBE_ROWS = (1, 2, 5, 8, 16, 32)  # decode, small verify, verify at k=4, batches; beyond 32 the 32 choice holds
DTYPE_ROWS = (1, 5)  # decode and verify (k = 4) at batch 1: what the dtype choice weighs
PACK_HINT = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
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


def cpu_isa() -> str:
    """What this CPU offers for linears, for the ready line (flags from /proc/cpuinfo where there is one)."""
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return torch.backends.cpu.get_cpu_capability()
    for flag, name in (("amx_bf16", "AMX_BF16"), ("avx512_bf16", "AVX512_BF16"), ("avx_ne_convert", "AVX-NE-CONVERT"),
                       ("avx512f", "AVX-512 without BF16"), ("avx2", "AVX2 only")):
        if flag in flags:
            return name
    return torch.backends.cpu.get_cpu_capability()


@dataclass(frozen=True, slots=True)
class LinearPlan:
    """rows <= PROBE_ROWS[i] use `onednn[i]`; past the last probe, the last choice. `dtype`: the weights the
    kernel reads (bfloat16: a bf16 oneDNN copy of a float32 weight, activations cast to it and back)."""

    onednn: tuple[bool, ...]
    dtype: str = "float32"
    note: str = ""  # the model's dtype choice and why (`engine.cpu_kernels.DtypeChoice.reason`)

    def use_onednn(self, rows: int) -> bool:
        for bound, choice in zip(PROBE_ROWS, self.onednn):
            if rows <= bound:
                return choice
        return self.onednn[-1]

    @property
    def needs_pack(self) -> bool:
        return any(self.onednn)

    @property
    def batch_invariant(self) -> bool:
        """One row-invariant kernel for every row count."""
        return all(self.onednn)


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


def _cold_copies(out_features: int, in_features: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    w = torch.randn(out_features, in_features).to(dtype)
    return w, min(MAX_COPIES, max(1, -(-COLD_BYTES // (w.numel() * w.element_size()))))


def _time_kernels(kernels: dict, in_features: int, rows: tuple[int, ...], budget_ms: float) -> dict:
    """Median ms per kernel and row count, alternating kernels three times (machine noise hits all alike).
    `kernels`: name -> (weight copies, f(x, w), input dtype)."""
    out: dict = {}
    with torch.inference_mode():
        for r in rows:
            calls = {}
            for name, (copies, f, dtype) in kernels.items():
                x = torch.randn(r, in_features).to(dtype)
                calls[name] = lambda x=x, copies=copies, f=f: [f(x, w) for w in copies]  # noqa: E731
            one = _median_ms(next(iter(calls.values())), 1)
            reps = max(1, min(15, int(budget_ms / len(rows) / (2 * len(calls)) / max(one, 1e-3))))
            times: dict = {name: [] for name in calls}
            for _ in range(3):
                for name, call in calls.items():
                    times[name].append(_median_ms(call, reps))
            for name, t in times.items():
                out[name, r] = sorted(t)[1]
    return out


def _dnn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def measure_plan(out_features: int, in_features: int, dtype: torch.dtype, budget_ms: float = 250.0) -> LinearPlan:
    """Time both kernels on random data of this shape at each probe row count (alternating, median).

    In a forward every weight is read once and is cold (a model's weights are many times the last-level cache),
    so the timing cycles through enough copies of the weight to exceed the cache: timed on one hot copy, MKL looks
    better than it is for small weights at several rows (it re-reads them), and the plan picks it wrongly."""
    w, n = _cold_copies(out_features, in_features, dtype)
    t = _time_kernels({"mm": ([matmul_storage(w) for _ in range(n)], F.linear, dtype),
                       "dnn": ([pack(w) for _ in range(n)], _dnn, dtype)}, in_features, PROBE_ROWS, budget_ms)
    return LinearPlan(tuple(t["dnn", r] < 0.97 * t["mm", r] for r in PROBE_ROWS))  # onednn must clearly win


def measure_dtypes(out_features: int, in_features: int, budget_ms: float = 250.0) -> dict[str, list[float]]:
    """ms at DTYPE_ROWS of fp32 MKL, fp32 oneDNN and bf16 oneDNN (a bf16 weight; fp32 activations cast to bf16
    and the result back, as `CpuLinear` runs it)."""
    w, n = _cold_copies(out_features, in_features, torch.float32)
    wb = w.to(torch.bfloat16)
    t = _time_kernels({"fp32_matmul": ([matmul_storage(w) for _ in range(n)], F.linear, torch.float32),
                       "fp32_onednn": ([pack(w) for _ in range(n)], _dnn, torch.float32),
                       "bf16_onednn": ([pack(wb) for _ in range(2 * n)],
                                       lambda x, p: _dnn(x.to(torch.bfloat16), p).float(), torch.float32)},
                      in_features, DTYPE_ROWS, budget_ms)
    return {name: [t[name, r] for r in DTYPE_ROWS] for name in ("fp32_matmul", "fp32_onednn", "bf16_onednn")}


class PlanCache:
    """Measurements persist per machine (keyed by shape, threads, torch and CPU): only a first start pays. Held
    by the process (every layer of a model shares its shapes: measured once)."""

    def __init__(self) -> None:
        self._mem: dict[str, object] = {}

    @staticmethod
    def path() -> Path:
        return cache_root() / f"linear_plans-{torch.__version__}-{platform.machine()}-{os.cpu_count()}.json"

    def get(self, key: str, measure):
        if key not in self._mem:
            path = self.path()
            try:
                stored = json.loads(path.read_text()) if path.is_file() else {}
            except (OSError, ValueError):
                stored = {}
            if key in stored:
                self._mem[key] = stored[key]
            else:
                self._mem[key] = stored[key] = measure()
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_suffix(f".{os.getpid()}.tmp")
                    tmp.write_text(json.dumps(stored, indent=1))
                    tmp.replace(path)  # atomic: concurrent starts never read half a file
                except OSError:
                    pass  # a read-only home: measure again next time
        return self._mem[key]


PLANS = PlanCache()


def _threads_key() -> str:
    return f"t{torch.get_num_threads()}"


def dtype_timings(out_features: int, in_features: int) -> dict[str, list[float]]:
    return PLANS.get(f"dtypes:{out_features}x{in_features}:{_threads_key()}:rows{','.join(map(str, DTYPE_ROWS))}",
                     lambda: measure_dtypes(out_features, in_features))


def plan_for(out_features: int, in_features: int, dtype: torch.dtype, mode: str, batch_invariant: bool = False,
             kernel_dtype: torch.dtype | None = None) -> LinearPlan:
    """`auto` measures where oneDNN supports the dtype and takes matmul elsewhere (F.linear runs every dtype);
    `onednn` where it does not is an error at load, not a crash at the first pack. `batch_invariant`: oneDNN
    for every row count where it runs (`engine.cpu_kernels.invariant_linear_mode`). `kernel_dtype`: bf16
    weights for a float32 model (oneDNN only)."""
    kernel_dtype = kernel_dtype or dtype
    if mode == "onednn" and not onednn_supports(kernel_dtype):
        what = "is not built into this torch" if not onednn_available() else f"has no {kernel_dtype} linear on this CPU"
        raise ConfigError(f"--cpu-linear onednn: oneDNN {what} (half precision needs AVX-512 BF16/FP16 or "
                          "AVX-NE-CONVERT); use --cpu-linear auto or matmul")
    every = len(PROBE_ROWS)
    if kernel_dtype != dtype:
        return LinearPlan((True,) * every, str(kernel_dtype).replace("torch.", ""))
    if mode == "matmul" or not onednn_supports(dtype):
        return LinearPlan((False,) * every)
    if mode == "onednn" or batch_invariant:
        return LinearPlan((True,) * every)
    key = f"{out_features}x{in_features}:{str(dtype)}:{_threads_key()}:rows{','.join(map(str, PROBE_ROWS))}"
    return LinearPlan(tuple(bool(c) for c in PLANS.get(
        key, lambda: list(measure_plan(out_features, in_features, dtype).onednn))))
