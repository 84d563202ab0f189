"""Attention backends over the paged KV cache: the torch reference (CPU and CUDA) and FlashInfer (CUDA).

`make_backend` builds the one a model's layers use; `resolve_backend` turns the `--attention` choice
(auto | torch | flashinfer) into a backend name for a device.
"""

from __future__ import annotations

import torch

from specstep.engine.attention.backend import AttentionBackend
from specstep.engine.attention.torch_backend import TorchAttention
from specstep.engine.config import ModelConfig
from specstep.engine.errors import ConfigError

BACKENDS = ("auto", "torch", "flashinfer")


def resolve_backend(choice: str, device: torch.device) -> str:
    """auto is the torch reference for now: FlashInfer stays opt-in (`--attention flashinfer`) until the GPU
    check (scripts/gpu_check.sh) has run its engine-level tests on a GPU; then auto should pick it on CUDA."""
    if choice not in BACKENDS:
        raise ConfigError(f"--attention must be one of {', '.join(BACKENDS)}, got {choice!r}")
    return "torch" if choice == "auto" else choice


def make_backend(name: str, cfg: ModelConfig, page_size: int, dtype: torch.dtype, device: torch.device,
                 max_pages_per_request: int, workspace: torch.Tensor | None = None) -> AttentionBackend:
    """A backend for one model (head counts and page size fixed). FlashInfer instances of one engine may share
    a float `workspace` (their kernels run in stream order)."""
    if name == "torch":
        return TorchAttention()
    from specstep.engine.attention.flashinfer_backend import FlashInferAttention

    return FlashInferAttention(cfg, page_size, dtype, device, max_pages_per_request, workspace)
