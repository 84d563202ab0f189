"""Model definitions for the defaults: Hugging Face Llama config dicts, initialisation, saving.

The config dicts are written verbatim as `config.json`, so they must satisfy both our `ModelConfig.from_dict`
and `transformers.LlamaConfig` (the checkpoints double as a side-by-side reference for transformers).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specstep.engine.config import ModelConfig
from specstep.engine.loader import local_to_hf, save_checkpoint
from specstep.engine.models.llama import LlamaForCausalLM
from specstep.training.data import EOS_ID, EOS_TOKEN

INIT_STD = 0.02  # GPT-2/Llama-style; with tied embeddings it keeps the initial logits near zero


@dataclass(frozen=True, slots=True)
class Size:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int

    def describe(self) -> str:
        return (f"{self.layers} layer(s), hidden {self.hidden}, intermediate {self.intermediate}, "
                f"{self.heads} heads / {self.kv_heads} kv heads")


# Target: 6 layers is about what one CPU thread can train to a useful loss in ~30 minutes (~1k tokens/s);
# deeper would also make each draft step relatively cheaper, but would see too few tokens.
TARGET_SIZE = Size(layers=6, hidden=256, intermediate=688, heads=4, kv_heads=2)
# Draft: one layer of the same width, so it can be warm-started from the target's embeddings (which are also
# its tied output head) and first layer; its cost is then dominated by that shared-size lm_head.
DRAFT_SIZE = Size(layers=1, hidden=256, intermediate=688, heads=4, kv_heads=2)


def llama_config_dict(size: Size, vocab_size: int, max_positions: int = 2048) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": size.hidden,
        "intermediate_size": size.intermediate,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "head_dim": size.hidden // size.heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": INIT_STD,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def build_model(config: dict[str, Any]) -> LlamaForCausalLM:
    """A freshly initialised fp32 model (call `torch.manual_seed` first for reproducibility)."""
    cfg = ModelConfig.from_dict(config)
    model = LlamaForCausalLM(cfg)
    # PyTorch's default N(0, 1) embedding would give logits of std ~sqrt(hidden) through the tied head.
    # Residual-branch outputs are scaled down by depth (GPT-2) so the residual stream starts near unit scale.
    residual_std = INIT_STD / math.sqrt(2 * cfg.num_layers)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            std = residual_std if name.endswith(("o_proj", "down_proj")) else INIT_STD
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=INIT_STD)
    return model


def warm_start_draft(draft: LlamaForCausalLM, target: LlamaForCausalLM) -> list[str]:
    """Copy every draft tensor whose name and shape match the target's (embeddings, layer 0, final norm).

    The embedding doubles as the tied output head, so the draft starts out predicting in the target's token
    space; distillation from there converges much faster than from scratch in a ~10 minute budget.
    """
    source = target.state_dict()
    copied: list[str] = []
    with torch.no_grad():
        for name, tensor in draft.state_dict().items():
            if name in source and source[name].shape == tensor.shape and name != "lm_head.weight":
                tensor.copy_(source[name])
                copied.append(name)
    return copied


def count_params(model: nn.Module) -> int:
    # `parameters()` yields a tied tensor once, so the shared embedding/lm_head counts once.
    return sum(p.numel() for p in model.parameters())


def save_model_folder(
    model: LlamaForCausalLM, config: dict[str, Any], folder: Path, tokenizer_json: Path
) -> None:
    """A self-contained Hugging Face folder: weights, config, generation config, tokenizer."""
    save_checkpoint(local_to_hf(model.state_dict(), model.cfg), config, folder)
    generation = {"bos_token_id": EOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    shutil.copyfile(tokenizer_json, folder / "tokenizer.json")
    # Lets `transformers.AutoTokenizer.from_pretrained(folder)` work too, for side-by-side benchmarks.
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS_TOKEN,
                  "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "unk_token": None,
                  "add_prefix_space": False, "model_max_length": config["max_position_embeddings"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
