"""Build a model from a folder: parse its config, construct on `meta`, assign the checkpoint's tensors.

With a tensor-parallel group `tp`, each rank builds and loads only its own shard (`engine.parallel.shard`); a
model whose heads do not split over the group fails here with `ParallelError`, before any tensor is read."""

from __future__ import annotations

from pathlib import Path

import torch

from specstep.engine.config import ModelConfig
from specstep.engine.errors import CheckpointError
from specstep.engine.loader import load_state_dict, resolve_dtype
from specstep.engine.model_source import resolve_model
from specstep.engine.models.cpu_linear import plan_linears
from specstep.engine.models.llama import LlamaForCausalLM
from specstep.engine.models.mtp_head import MTPHead
from specstep.engine.parallel.group import SINGLE, TPGroup


def load_model(model: str | Path, device: str | torch.device = "cpu", dtype: str = "auto",
               cpu_linear: str = "auto", tp: TPGroup = SINGLE) -> LlamaForCausalLM:
    """`model`: a Hugging Face-format folder or a GGUF file (converted once, see `engine.gguf_checkpoint`)."""
    folder = resolve_model(model)
    if not folder.is_dir():
        raise CheckpointError(f"model {str(folder)!r} is neither a model folder nor a GGUF file")
    cfg = ModelConfig.from_folder(folder)
    if cfg.architecture == "mtp":
        raise CheckpointError(f"{folder}: is an MTP head, not a language model (use it as --draft with --spec mtp)")
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, tp)
    load_state_dict(model, folder, torch_dtype)
    # Buffers (rotary tables) were built on meta; rebuild them for real on the target device.
    model.rotary.build_tables()
    model = model.to(device).eval().requires_grad_(False)  # serving weights; training heads keep the target frozen
    if device.type == "cpu":
        plan_linears(model, cpu_linear)  # per shape and row count: MKL or prepacked oneDNN (cpu_linear.py)
    return model


def load_mtp_head(folder: str | Path, target_cfg: ModelConfig, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32, cpu_linear: str = "auto", tp: TPGroup = SINGLE) -> MTPHead:
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
        head = MTPHead(cfg, tp)  # the target's group: the head shards with it
    load_state_dict(head, folder, dtype)
    head.rotary.build_tables()
    head = head.to(device).eval()
    if torch.device(device).type == "cpu":
        plan_linears(head, cpu_linear)
    return head
