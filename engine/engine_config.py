"""The engine's frozen configuration and the locations of the embedded default models."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULTS_DIR = Path(__file__).parent / "defaults"
DEFAULT_TARGET = DEFAULTS_DIR / "target"
DEFAULT_DRAFTS = {"draft_model": DEFAULTS_DIR / "draft", "mtp": DEFAULTS_DIR / "mtp"}
SPEC_KINDS = ("none", "draft_model", "mtp", "ngram")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = str(DEFAULT_TARGET)
    spec: str = "none"  # none | draft_model | mtp | ngram
    draft: str | None = None  # draft model or MTP head folder; default: the embedded one for the default target
    num_spec_tokens: int = 4
    page_size: int = 16
    kv_cache_tokens: int = 65536  # KV capacity (tokens) when num_pages is not given
    num_pages: int | None = None
    max_batch_size: int = 64
    max_prefill_tokens: int = 4096
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    dtype: str = "auto"
    device: str = "auto"
    threads: int | None = None  # torch intra-op threads on CPU; default 1 with overlap, 2 without
    spec_policy: str = "fixed"  # fixed (k = num_spec_tokens) | adaptive (k <= num_spec_tokens, from measurements)
    overlap: bool = True  # prepare step N+1 on the host while step N runs on the device stream
    graphs: str = "auto"  # auto (CUDA: on, CPU: off) | on (CPU: the contract-checking stand-in) | off
    attention: str = "auto"  # auto (torch until FlashInfer is GPU-validated) | torch | flashinfer (CUDA)

    def __post_init__(self) -> None:
        if self.spec not in SPEC_KINDS:
            raise ValueError(f"--spec must be one of {', '.join(SPEC_KINDS)}, got {self.spec!r}")
        if self.graphs not in ("auto", "on", "off"):
            raise ValueError(f"--graphs must be auto, on or off, got {self.graphs!r}")
        if self.attention not in ("auto", "torch", "flashinfer"):
            raise ValueError(f"--attention must be auto, torch or flashinfer, got {self.attention!r}")
        if self.page_size < 1:
            raise ValueError("page size must be >= 1")
        if self.spec_policy not in ("fixed", "adaptive"):
            raise ValueError(f"--spec-policy must be fixed or adaptive, got {self.spec_policy!r}")
        if self.num_spec_tokens < 0 or self.num_spec_tokens > 16:
            raise ValueError("num_spec_tokens must be in [0, 16]")

    @property
    def draft_path(self) -> str | None:
        if self.spec in ("none", "ngram"):
            return None
        if self.draft:
            return self.draft
        if Path(self.model).resolve() == DEFAULT_TARGET.resolve():
            return str(DEFAULT_DRAFTS[self.spec])
        raise ValueError(f"--spec {self.spec} needs --draft DIR for a non-default target")
