"""Greedy generation through the whole engine (scheduler, paging, prefill, decode) is token-identical to
transformers' `generate` on the same checkpoint, for a batch of prompts of different lengths."""

from __future__ import annotations

import random

import pytest
import torch

from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler.core.request import FinishReason, Request
from tests.fixtures_models import fragment, hf_model, is_fragmented
from tests.helpers import make_checkpoint, make_core, run_to_completion

NEW_TOKENS = 64
PROMPT_LENS = [1, 4, 15, 16, 17, 29]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # No EOS at all, so neither side can stop early; a wider init than the default keeps argmax gaps far from
    # float32 noise (and makes the continuations less repetitive).
    return make_checkpoint(tmp_path_factory.mktemp("greedy"), seed=7, eos_token_id=None, bos_token_id=None,
                           initializer_range=0.06)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(320) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_outputs(model_dir, prompts):
    hf = hf_model(model_dir)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                              pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    assert all(len(o) == NEW_TOKENS for o in outs)
    assert len({tuple(o) for o in outs}) == len(outs)
    return outs


def generate(core, prompts, arrive_late: int = 0, check_fragmented: bool = False) -> list[list[int]]:
    """Run to completion, checking page integrity after every step; the last `arrive_late` requests join while
    the others are already decoding (continuous batching)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    reqs = [Request(str(i), list(p), params, seed=i) for i, p in enumerate(prompts)]
    early = len(reqs) - arrive_late
    for r in reqs[:early]:
        core.add_request(r)
    steps = 0
    while core.has_unfinished() or steps == 0:
        core.step()
        core.check_integrity()
        steps += 1
        if steps == 1 and check_fragmented:
            assert is_fragmented(core.page_tables()), core.page_tables()
        if steps == 5:
            for r in reqs[early:]:
                core.add_request(r)
    core.check_integrity()
    assert core.allocator.num_free == core.allocator.num_usable
    assert all(r.finish_reason.value == "length" for r in reqs)
    return [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("fragmented", [False, True], ids=["contiguous", "fragmented"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_batch_matches_transformers_generate(model_dir, prompts, hf_outputs, page_size, fragmented):
    core = make_core(model_dir, page_size=page_size)
    if fragmented:
        fragment(core.allocator, seed=page_size)
    outs = generate(core, prompts, check_fragmented=fragmented)
    for i, (ours, ref) in enumerate(zip(outs, hf_outputs)):
        assert ours == ref, f"prompt {i} (len {len(prompts[i])}): first difference at token " \
                            f"{next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)}"


def test_continuous_batching_and_small_prefill_budget(model_dir, prompts, hf_outputs):
    """Requests admitted in several prefill batches and joining mid-decode still match."""
    core = make_core(model_dir, page_size=4, max_prefill_tokens=20)
    fragment(core.allocator, seed=1)
    assert generate(core, prompts, arrive_late=2) == hf_outputs


def test_preempted_requests_still_match(model_dir, prompts, hf_outputs):
    """A KV cache smaller than the batch's need: requests are preempted and recomputed, output unchanged."""
    core = make_core(model_dir, page_size=8, num_pages=40)
    assert generate(core, prompts) == hf_outputs
    assert core.num_preemptions > 0


@pytest.mark.parametrize("spec", ["none", "draft_model"])
def test_a_request_that_fills_the_kv_cache_finishes_with_length(tiny_target, tiny_draft, spec):
    """max_tokens beyond what the whole KV cache holds: once the request is alone and cannot grow, it finishes
    (length) with every token it could hold; the engine keeps serving and leaks no page. The other request is
    preempted on the way and still completes."""
    draft = str(tiny_draft) if spec == "draft_model" else None
    core = make_core(tiny_target, page_size=4, num_pages=17, spec=spec, draft=draft, num_spec_tokens=3,
                     spec_policy="fixed")  # 16 usable pages: 64 tokens of KV
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reqs = run_to_completion(core, [[5, 9, 11, 3, 7] * 2, [4, 2, 8]], [long, short])
    assert reqs[0].finish_reason == FinishReason.LENGTH and 48 <= len(reqs[0].token_ids) <= 64
    assert reqs[1].finish_reason == FinishReason.LENGTH and len(reqs[1].output_token_ids) == 8
    after = run_to_completion(core, [[4, 2, 8]], short)  # still serving
    assert after[0].output_token_ids == reqs[1].output_token_ids
