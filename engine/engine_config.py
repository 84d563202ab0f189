"""The engine's frozen configuration: one field per engine option, with its default, its validation and its help
text in the field's metadata (`Option`), from which `specstep generate` and `specstep serve` build their flags
(`scheduler/engine_options.py`)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from specstep.engine.cpu_kernels import ACTIVATION_CHOICES, CpuKernels
from specstep.engine.errors import ConfigError
from specstep.engine.model_source import EMBEDDED_TARGET as DEFAULT_TARGET
from specstep.engine.model_source import default_draft, resolve_model

SPEC_KINDS = ("none", "draft_model", "mtp", "ngram")
SPEC_POLICIES = ("fixed", "adaptive")
SPEC_OBJECTIVES = ("throughput", "latency")  # `scheduler.spec.policy.OBJECTIVES`
# `serve`'s chunked prefill: a mixed step may cost this many of the running batch's plain decode steps. A step
# costs its decode part plus the chunk, so a long prompt's time to first token is at best 1 + 1/(X - 1) times a
# whole-prompt prefill's (1.5 at 3) while the streams' gaps grow to about X times their median: 3 keeps both
# gaps <= 3x and TTFT <= 1.5x; 2.5 measured gaps 2.1x and TTFT 2.5x on a 2,000-token prompt on CPU, 3 gave 2.6x
# and 1.7x (benchmarks/results/2026-12-02-chunked-prefill-avx2.md).
SERVE_MAX_STEP_LATENCY = 3.0


class InvalidOption(ConfigError, ValueError):
    """An engine option outside its valid values (a `ConfigError` for the CLI's one-line message, a `ValueError`
    for library callers)."""


@dataclass(frozen=True, slots=True)
class Alias:
    """A second flag that stores a constant into an option (`--no-overlap` = `--overlap off`)."""

    flag: str
    const: Any
    help: str | Callable[[str], str]  # a callable gets the command name


@dataclass(frozen=True, slots=True)
class Option:
    """One engine option's CLI form and validation, read from its `EngineConfig` field.

    The CLI default is the field's default unless `defaults` names one for a command (`serve` and `generate`
    differ on chunked prefill; the CLI resolves a few values itself, e.g. the pretrained target for `model`).
    `help` says what the option does; "(default: X)" is appended, or put where "{default}" stands, with X from
    `shown` (a text, or a callable of the command name) or else the default itself. Where a command's default
    is not the field's, the help says the field's too (`library_shown`, or the value): "X; EngineConfig's: Y".
    `None` is valid for fields whose type allows it (unset: the documented fallback); otherwise the value must be
    one of `choices` and pass `check`, stated as `rule` in the error. `cli=False`: a library-only field (what
    tests construct, not a user's choice), with no flag; the CLI leaves it at its default."""

    help: str
    choices: tuple | None = None
    check: Callable[[Any], bool] | None = None
    rule: str = ""
    shown: str | Callable[[str], str] | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    short: str | None = None
    metavar: str | None = None
    cli_choices: tuple | None = None  # what the CLI accepts where it differs from the field's values
    from_cli: Callable[[Any, argparse.Namespace], Any] | None = None  # a CLI value into the field's
    aliases: tuple[Alias, ...] = ()
    cli: bool = True
    library_shown: str | None = None  # the field's default in words, where a command's differs (see above)


def option(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"option": Option(help, **kw)})


def option_of(f) -> Option:
    return f.metadata["option"]


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def command_default(name: str, command: str) -> Any:
    """What `specstep COMMAND` parses for option `name` when it is not given."""
    f = _FIELDS[name]
    opt = option_of(f)
    return opt.defaults[command] if command in opt.defaults else f.default


def resolve_overlap(choice: str, args: argparse.Namespace) -> bool:
    """`--overlap auto`: on with CUDA, inline on CPU (the worker-thread stream shares the GIL; docs/performance.md)."""
    if choice != "auto":
        return choice == "on"
    if args.device == "auto":
        import torch

        return torch.cuda.is_available()
    return args.device.startswith("cuda")


def _model_shown(command: str) -> str:
    from specstep.engine.model_source import default_target

    return default_target().origin


def _chunking_shown(command: str) -> str:
    latency = command_default("max_step_latency", command)
    return (f"calibrated, --max-step-latency {latency:g}" if latency is not None else
            "off, a prompt is prefilled whole in a step of its own while running requests wait")


def _no_chunking_help(command: str) -> str:
    on = command_default("max_step_latency", command) is not None
    return ("same as --max-num-batched-tokens 0: whole-prompt prefill steps "
            f"(default: {'chunked' if on else 'off already'})")


