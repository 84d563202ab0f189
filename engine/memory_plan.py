"""KV capacity planned from memory, as vLLM does with `--gpu-memory-utilization`: the pure arithmetic.

The measuring lives in `engine.memory_probe`; this module turns its figures into a page count, so the arithmetic
is tested with injected numbers. Precedence: `--num-pages` > `--kv-cache-tokens` > the plan.

    budget   = utilization x capacity            CUDA: the device's total memory
                                                 CPU: host RAM available before the weights were loaded
    kv bytes = budget - in_use - activations - graphs
               in_use: CUDA: device memory in use after loading and warm-up (weights, proposer state, CUDA
                       context, other processes); CPU: the engine's weights and proposer state
    pages    = kv bytes // bytes_per_page        bytes_per_page: the target's and the proposer's pools together

then clamped:

    at least  seq_pages + 1                      one longest sequence (max_model_len + look-ahead) and the dummy
                                                 page; fewer is a `ConfigError` saying how much memory is missing
    at most   max_batch_size x seq_pages + 1     what a full batch of longest sequences can ever hold: more would
                                                 never be used
    CPU default (no --gpu-memory-utilization): at most `kv_cap` bytes (see memory_probe.CPU_DEFAULT_KV_CAP)
"""

from __future__ import annotations

from dataclasses import dataclass

from specstep.engine.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20


def fmt_bytes(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"


class KVCacheTooSmall(ConfigError):
    """Not even one longest sequence fits; `pages`: how many pages (the dummy page included) do fit."""

    def __init__(self, message: str, pages: int) -> None:
        super().__init__(message)
        self.pages = pages


@dataclass(frozen=True, slots=True)
class MemoryFigures:
    """What a plan is computed from, in bytes: measured at start-up (`engine.memory_probe`) or given by a test."""

    device: str  # "cuda" | "cpu": how `capacity` reads in the ready message
    capacity: int  # CUDA: total device memory; CPU: host RAM available when the engine started
    utilization: float  # the share of `capacity` this engine may take
    in_use: int  # see the module docstring; includes `weights`
    weights: int  # parameters and buffers (each storage once), CPU linears' packed copies, proposer state
    activations: int  # transient peak of the largest eager step (prefill or decode at the largest batch)
    graphs: int = 0  # reserve for the graph pool (0 without CUDA graphs)
    kv_cap: int | None = None  # a ceiling on KV bytes (the CPU default); None: none
    method: str = ""  # how activations and graphs were obtained (warm-up measured, or estimated)

    @property
    def budget(self) -> int:
        return int(self.utilization * self.capacity)

    @property
    def others(self) -> int:
        """In use but not ours to name: the CUDA context, the allocator's slack, other processes."""
        return max(0, self.in_use - self.weights)

    @property
    def free_for_kv(self) -> int:
        return self.budget - self.in_use - self.activations - self.graphs


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The KV cache's size and where it came from (a value for the ready message, never written into a config)."""

    num_pages: int  # including the dummy page
    page_size: int
    bytes_per_page: int  # target and proposer pools together
    source: str  # "planned" | "--kv-cache-tokens" | "--num-pages"
    figures: MemoryFigures | None = None  # None: an explicit size, nothing measured
    limit: str = ""  # what capped a planned size below what memory allows ("" = nothing)
    kv_dtype: str = ""  # the pools' dtype where it is not the model's (`--kv-cache-dtype`), for the ready line

    @property
    def kv_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    def describe(self) -> str:
        """e.g. `kv cache 123,456 tokens (7.5 GiB: 90% of 139.7 GiB minus 0.3 GiB weights, 1.2 GiB activations,
        0.4 GiB graphs, 0.6 GiB other)`."""
        dtype = f" in {self.kv_dtype}" if self.kv_dtype else ""
        head = f"kv cache {self.kv_tokens:,} tokens{dtype} ({fmt_bytes(self.kv_bytes)}"
        f = self.figures
        if f is None:
            return f"{head}, {self.source})"
        where = "GPU memory" if f.device == "cuda" else "available RAM"
        parts = [f"{fmt_bytes(f.weights)} weights", f"{fmt_bytes(f.activations)} activations"]
        if f.graphs:
            parts.append(f"{fmt_bytes(f.graphs)} graphs")
        if f.others >= MiB:
            parts.append(f"{fmt_bytes(f.others)} other")
        text = f"{head}: {f.utilization:.0%} of {fmt_bytes(f.capacity)} {where} minus {', '.join(parts)}"
        return f"{text}; capped at {self.limit})" if self.limit else f"{text})"

    def to_dict(self) -> dict:
        d = {"num_pages": self.num_pages, "kv_tokens": self.kv_tokens, "kv_bytes": self.kv_bytes,
             "bytes_per_page": self.bytes_per_page, "source": self.source, "limit": self.limit,
             "kv_dtype": self.kv_dtype}
        if self.figures is not None:
            f = self.figures
            d.update(capacity=f.capacity, utilization=f.utilization, budget=f.budget, in_use=f.in_use,
                     weights=f.weights, activations=f.activations, graphs=f.graphs, method=f.method)
        return d


def plan_kv_cache(bytes_per_page: int, page_size: int, seq_tokens: int, max_batch_size: int,
                  figures: MemoryFigures | None = None, kv_cache_tokens: int | None = None,
                  num_pages: int | None = None) -> MemoryPlan:
    """Pages for the KV pools (see the module docstring). `seq_tokens`: positions one sequence may write (the
    model's length plus a speculative step's k + 1 and the proposer's look-ahead). An explicit size is taken as
    given (tests and operators ask for small pools on purpose); only a planned one is clamped."""
    if num_pages is not None:
        return MemoryPlan(num_pages, page_size, bytes_per_page, "--num-pages")
    if kv_cache_tokens is not None:
        return MemoryPlan(-(-kv_cache_tokens // page_size) + 1, page_size, bytes_per_page, "--kv-cache-tokens")
    if figures is None:
        raise ValueError("a planned KV cache needs measured memory figures")
    seq_pages = -(-seq_tokens // page_size)
    least, most = seq_pages + 1, max_batch_size * seq_pages + 1
    free = figures.free_for_kv
    fit = max(0, free) // bytes_per_page
    if fit < least:
        need = least * bytes_per_page
        raise KVCacheTooSmall(
            f"KV cache: {fmt_bytes(max(0, free))} left after the weights and reserves within "
            f"{figures.utilization:.0%} of {fmt_bytes(figures.capacity)}, but one --max-model-len sequence "
            f"({seq_tokens:,} tokens) needs {fmt_bytes(need)}: {fmt_bytes(need - max(0, free))} missing. Raise "
            f"--gpu-memory-utilization, lower --max-model-len or --max-batch-size, or set --kv-cache-tokens",
            fit)
    pages, limit = fit, ""
    if figures.kv_cap is not None and figures.kv_cap // bytes_per_page < pages:
        # The cap is a default, not a request: it never makes one longest sequence impossible.
        pages, limit = max(least, figures.kv_cap // bytes_per_page), f"the CPU default {fmt_bytes(figures.kv_cap)}"
    if pages > most:
        pages, limit = most, (f"what {max_batch_size} sequences of {seq_tokens:,} tokens can hold (--max-batch-size x "
                              "--max-model-len)")
    return MemoryPlan(pages, page_size, bytes_per_page, "planned", figures, limit)
