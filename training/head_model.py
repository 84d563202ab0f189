"""The MTP head being trained: its folder's config.json, a fresh initialisation, and saving its weights."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specstep.engine.config import ModelConfig
from specstep.engine.loader import local_to_hf, save_checkpoint
from specstep.engine.models.mtp_head import MTPHead

INIT_STD = 0.02


def head_config_dict(target_cfg: ModelConfig, intermediate_size: int | None = None) -> dict[str, Any]:
    """The head folder's config.json: a one-layer Llama-style block sized like the target."""
    return {
        "architectures": ["SpecstepMTPHead"],
        "model_type": "specstep_mtp",
        "vocab_size": target_cfg.vocab_size,
        "hidden_size": target_cfg.hidden_size,
        "intermediate_size": int(intermediate_size or target_cfg.intermediate_size),
        "num_hidden_layers": 1,
        "num_attention_heads": target_cfg.num_heads,
        "num_key_value_heads": target_cfg.num_kv_heads,
        "head_dim": target_cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": target_cfg.max_position_embeddings,
        "rms_norm_eps": target_cfg.rms_norm_eps,
        "rope_theta": target_cfg.rope_theta,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def build_head(config: dict[str, Any]) -> MTPHead:
    """A fresh fp32 head (call `torch.manual_seed` first). Norm gains start at 1, residual outputs scaled down."""
    head = MTPHead(ModelConfig.from_dict(config))
    for name, module in head.named_modules():
        if isinstance(module, nn.Linear):
            std = INIT_STD / math.sqrt(2) if name.endswith(("o_proj", "down_proj")) else INIT_STD
            nn.init.normal_(module.weight, std=std)
    return head


def save_head(head: MTPHead, config: dict[str, Any], folder: Path, dtype: torch.dtype = torch.float32) -> None:
    """Head weights only (hidden_norm, embed_norm, fc, layers.0.*, norm); embedding and lm_head stay the target's."""
    state = {k: v.to(dtype) for k, v in head.state_dict().items()}
    save_checkpoint(local_to_hf(state, head.cfg), {**config, "torch_dtype": str(dtype).replace("torch.", "")},
                    folder)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and p.suffix == ".safetensors")
