"""`specstep train-head` on a tiny random target: trains, saves a loadable head folder, the loss goes down, and
the real speculative engine with the trained head is token-identical to plain greedy decoding."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from specstep.engine.config import ModelConfig
from specstep.engine.model_loader import load_model, load_mtp_head
from specstep.training.head import train_head_folder
from specstep.training.head_data import PagedRunner, precompute
from specstep.training.head_model import build_head, head_config_dict
from specstep.training.head_objective import head_losses
from specstep.training.head_settings import HeadSettings
from tests.helpers import make_checkpoint


def _stream(target: Path) -> tuple[np.ndarray, np.ndarray]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    encode = lambda name: np.asarray(tok.encode((stdlib / name).read_text()).ids, dtype=np.int32)  # noqa: E731
    return encode("textwrap.py"), encode("shlex.py")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("head")
    target = make_checkpoint(root / "target", tokenizer=True)
    train, heldout = _stream(target)
    settings = HeadSettings(minutes=5.0, max_steps=40, seq_len=64, batch_size=4, lr=3e-3, warmup_steps=5,
                            chunk_windows=16, evals=1, periodic_val_windows=4, log_every_s=1e9)
    prompts = [heldout[i : i + 12].tolist() for i in (0, 50, 100)]
    quality = train_head_folder(target, root / "head", train, heldout, settings, intermediate_size=96, seed=0,
                                val_windows=4, engine_prompts=prompts, engine_ks=(1, 3), engine_new_tokens=12,
                                sampled_acceptance=False, draft_vocab=200, save_dtype="float16")
    return target, root / "head", quality


def test_head_folder_loads_and_holds_only_head_weights(trained):
    target, head_dir, quality = trained
    from safetensors import safe_open

    config = json.loads((head_dir / "config.json").read_text())
    assert config["architectures"] == ["SpecstepMTPHead"] and config["model_type"] == "specstep_mtp"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    head = load_mtp_head(head_dir, ModelConfig.from_folder(target))
    assert head.cfg.intermediate_size == 96
    with safe_open(str(head_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert not any("embed_tokens" in n or "lm_head" in n for n in names), names
    assert {"model.fc.weight", "model.hidden_norm.weight", "model.embed_norm.weight", "model.norm.weight"} <= names
    saved = json.loads((head_dir / "quality.json").read_text())
    assert saved["training"]["steps"] == 40
    assert config["torch_dtype"] == "float16" and saved["draft_vocab"]["size"] == 200
    assert len(json.loads((head_dir / "draft_vocab.json").read_text())["token_ids"]) == 200
    marker = json.loads((head_dir / "specstep_target.json").read_text())
    assert marker["spec"] == "mtp" and marker["fingerprint"]
    assert 0.0 <= saved["validation_inference_path"]["agreement"] <= 1.0


def test_loss_decreases(trained):
    _, _, quality = trained
    tr = quality["training"]
    assert tr["train_loss_last10"] < 0.8 * tr["train_loss_first10"], tr


def test_speculative_decoding_with_trained_head_is_lossless(trained):
    _, _, quality = trained
    greedy = quality["engine"]["greedy"]
    for k in (1, 3):
        assert greedy[f"k{k}"]["identical_to_plain"], greedy
        assert greedy[f"k{k}"]["drafted"] > 0


def test_validation_matches_training_objective(trained):
    """The inference-path validation and the dense training path agree on the same windows (fp32 features)."""
    target_dir, head_dir, _ = trained
    target = load_model(target_dir, "cpu", "float32")
    head = load_mtp_head(head_dir, target.cfg)
    _, heldout = _stream(target_dir)
    windows = torch.from_numpy(np.stack([heldout[i : i + 32] for i in (0, 40)]).astype(np.int64))
    s = HeadSettings(seq_len=32, topk=target.cfg.vocab_size)  # full distribution: the KLs must coincide
    runner = PagedRunner(target, 2, 32, head)
    feats = precompute(runner, windows, s.topk, 2)
    feats.hidden = runner.target_hidden(windows)  # fp32 rather than the cached fp16, for the comparison
    with torch.no_grad():
        dense = head_losses(head, target, feats, s)
    from specstep.training.head_eval import validate

    v = validate(runner, windows, s)
    assert abs(float(dense["kl"]) - v["kl"]) < 1e-2 * max(0.1, v["kl"])
    assert abs(float(dense["hidden"]) - v["hidden_smooth_l1"]) < 2e-3


def test_head_config_sized_from_target(tmp_path):
    target = make_checkpoint(tmp_path / "t")
    cfg = ModelConfig.from_folder(target)
    config = head_config_dict(cfg)
    assert config["intermediate_size"] == cfg.intermediate_size
    head = build_head(head_config_dict(cfg, 32))
    assert head.layers[0].mlp.inter == 32