def _latency_shown(command: str) -> str:
    latency = command_default("max_step_latency", command)
    return f"{latency:g}" if latency is not None else "unset: chunked prefill off"


def _positive(v) -> bool:
    return v >= 1


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # The library's default target is the small embedded one (fast, for tests); the CLI's is the pretrained one
    # (`engine.model_source.default_target`), filled in by `generate_cmd.resolve_model_arg`.
    model: str = option(str(DEFAULT_TARGET),
                        "target model: a Hugging Face folder or a GGUF file (converted once into ~/.cache/specstep). "
                        "Default: {default}", shown=_model_shown, defaults={"serve": None, "generate": None},
                        library_shown="the small embedded target, for tests")
    spec: str = option("none", "speculation proposer", choices=SPEC_KINDS, defaults={"serve": None},
                       shown=lambda c: ("the one shipped with the target, an MTP head or a draft model; else ngram"
                                        if c == "serve" else "none"))
    draft: str | None = option(None, "draft model or MTP head folder", shown="the one shipped for the target, if any")
    num_spec_tokens: int = option(4, "draft tokens per step (k; the maximum if adaptive; default: {default})",
                                  check=lambda v: 0 <= v <= 16, rule="in [0, 16]")
    ngram_match_ratio: float = option(
        1.0, "ngram: draft at most ratio x the length of the context the lookup matched (a long match predicts "
             "further; 0: always k)", check=lambda v: 0.0 <= v < math.inf, rule="finite, >= 0 (0: always k)")
    draft_vocab: int | None = option(
        None, "drafter vocabulary: the N most frequent tokens from its folder's draft_vocab.json (default: {default}; "
              "0: the full vocabulary). Lossless either way", shown="all of that list when present",
        check=lambda v: v >= 0, rule=">= 0 (0: the full vocabulary)")
    page_size: int = option(16, "tokens per KV page", check=_positive, rule=">= 1")
    # KV capacity: planned from memory (engine.memory_plan) unless given. num_pages > kv_cache_tokens > the plan.
    kv_cache_tokens: int | None = option(None, "KV capacity in tokens, overriding the memory plan",
                                         shown="planned, see --gpu-memory-utilization", check=_positive, rule=">= 1")
    num_pages: int | None = option(None, "KV pages (overrides --kv-cache-tokens and the plan)", shown="planned",
                                   check=lambda v: v >= 2, rule=">= 2 (page 0 is the dummy page)")
    gpu_memory_utilization: float | None = option(
        None, "share of memory the engine may use, KV cache included: the KV cache gets F x the GPU's memory minus "
              "what is in use (weights, other processes), a warm-up's peak at the largest batch and a CUDA-graph "
              "reserve; on CPU F x the RAM available at start-up minus the weights and an activation estimate "
              "(default: {default}). The ready line reports the result", metavar="F",
        shown="0.9 on CUDA, as vLLM; on CPU 0.5 with the KV cache capped at 4 GiB",
        check=lambda v: 0.0 < v <= 1.0, rule="in (0, 1]")
    # Ranks of a tensor-parallel group (one process and one device each; `engine.parallel`). The draft model runs
    # on the leader only; the MTP head is split with the target.
    tensor_parallel_size: int = option(
        1, "split the target (and its MTP head) over N ranks, one process and one device each (torch.distributed: "
           "NCCL on GPUs, gloo on CPU); a draft model runs on rank 0 only", short="-tp", metavar="N",
        check=_positive, rule=">= 1")
    max_batch_size: int = option(64, "most requests decoding at once", check=_positive, rule=">= 1")
    max_prefill_tokens: int = option(4096, "most prompt tokens in a whole-prompt prefill step, and the ceiling of a "
                                           "calibrated chunked-prefill budget", check=_positive, rule=">= 1")
    # Chunked prefill (`scheduler/core/prefill_budget.py`): every running request runs its decode step (speculative
    # or not) in each step and prompt chunks fill the rest of its budget, as in vLLM. max_num_batched_tokens N: a
    # fixed budget of N tokens a step (0: off). Unset: calibrated at start-up (and paced live,
    # `scheduler/core/prefill_pacer.py`) so a mixed step costs at most max_step_latency of the running (or steady)
    # batch's decode steps, never below the compute-efficient forward (docs/scheduling.md), or off when that is
    # unset too (the library's and `generate`'s default; `serve` sets it). Off: a prompt is prefilled whole in a
    # step of its own while running requests wait. A budget below the running batch is allowed: prompts still
    # get a share of every step (`PrefillBudget.chunk`).
    max_num_batched_tokens: int | None = option(
        None, "chunked prefill with a fixed budget of N tokens a step: running requests decode (their drafts "
              "count) and prompts are prefilled in chunks beside them; 0: off", metavar="N", shown=_chunking_shown,
        check=lambda v: v >= 0, rule=">= 0 (0: off)",
        aliases=(Alias("--no-chunked-prefill", 0, _no_chunking_help),))
    max_step_latency: float | None = option(
        None, "chunked prefill with a budget calibrated at start-up (a few seconds on CPU) and kept true from the "
              "engine's own step times: a step mixing prompt chunks with decoding costs at most X of the running "
              "batch's decode steps (of the batch the waiting prompts will make, where that is longer; never less "
              "than one compute-efficient forward), so running streams "
              "keep about X times their usual inter-token gap while a long prompt is prefilled; larger X: faster "
              "prefill, longer gaps. --max-num-batched-tokens "
              "overrides it (default: {default}). The ready line reports the budget", metavar="X",
        shown=_latency_shown, defaults={"serve": SERVE_MAX_STEP_LATENCY}, library_shown="unset: chunked prefill off",
        check=lambda v: v > 1.0, rule="> 1 (decode steps)")
    max_model_len: int | None = option(None, "longest sequence, prompt + output tokens", shown="the model's own limit",
                                       check=_positive, rule=">= 1")
    dtype: str = option(
        "auto", "weights and activations (default: {default})", choices=("auto", "float32", "bfloat16", "float16"),
        shown="auto: float32 on CPU, its linears reading bf16 weights where this CPU's oneDNN runs them measured "
              "faster (AVX512_BF16, AMX; numerics change, the ready line says; float32: exact); on CUDA the "
              "checkpoint's 16-bit dtype, bfloat16 for a float32 checkpoint")
    device: str = option("auto", "auto | cpu | cuda | cuda:N", shown="auto: cuda if available",
                         check=lambda v: v in ("auto", "cpu", "cuda") or v.startswith("cuda:"),
                         rule="auto, cpu, cuda or cuda:N")
    threads: int | None = option(None, "torch threads on CPU", shown="1 with overlap, 2 without",
                                 check=_positive, rule=">= 1")
    # One default for the library and the CLI: what users get.
    spec_policy: str = option(
        "adaptive", "fixed k, or choose k per step/request from measured acceptance and step costs, with a governor "
                    "that turns speculation off where it loses more than --spec-delta", choices=SPEC_POLICIES)
    spec_objective: str = option(
        "throughput", "what the adaptive policy optimises: tokens per second, or tokens per second with no "
                      "speculative step longer than --spec-itl-budget times a plain step (p99 inter-token latency; "
                      "default: {default})", choices=SPEC_OBJECTIVES)
    spec_itl_budget: float = option(1.1, "latency objective: the longest speculative step, as a multiple of a plain "
                                         "step", check=lambda v: v >= 1.0, rule=">= 1.0")
    spec_delta: float = option(0.02, "adaptive: the governor switches speculation off when confident it runs below "
                                     "(1 - delta) of plain decoding's throughput",
                               check=lambda v: 0.0 <= v < 1.0, rule="in [0, 1)")
    spec_epsilon: float | None = option(None, "adaptive: the largest fraction of steps spent probing while "
                                              "speculation is off", shown="0.02; 0.005 with the latency objective",
                                        check=lambda v: 0.0 < v <= 1.0, rule="in (0, 1]")
    # The library's default is on; the CLI's is auto (on with CUDA, inline on CPU, where it measured faster): the
    # tests through the library exercise the overlapped path, users get the faster one. `--help` states both.
    overlap: bool = option(
        True, "prepare step N+1 on the host while step N runs (auto: on for CUDA; off on CPU, where the "
              "worker-thread stream shares the GIL and measured slower)",
        cli_choices=("auto", "on", "off"), from_cli=resolve_overlap, defaults={"serve": "auto", "generate": "auto"},
        aliases=(Alias("--no-overlap", "off", "same as --overlap off"),))
    graphs: str = option("auto", "CUDA graphs for the decode, draft, verify and refill steps, captured per batch "
                                 "bucket at start-up (auto: on with CUDA). On CPU the steps run eagerly",
                         choices=("auto", "on", "off"))
    # The CPU stand-in of CUDA graphs (`cuda_graphs/cpu_standin.py`) checks the graph contract (static inputs and
    # outputs, nothing kept alive from a step) so code that breaks it fails on CPU too; it only costs time there.
    graph_standin: bool = option(
        False, "CPU: run the steps through the contract-checking stand-in of CUDA graphs (for tests)", cli=False)
    attention: str = option("auto", "paged-attention backend (auto: torch; flashinfer: CUDA with the flashinfer "
                                    "package)", choices=("auto", "torch", "flashinfer"))
    cpu_linear: str = option(
        "auto", "CPU linear kernels (auto: prepacked oneDNN at every row count with --batch-invariant on, else MKL "
                "or oneDNN per weight shape and row count, timed at load; matmul / onednn: one kernel everywhere, "
                "matmul only with --batch-invariant off)", choices=("auto", "matmul", "onednn"))
    # CPU: every row of a step computes the bits it would alone, so greedy speculation is greedy decoding bitwise
    # (engine.cpu_kernels). Off: faster plain decoding where oneDNN's 1-row linear is slower than MKL's (AVX2).
    batch_invariant: bool = option(
        True, "CPU: every row of a step computes the bits it would alone (oneDNN linears at every row count, "
              "row-invariant attention), so speculative greedy output is plain greedy output bitwise; off: the "
              "fastest kernel per row count (on an AVX2 host a plain decode step measured 1.09-1.26x with it on: "
              "oneDNN's one-row linear is slower than MKL's and the invariant attention runs more ops)")

    quantization: str = option(
        "auto", "CPU: auto runs a GGUF checkpoint's weights as the file's blocks are (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, "
                "Q2_K/Q3_K/Q4_K/Q5_K/Q6_K, F16/BF16) in specstep's kernels (batch-invariant; built with g++ at the "
                "first start), and a bf16 or fp16 folder's in its own 16-bit rows, where this host runs them, else "
                "fp32; "
                "gguf: those kernels or an error; q8_0: quantise a Hugging Face folder's linears and embedding to "
                "Q8_0 at load, as llama-quantize does (1.06 bytes a weight; not exact); none: fp32 weights",
        choices=("auto", "gguf", "q8_0", "none"))
    cpu_layers: str = option(
        "auto", "CPU, GGUF linears: auto runs the decoder layers' norms, rotary, KV writes, residuals and MLP gate in "
                "specstep's C++ (one call a decode, verify, draft or refill step; built with g++ at the first "
                "start) where they run here; torch: eager torch ops around the GGUF kernel",
        choices=("auto", "torch"))
    activations: str = option(
        "auto", "CPU, GGUF checkpoints: int8 quantises each linear's input per block (scale amax / 127, per 32 "
                "values for the legacy formats, per 256 with 16-value sums for the K-quants, as llama.cpp does) and "
                "multiplies in integers: faster, not exact against fp32 (speculative output still equals plain "
                "output under it, bitwise); fp32: exact; auto: int8 where the weights are block-quantised, fp32 "
                "for 16-bit and fp32 weights. SPECSTEP_CPU_ISA=avx2|avx512|amx pins the kernels' ISA",
        choices=ACTIVATION_CHOICES)
    kv_cache_dtype: str = option(
        "auto", "the KV cache's dtype: auto is the model's (float32 on CPU: exact); bfloat16 on CPU holds keys and "
                "values rounded to bf16 (half the bytes a token: twice the tokens in the same memory, and half "
                "the bytes a step's attention reads, which long contexts and large batches are bound by; numerics "
                "change, speculative output still equals plain output under it, bitwise). On CUDA: the model's own "
                "dtype only",
        choices=("auto", "float32", "bfloat16"))

    def __post_init__(self) -> None:
        for f in fields(self):
            check_option(f, getattr(self, f.name))
        if self.activations not in ("fp32", "auto") and self.quantization == "none":
            raise InvalidOption(f"--activations {self.activations} runs in the GGUF kernel: not with "
                                "--quantization none")

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
        return CpuKernels(self.cpu_linear, "auto" if self.dtype == "auto" else "off", self.batch_invariant,
                          self.quantization, self.cpu_layers, self.activations)

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


def check_option(f, value: Any) -> None:
    """The one validation of an option, for the library and the CLI alike."""
    opt, flag = option_of(f), flag_of(f.name)
    if value is None:
        if "None" in str(f.type):
            return  # unset: the documented fallback
        raise InvalidOption(f"{flag} must be given")
    if str(f.type) == "bool" and not isinstance(value, bool):
        raise InvalidOption(f"{flag} must be on or off, got {value!r}")
    if opt.choices is not None and value not in opt.choices:
        raise InvalidOption(f"{flag} must be one of {', '.join(map(str, opt.choices))}, got {value!r}")
    if opt.check is not None and not opt.check(value):
        raise InvalidOption(f"{flag} must be {opt.rule}, got {value!r}")


_FIELDS = {f.name: f for f in fields(EngineConfig)}
