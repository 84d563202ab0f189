"""N-gram drafts bounded by the length of the match (`ngram_match_ratio`): a short match drafts little, a long one
up to k, and either way speculative greedy output is plain greedy output."""

from __future__ import annotations

import numpy as np
import pytest

from specstep.engine.engine_config import EngineConfig
from specstep.engine.errors import ConfigError
from specstep.engine.proposers.ngram import match_length, ngram_lookup
from specstep.engine.sampling_params import SamplingParams
from tests.helpers import make_core, run_to_completion


def lookup(tokens: list[int], k: int, ratio: float) -> list[int]:
    return ngram_lookup(np.array(tokens, dtype=np.int64), k, 1, 4, ratio)


def test_a_one_token_match_drafts_one_token():
    tokens = [5, 1, 2, 3, 4, 6, 7, 9, 8, 5]  # only "5" recurs: a 1-token match, followed by 1, 2, 3, 4
    assert lookup(tokens, 4, 0.0) == [1, 2, 3, 4]
    assert lookup(tokens, 4, 1.0) == [1]
    assert lookup(tokens, 4, 2.0) == [1, 2]
    assert lookup(tokens, 4, 0.5) == [1]  # ceil: a match always drafts something


def test_a_match_longer_than_max_n_drafts_up_to_k():
    run = [10, 11, 12, 13, 14, 15, 16, 17]
    tokens = [3] + run + [20, 21, 22, 23, 24, 25, 26, 27] + [4] + run
    # the suffix 14..17 (max_n = 4) recurs; walking back, the whole run of 8 and no further
    assert match_length(np.array(tokens), 5, 4, 100) == 8
    assert match_length(np.array(tokens), 5, 4, 6) == 6  # counted up to `most`
    assert lookup(tokens, 8, 1.0) == [20, 21, 22, 23, 24, 25, 26, 27]
    assert lookup(tokens, 8, 0.5) == [20, 21, 22, 23]
    assert lookup(tokens, 16, 1.0) == [20, 21, 22, 23, 24, 25, 26, 27]  # k = 16, but a match of 8 drafts 8


def test_a_match_at_the_start_counts_only_what_exists():
    tokens = [1, 2, 9, 1, 2]  # the earlier "1 2" starts the sequence: nothing before it to compare
    assert match_length(np.array(tokens), 0, 2, 8) == 2
    assert lookup(tokens, 4, 1.0) == [9, 1]


@pytest.mark.parametrize("ratio", [-0.5, float("inf"), float("nan")])
def test_a_negative_or_infinite_ratio_is_a_config_error(ratio):
    with pytest.raises(ConfigError, match="--ngram-match-ratio must be finite, >= 0"):
        EngineConfig(ngram_match_ratio=ratio)


def test_bounded_drafts_keep_greedy_output_and_draft_less(tiny_target):
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 200, 24)) * 2 + list(rng.integers(3, 200, 6)) for _ in range(3)]
    prompts.append([int(t) for t in rng.integers(3, 200, 40)])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = run_to_completion(make_core(tiny_target, spec="none"), prompts, params)
    runs = {ratio: run_to_completion(make_core(tiny_target, spec="ngram", num_spec_tokens=8,
                                               ngram_match_ratio=ratio), prompts, params)
            for ratio in (0.0, 1.0)}
    for ratio, reqs in runs.items():
        assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in plain], ratio
    drafted = {ratio: sum(r.stats.drafted for r in reqs) for ratio, reqs in runs.items()}
    assert 0 < drafted[1.0] < drafted[0.0]
