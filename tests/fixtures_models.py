"""Checkpoint builders for tests beyond `tests.helpers.make_checkpoint`: random MTP heads, drafts derived from a
target (itself, perturbed, or with its `lm_head` rows permuted so its argmax is never the target's), and
fragmented page layouts. Everything is written to a folder the caller owns; nothing is global."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specstep.engine.config import ModelConfig
from specstep.engine.loader import local_to_hf, save_checkpoint
from specstep.engine.models.mtp_head import MTPHead
from tests.helpers import make_checkpoint

# head_dim values FlashInfer ships prebuilt kernels for (flashinfer-cubin / flashinfer-jit-cache). Any other
# head_dim is compiled on first use, which takes minutes: longer than scripts/gpu_check.sh's test stage.
FLASHINFER_HEAD_DIMS = (64, 128, 256)
# A tiny checkpoint shape with head_dim 64 (hidden 256 over 4 heads, 2 KV heads): what GPU tests that run the real
# FlashInfer use. make_checkpoint's default (hidden 64, 4 heads) has head_dim 16.
FLASHINFER_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def hf_model(folder: Path, dtype: torch.dtype = torch.float32):
    """transformers' own implementation of a checkpoint (the reference)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def make_mtp_head(folder: Path, target: Path, seed: int = 0, std: float = 0.1) -> Path:
    """A random-init MTP head for `target`, saved as a head folder (`architectures: ["SpecstepMTPHead"]`)."""
    raw = json.loads((target / "config.json").read_text())
    tcfg = ModelConfig.from_folder(target)
    config = {
        "architectures": ["SpecstepMTPHead"],
        "vocab_size": tcfg.vocab_size,
        "hidden_size": tcfg.hidden_size,
        "intermediate_size": tcfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": tcfg.num_heads,
        "num_key_value_heads": tcfg.num_kv_heads,
        "head_dim": tcfg.head_dim,
        "rms_norm_eps": tcfg.rms_norm_eps,
        "rope_theta": tcfg.rope_theta,
        "max_position_embeddings": tcfg.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if raw.get("rope_parameters", {}).get("rope_type", "default") != "default":
        config["rope_parameters"] = raw["rope_parameters"]
    cfg = ModelConfig.from_dict(config)
    gen = torch.Generator().manual_seed(seed)
    head = MTPHead(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    save_checkpoint(local_to_hf(head.state_dict(), cfg), config, folder)
    return folder


def make_flashinfer_checkpoint(folder: Path, seed: int = 0, **overrides) -> Path:
    """A random-init Llama of `FLASHINFER_SHAPE` (head_dim 64: FlashInfer's prebuilt kernels cover it)."""
    return make_checkpoint(folder, seed=seed, **{**FLASHINFER_SHAPE, **overrides})


def _copy_with(folder: Path, source: Path, edit) -> Path:
    """Copy a single-file checkpoint, applying `edit(tensors) -> tensors` to its weights."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, folder / f.name)
    tensors = load_file(str(source / "model.safetensors"))
    save_file(edit(tensors), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def make_permuted_draft(folder: Path, target: Path) -> Path:
    """The target with `lm_head` rows rotated by one: draft logit[i] = target logit[i + 1], so the draft's argmax is
    always (target argmax - 1) mod V and never the target's own. Needs an untied target."""

    def edit(t):
        assert "lm_head.weight" in t, "needs an untied checkpoint"
        t["lm_head.weight"] = torch.roll(t["lm_head.weight"], shifts=-1, dims=0).contiguous()
        return t

    return _copy_with(folder, target, edit)


def make_perturbed_copy(folder: Path, target: Path, rel_noise: float, seed: int = 0) -> Path:
    """The target with every weight multiplied by (1 + rel_noise * N(0, 1)): a good but imperfect draft."""
    gen = torch.Generator().manual_seed(seed)

    def edit(t):
        return {k: (v * (1 + rel_noise * torch.randn(v.shape, generator=gen))).contiguous() for k, v in t.items()}

    return _copy_with(folder, target, edit)


def fragment(allocator, seed: int = 0) -> None:
    """Take every free page and give them back in a shuffled order, so later allocations are non-contiguous."""
    pages = allocator.allocate(allocator.num_free)
    random.Random(seed).shuffle(pages)
    allocator.free(pages)


def is_fragmented(tables: list[list[int]]) -> bool:
    return any(b != a + 1 for t in tables for a, b in zip(t, t[1:]))


def scattered_page_tables(lengths: list[int], page_size: int, num_pages: int, seed: int = 0) -> list[list[int]]:
    """Disjoint page tables drawn from a shuffled pool (never the dummy page 0)."""
    pool = list(range(1, num_pages))
    random.Random(seed).shuffle(pool)
    tables = []
    for n in lengths:
        need = -(-n // page_size)
        tables.append(pool[:need])
        del pool[:need]
    return tables
