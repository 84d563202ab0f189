"""Reduced draft vocabularies: the drafter's logits are its full logits on the subset and -inf elsewhere, greedy
speculation stays token-identical to plain decoding (distributions: tests/test_spec_sampling.py), and the files
that carry a subset are validated."""

from __future__ import annotations

import json

import pytest
import torch

from specstep.engine.errors import CheckpointError
from specstep.engine.proposers.draft_vocab import FILE, ReducedLMHead, read_draft_vocab, write_draft_vocab
from specstep.engine.sampling_params import SamplingParams
from tests.fixtures_models import make_mtp_head
from tests.helpers import make_checkpoint, make_core, run_to_completion

PROMPTS = [[5, 17, 99, 3, 250, 41, 5, 17, 99], [7, 8, 9, 10, 11, 12, 13, 7, 8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_reduced_head_is_the_full_head_restricted_to_its_tokens():
    torch.manual_seed(0)
    weight, hidden = torch.randn(50, 8), torch.randn(3, 8)
    ids = torch.tensor([7, 0, 42, 3])
    logits = ReducedLMHead(weight, ids, 50)(hidden)
    full = hidden @ weight.t()
    assert logits.shape == (3, 50)
    assert torch.allclose(logits[:, ids], full[:, ids])
    outside = torch.ones(50, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(logits[:, outside]).all()
    assert set(logits.argmax(-1).tolist()) <= set(ids.tolist())


def test_write_keeps_the_most_frequent_first_and_the_forced_ones(tmp_path):
    counts = torch.tensor([5.0, 0.0, 9.0, 1.0, 7.0])
    write_draft_vocab(tmp_path, counts, 3, always=(1,))
    assert read_draft_vocab(tmp_path, 5).tolist() == [1, 2, 4]
    assert read_draft_vocab(tmp_path, 5, limit=2).tolist() == [1, 2]


@pytest.mark.parametrize("content", ['{"token_ids": [1, 2, 99]}', '{"token_ids": [1, 1]}', '{"ids": []}', "nope"])
def test_bad_vocabulary_files_are_typed_errors(tmp_path, content):
    (tmp_path / FILE).write_text(content)
    with pytest.raises(CheckpointError, match=FILE):
        read_draft_vocab(tmp_path, 50)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("t"), seed=0)


@pytest.mark.parametrize("spec", ["mtp", "draft_model"])
def test_greedy_speculation_with_a_reduced_vocabulary_equals_plain(spec, target, tmp_path):
    if spec == "mtp":
        draft = make_mtp_head(tmp_path / "head", target, std=0.3)
    else:  # the target itself as draft: its greedy tokens would always be accepted with the full vocabulary
        draft = target.parent / "self-draft"
        if not draft.exists():
            import shutil

            shutil.copytree(target, draft)
    counts = torch.arange(320, 0, -1).float()  # keep tokens 0..63
    write_draft_vocab(draft, counts, 64)
    plain = run_to_completion(make_core(target), PROMPTS, GREEDY)
    reqs = run_to_completion(make_core(target, spec=spec, draft=str(draft), spec_policy="fixed"), PROMPTS, GREEDY)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in plain]
    assert sum(r.stats.drafted for r in reqs) > 0
    full = run_to_completion(make_core(target, spec=spec, draft=str(draft), spec_policy="fixed", draft_vocab=0),
                             PROMPTS, GREEDY)
    assert [r.output_token_ids for r in full] == [r.output_token_ids for r in plain]
    if spec == "draft_model":  # drafts outside tokens 0..63 are impossible with the subset: fewer accepted
        emitted = {t for r in plain for t in r.output_token_ids}
        if emitted - set(range(64)):
            assert sum(r.stats.accepted for r in reqs) < sum(r.stats.accepted for r in full)


def test_a_limit_without_a_vocabulary_file_is_an_error(target, tmp_path):
    head = make_mtp_head(tmp_path / "head", target)
    with pytest.raises(CheckpointError, match="no draft_vocab.json"):
        make_core(target, spec="mtp", draft=str(head), draft_vocab=32)


def test_vocab_file_records_the_vocabulary_size(tmp_path):
    write_draft_vocab(tmp_path, torch.ones(10), 4)
    assert json.loads((tmp_path / FILE).read_text())["vocab_size"] == 10
