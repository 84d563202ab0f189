"""What the CPU's linears and attention may run, and the pure rules that choose among measured kernels.

`CpuKernels` is what the configuration asks for (no torch here: the serving frontend imports the config);
`engine.models.cpu_linear` measures kernels on this host and applies these rules, so the rules are unit-tested
with injected capabilities and timings on any host, including the branches this host cannot run.

Batch invariance (`batch_invariant`): every row of a step computes the bits it would compute alone, so a verify
row's logits are bitwise the plain decode step's at that position and greedy speculation is exactly greedy
decoding. Linears then run one kernel for every row count (oneDNN's prepacked linear: measured row-invariant;
MKL's GEMM sums a row differently by the number of rows), attention a row-invariant path
(`engine.attention.invariant_attention`). Off: each linear takes the faster kernel per row count.
"""

from __future__ import annotations

from dataclasses import dataclass

from specstep.engine.errors import ConfigError

LINEAR_MODES = ("auto", "matmul", "onednn")
HALF_CHOICES = ("auto", "off")
QUANTIZATION_CHOICES = ("auto", "gguf", "q8_0", "none")
LAYER_CHOICES = ("auto", "torch")
# int8: in AMX tiles where the host has AMX-INT8 (block sums), else in AVX-512 VNNI lanes (the same arithmetic) where
# it has those, else in AVX2 lanes (SPECSTEP_CPU_ISA=amx|avx512|avx2 pins one: an error where it cannot run);
# auto: int8 where the weights are block-quantised (what llama.cpp computes on them), fp32 elsewhere
ACTIVATION_CHOICES = ("auto", "fp32", "int8")
# bf16 must be this much faster than fp32 (decode and verify rows together) to be taken: it changes the numerics.
BF16_MARGIN = 0.95


@dataclass(frozen=True, slots=True)
class CpuKernels:
    """linear: auto | matmul | onednn (`--cpu-linear`); half: auto (bf16 linear weights where this CPU's
    oneDNN runs them faster: `--dtype auto`) | off (fp32 exactly: `--dtype float32`); batch_invariant: see the
    module docstring; quantization (`--quantization`): auto (a GGUF checkpoint's linears read its blocks in the
    GGUF kernels where they run here, a 16-bit folder's its own rows) | gguf (that, or an error) | q8_0 (a Hugging
    Face folder's linears quantised to Q8_0 blocks at load: `engine.models.q8_0_linears`) | none (fp32)."""

    linear: str = "auto"
    half: str = "off"
    batch_invariant: bool = True
    quantization: str = "auto"
    layers: str = "auto"  # auto: a GGUF model's decoder layers in C++ where they run (`--cpu-layers`) | torch
    activations: str = "fp32"  # int8: the GGUF kernels quantise activations per block; auto: int8 on blocks

    def __post_init__(self) -> None:
        if self.linear not in LINEAR_MODES:
            raise ValueError(f"cpu linear mode must be one of {', '.join(LINEAR_MODES)}, got {self.linear!r}")
        if self.half not in HALF_CHOICES:
            raise ValueError(f"half must be one of {', '.join(HALF_CHOICES)}, got {self.half!r}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        if self.layers not in LAYER_CHOICES:
            raise ValueError(f"layers must be one of {', '.join(LAYER_CHOICES)}, got {self.layers!r}")
        if self.activations not in ACTIVATION_CHOICES:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATION_CHOICES)}, got {self.activations!r}")
        if self.activations not in ("fp32", "auto") and self.quantization == "none":
            raise ValueError(f"{self.activations} activations run in the GGUF kernel: not with quantization none")


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    dtype: str  # float32 | bfloat16: the linears' weights (activations are cast to it and back)
    reason: str  # for the ready line


def choose_linear_dtype(half: str, bf16_runs: bool, isa: str, fp32_ms: tuple[float, float] | None = None,
                        bf16_ms: tuple[float, float] | None = None) -> DtypeChoice:
    """fp32 or bf16 linear weights. `bf16_runs`: this CPU's oneDNN has bf16 linears (AVX512_BF16, AMX or
    AVX-NE-CONVERT); `isa`: what the CPU offers, for the reason; `*_ms`: measured (decode rows, verify rows)
    times of the model's linears in each dtype. bf16 only where asked (`half`), available and clearly faster
    over decode and verify together."""
    if half == "off":
        return DtypeChoice("float32", "fp32 linears (--dtype float32: exact)")
    if not bf16_runs:
        return DtypeChoice("float32", f"fp32 linears ({isa}: no bf16 kernels)")
    if fp32_ms is None or bf16_ms is None:
        raise ValueError("bf16 runs here: both dtypes must be measured")
    ratio = sum(bf16_ms) / sum(fp32_ms)
    figures = f"decode x{bf16_ms[0] / fp32_ms[0]:.2f}, verify x{bf16_ms[1] / fp32_ms[1]:.2f} of fp32"
    verify_over_decode = bf16_ms[1] / bf16_ms[0]
    if ratio < BF16_MARGIN:
        return DtypeChoice("bfloat16", f"bf16 linears ({isa}: {figures}, verify/decode {verify_over_decode:.2f}; "
                                       "numerics differ from fp32, --dtype float32 for exact)")
    return DtypeChoice("float32", f"fp32 linears ({isa}: bf16 measured no faster, {figures})")


def invariant_linear_mode(mode: str, onednn_runs: bool) -> str:
    """The one kernel a batch-invariant linear runs for every row count: oneDNN's prepacked linear. `matmul`
    (MKL) is not row-invariant, so asking for it with invariance on is an error; `auto` where oneDNN does not
    run in this dtype has no invariant kernel (matmul, reported by `describe_linears`)."""
    if mode == "matmul":
        raise ConfigError("--cpu-linear matmul is not batch-invariant (MKL sums a row differently by the number of "
                          "rows): use --cpu-linear auto or onednn, or --batch-invariant off")
    return "onednn" if mode == "onednn" or onednn_runs else "matmul"
