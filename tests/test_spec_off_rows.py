"""A request that drafts nothing inside a speculative batch samples exactly as plain decoding does."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from scheduler.request import Request
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
