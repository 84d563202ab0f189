"""A request that drafts nothing inside a speculative batch samples exactly as plain decoding does."""

from __future__ import annotations

from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler.core.request import Request
from tests.helpers import make_core


def test_request_with_speculation_off_matches_plain_sampling(tiny_target):
    prompts = [[5, 9, 11, 3, 7], [4, 2, 8, 8]]
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=24, ignore_eos=True)

    def run(core, overrides):
        reqs = [Request(str(i), p, params, seed=77 + i, num_spec_tokens=o) for i, (p, o) in
                enumerate(zip(prompts, overrides))]
        for r in reqs:
            core.add_request(r)
        while core.has_unfinished():
            core.step()
        core.check_integrity()
        return reqs

    plain = run(make_core(tiny_target), [None, None])
    spec = run(make_core(tiny_target, spec="draft_model", draft=str(tiny_target), num_spec_tokens=3,
                         spec_policy="fixed"), [3, 0])
    assert spec[1].stats.drafted == 0 and spec[0].stats.drafted > 0
    assert spec[1].output_token_ids == plain[1].output_token_ids


def test_requests_drafting_fewer_than_the_batch_k_stay_within_their_pages(tiny_target, tiny_draft):
    """The longest request is about to finish (it may draft 1 token) while a short one drafts k: the draft loop
    must not read or write past the long request's reserved pages (page size 1: no slack)."""
    prompts = [list(range(3, 40)), [5, 9]]
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
    from tests.helpers import run_to_completion

    plain = run_to_completion(make_core(tiny_target, page_size=1), prompts, params)
    for spec, draft in (("draft_model", tiny_target), ("draft_model", tiny_draft)):
        core = make_core(tiny_target, page_size=1, spec=spec, draft=str(draft), num_spec_tokens=4,
                         spec_policy="fixed", overlap=False)
        out = run_to_completion(core, prompts, params)
        assert [r.output_token_ids for r in out] == [r.output_token_ids for r in plain]
