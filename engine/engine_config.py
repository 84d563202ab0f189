"""The engine's frozen configuration."""

from __future__ import annotations

from dataclasses import dataclass

from specstep.engine.cpu_kernels import CpuKernels
from specstep.engine.errors import ConfigError
from specstep.engine.model_source import EMBEDDED_TARGET as DEFAULT_TARGET
from specstep.engine.model_source import default_draft, resolve_model

SPEC_KINDS = ("none", "draft_model", "mtp", "ngram")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # A folder or a GGUF file. The library's default is the small embedded target (fast, for tests); the CLI's
    # is the pretrained one (`engine.model_source.default_target`).
    model: str = str(DEFAULT_TARGET)
    spec: str = "none"  # none | draft_model | mtp | ngram
    draft: str | None = None  # draft model or MTP head folder; default: the embedded one for the default target
    num_spec_tokens: int = 4
    draft_vocab: int | None = None  # drafter's reduced vocabulary: None = its folder's list if any, 0 = full, N = top N
    page_size: int = 16
    # KV capacity: planned from memory (engine.memory_plan) unless given. num_pages > kv_cache_tokens > the plan.
    kv_cache_tokens: int | None = None
    num_pages: int | None = None
    # The plan's share of memory. None: 0.9 of the GPU; on CPU half the RAM available, at most 4 GiB of KV.
    gpu_memory_utilization: float | None = None
    # Ranks of a tensor-parallel group (one process and one device each; `engine.parallel`). The draft model runs
    # on the leader only; the MTP head is split with the target.
    tensor_parallel_size: int = 1
    max_batch_size: int = 64
    max_prefill_tokens: int = 4096  # whole-prompt prefill steps' token cap, and a calibrated budget's ceiling
    # Chunked prefill (`scheduler/prefill_budget.py`): every running request decodes one token in each step and
    # prompt chunks fill the rest of its budget, as in vLLM. max_num_batched_tokens N: a fixed budget of N
    # tokens a step (0: off). Unset: calibrated at start-up (and paced live, `scheduler/prefill_pacer.py`) so a
    # mixed step costs at most max_step_latency of the running batch's plain decode steps, or off when that is
    # unset too (the library's and `generate`'s default; `serve` sets it). Off: a prompt is prefilled whole in a
    # step of its own while running requests wait.
    max_num_batched_tokens: int | None = None
    max_step_latency: float | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    dtype: str = "auto"
    device: str = "auto"
    threads: int | None = None  # torch intra-op threads on CPU; default 1 with overlap, 2 without
    spec_policy: str = "fixed"  # fixed (k = num_spec_tokens) | adaptive (k <= num_spec_tokens, from measurements)
    spec_objective: str = "throughput"  # adaptive: throughput | latency (speculative steps within spec_itl_budget)
    spec_itl_budget: float = 1.1  # latency objective: the longest speculative step, in plain steps
    spec_delta: float = 0.02  # governor: tolerated loss against plain decoding while speculating
    spec_epsilon: float | None = None  # governor: largest fraction of probe steps while off (None: per objective)
    overlap: bool = True  # prepare step N+1 on the host while step N runs on the device stream
    graphs: str = "auto"  # auto (CUDA: on, CPU: off) | on (CPU: the contract-checking stand-in) | off
    attention: str = "auto"  # auto (torch until FlashInfer is GPU-validated) | torch | flashinfer (CUDA)
    cpu_linear: str = "auto"  # CPU linears: auto (measured per host, see engine.cpu_kernels) | matmul | onednn
    # CPU: every row of a step computes the bits it would alone, so greedy speculation is greedy decoding bitwise
    # (engine.cpu_kernels). Off: faster plain decoding where oneDNN's 1-row linear is slower than MKL's (AVX2).
    batch_invariant: bool = True

    def __post_init__(self) -> None:
        if self.spec not in SPEC_KINDS:
            raise ValueError(f"--spec must be one of {', '.join(SPEC_KINDS)}, got {self.spec!r}")
        if self.graphs not in ("auto", "on", "off"):
            raise ValueError(f"--graphs must be auto, on or off, got {self.graphs!r}")
        if self.attention not in ("auto", "torch", "flashinfer"):
            raise ValueError(f"--attention must be auto, torch or flashinfer, got {self.attention!r}")
        if self.cpu_linear not in ("auto", "matmul", "onednn"):
            raise ValueError(f"--cpu-linear must be auto, matmul or onednn, got {self.cpu_linear!r}")
        if self.page_size < 1:
            raise ValueError("page size must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ConfigError(f"--kv-cache-tokens must be >= 1, got {self.kv_cache_tokens}")
        if self.num_pages is not None and self.num_pages < 2:  # page 0 is the dummy page
            raise ConfigError(f"--num-pages must be >= 2, got {self.num_pages}")
        if self.spec_policy not in ("fixed", "adaptive"):
            raise ValueError(f"--spec-policy must be fixed or adaptive, got {self.spec_policy!r}")
        if self.spec_objective not in ("throughput", "latency"):
            raise ValueError(f"--spec-objective must be throughput or latency, got {self.spec_objective!r}")
        if self.spec_itl_budget < 1.0:
            raise ValueError(f"--spec-itl-budget must be >= 1.0, got {self.spec_itl_budget}")
        if not 0.0 <= self.spec_delta < 1.0:
            raise ValueError(f"--spec-delta must be in [0, 1), got {self.spec_delta}")
        if self.spec_epsilon is not None and not 0.0 < self.spec_epsilon <= 1.0:
            raise ValueError(f"--spec-epsilon must be in (0, 1], got {self.spec_epsilon}")
        if self.draft_vocab is not None and self.draft_vocab < 0:
            raise ValueError("--draft-vocab must be >= 0 (0: the full vocabulary)")
        if self.num_spec_tokens < 0 or self.num_spec_tokens > 16:
            raise ValueError("num_spec_tokens must be in [0, 16]")
        # A budget below the running batch is allowed: prompts still get a share of every step
        # (`PrefillBudget.chunk`).
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 0:
            raise ValueError(f"--max-num-batched-tokens must be >= 0 (0: off), got {self.max_num_batched_tokens}")
        if self.max_step_latency is not None and self.max_step_latency <= 1.0:
            raise ValueError(f"--max-step-latency must be > 1 (decode steps), got {self.max_step_latency}")

    @property
    def chunked_prefill(self) -> str:
        """fixed | calibrated | off."""
        if self.max_num_batched_tokens is not None:
            return "fixed" if self.max_num_batched_tokens > 0 else "off"
        return "off" if self.max_step_latency is None else "calibrated"

    @property
    def cpu_kernels(self) -> CpuKernels:
        """What the CPU's linears and attention may run; `--dtype auto` lets linears take bf16 weights where this
        CPU runs them faster, `--dtype float32` keeps them exact."""
        return CpuKernels(self.cpu_linear, "auto" if self.dtype == "auto" else "off", self.batch_invariant)

    @property
    def draft_path(self) -> str | None:
        if self.spec in ("none", "ngram"):
            return None
        if self.draft:
            return self.draft
        shipped = default_draft(self.spec, resolve_model(self.model))
        if shipped is not None:
            return str(shipped)
        raise ValueError(f"--spec {self.spec} needs --draft DIR: no shipped {self.spec} was trained for {self.model}")
