"""Dropping the proposer's refill while nobody drafts (and its prefill while speculation is off), and catching up
when drafting resumes: the output stays token-identical to plain decoding (greedy) and the proposer's carried
state after a catch-up equals that of a run that refilled every step, for the MTP head (from the target hidden
states it kept) and the draft model."""

from __future__ import annotations

import pytest
import torch

import specstep.engine.proposers.mtp as mtp
from specstep.engine.sampling_params import SamplingParams
from tests.fixtures_models import make_mtp_head
from tests.helpers import ScriptedPolicy, make_core, run_to_completion


def run(core, prompts, params, policy):
    core.policy = policy
    carried = []
    orig = core._complete

    def complete(inf):
        out = orig(inf)
        if inf.plan.decision.refill:
            carried.append(core.engine.proposer.carried_logits[:len(prompts)].clone())
        return out
    core._complete = complete
    return run_to_completion(core, prompts, params), carried


@pytest.fixture(scope="module")
def head(tiny_target, tmp_path_factory):
    return make_mtp_head(tmp_path_factory.mktemp("head"), tiny_target)


@pytest.mark.parametrize("prefill", [True, False], ids=["prefilled", "prompt-skipped"])
@pytest.mark.parametrize("spec", ["mtp", "draft_model"])
def test_catch_up_equals_refilling_every_step(spec, prefill, tiny_target, tiny_draft, head):
    draft = head if spec == "mtp" else tiny_draft
    prompts = [list(range(5, 30)), [7, 3, 9, 12]]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    pattern = [True, True, False, False, False, True, False, True, False, False, False, False, False]

    def core():
        return make_core(tiny_target, spec=spec, draft=str(draft), num_spec_tokens=2, overlap=False)
    plain = run_to_completion(make_core(tiny_target), prompts, params)
    dropped, c_dropped = run(core(), prompts, params, ScriptedPolicy(2, pattern, off_refill=False, prefill=prefill))
    kept, c_kept = run(core(), prompts, params, ScriptedPolicy(2, pattern, off_refill=True))
    for a, b, p in zip(dropped, kept, plain):
        assert a.output_token_ids == b.output_token_ids == p.output_token_ids
        assert a.stats.accepted == b.stats.accepted and a.stats.drafted == b.stats.drafted
    # Compare the carried logits at the steps both runs refilled (the drafting ones, in the same order).
    on_kept = [c for c, on in zip(c_kept, (pattern * 10)) if on]
    assert len(c_dropped) == len(on_kept) > 3
    for x, y in zip(c_dropped, on_kept):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_mtp_gap_longer_than_its_history_stays_lossless(tiny_target, head, monkeypatch):
    """Hidden states older than the ring are gone (a hole in the head's KV): drafts may get worse, the output
    does not change."""
    monkeypatch.setattr(mtp, "HISTORY", 4)
    prompts = [list(range(5, 30))]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain = run_to_completion(make_core(tiny_target), prompts, params)
    core = make_core(tiny_target, spec="mtp", draft=str(head), num_spec_tokens=2, overlap=False)
    out, _ = run(core, prompts, params, ScriptedPolicy(2, [True] + [False] * 9, off_refill=False))
    assert out[0].output_token_ids == plain[0].output_token_ids
    assert out[0].stats.drafted > 0
