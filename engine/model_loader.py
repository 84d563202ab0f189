"""Build a model from a folder: parse its config, construct on `meta`, assign the checkpoint's tensors."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.errors import CheckpointError
from engine.loader import load_state_dict, resolve_dtype
from engine.models.llama import LlamaForCausalLM
from engine.models.mtp_head import MTPHead


def load_model(folder: str | Path, device: str | torch.device = "cpu", dtype: str = "auto") -> LlamaForCausalLM:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"model folder {str(folder)!r} does not exist")
    cfg = ModelConfig.from_folder(folder)
    if cfg.architecture == "mtp":
        raise CheckpointError(f"{folder}: is an MTP head, not a language model (use it as --draft with --spec mtp)")
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    load_state_dict(model, folder, torch_dtype)
    # Buffers (rotary tables) were built on meta; rebuild them for real on the target device.
    model.rotary.build_tables()
    model = model.to(device).eval()
    if device.type == "cpu":
        transpose_linear_storage(model)
    return model


def transpose_linear_storage(module: torch.nn.Module) -> None:
    """Store each linear weight [out, in] as the transpose of a contiguous [in, out] buffer (same values).

    F.linear then hands MKL a non-transposed right operand: `x @ W_t`, which on this CPU is markedly faster
    for the few-row GEMMs of decode and verify (CPU_NOTES.md). Weights shared with an embedding stay as they
    are (the lookup wants contiguous rows).
    """
    shared = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    for m in module.modules():
        if isinstance(m, torch.nn.Linear) and id(m.weight) not in shared:
            m.weight.data = m.weight.data.t().contiguous().t()


def load_mtp_head(folder: str | Path, target_cfg: ModelConfig, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> MTPHead:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"head folder {str(folder)!r} does not exist")
    cfg = ModelConfig.from_folder(folder)
    if cfg.architecture != "mtp":
        raise CheckpointError(f"{folder}: not an MTP head (architectures must be ['SpecstepMTPHead'])")
    if cfg.hidden_size != target_cfg.hidden_size or cfg.vocab_size != target_cfg.vocab_size:
        raise CheckpointError(
            f"{folder}: head (hidden {cfg.hidden_size}, vocab {cfg.vocab_size}) does not fit the target "
            f"(hidden {target_cfg.hidden_size}, vocab {target_cfg.vocab_size})")
    with torch.device("meta"):
        head = MTPHead(cfg)
    load_state_dict(head, folder, dtype)
    head.rotary.build_tables()
    head = head.to(device).eval()
    if torch.device(device).type == "cpu":
        transpose_linear_storage(head)
    return head
