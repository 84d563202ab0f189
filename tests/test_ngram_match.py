"""N-gram drafts bounded by the length of the match (`ngram_match_ratio`): a short match drafts little, a long one
up to k, and either way speculative greedy output is plain greedy output."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specstep.engine.engine_config import EngineConfig
from specstep.engine.errors import ConfigError
from specstep.engine.proposers.ngram import HostTokens, NgramProposer, match_length, ngram_lookup
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


def test_draft_limits_are_what_the_lookup_would_draft():
    """What n-gram tells the adaptive policy before it decides (`Proposer.draft_limits`): each lane's draft length
    now, at the proposer's ratio (no match: 0)."""
    prop = NgramProposer(torch.device("cpu"), match_ratio=1.0)
    run = [10, 11, 12, 13, 14, 15, 16, 17]
    lanes = [[5, 1, 2, 3, 4, 6, 7, 9, 8, 5], [3] + run + [20, 21, 22, 23, 24, 25] + [4] + run, [1, 2, 3, 4, 5]]
    assert prop.draft_limits(lanes, 4).tolist() == [len(lookup(t, 4, 1.0)) for t in lanes] == [1, 4, 0]
    assert NgramProposer(torch.device("cpu"), match_ratio=0.0).draft_limits(lanes, 3).tolist() == [3, 3, 0]


@pytest.mark.parametrize("overlap", [False, True])
def test_adaptive_ngram_counts_acceptance_per_limit_and_keeps_greedy_output(tiny_target, overlap):
    """With the adaptive policy, n-gram's limits reach the policy (its steps' outcomes are counted per limit), and
    speculative greedy output is plain greedy output, on both stream paths (the overlap path plans plain steps
    chained, without limits, and drafting steps from the host's tokens, with them)."""
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(3, 200, 24)) * 2 + list(rng.integers(3, 200, 6)) for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = run_to_completion(make_core(tiny_target, spec="none"), prompts, params)
    core = make_core(tiny_target, spec="ngram", num_spec_tokens=4, spec_policy="adaptive", overlap=overlap)
    reqs = run_to_completion(core, prompts, params)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in plain]
    by_limit = core.scheduler.policy.by_limit
    assert by_limit and set(by_limit) <= {1, 2, 3, 4} and sum(a.trials for a in by_limit.values()) > 0


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0, 2.0])
def test_a_lookup_at_fewer_drafts_is_a_prefix_of_one_at_more(ratio):
    """The step reuses the lookup `draft_limits` made at k for the k' <= k it drafts: the same tokens as its own
    lookup at k' would give, for every k' and random sequences with repeats."""
    rng = np.random.default_rng(2)
    for _ in range(200):
        tokens = rng.integers(0, 6, int(rng.integers(2, 40))).tolist()
        full = lookup(tokens, 8, ratio)
        for k in range(9):
            assert lookup(tokens, k, ratio) == full[:k], (tokens, k)
    prop = NgramProposer(torch.device("cpu"), match_ratio=ratio)
    lanes = [rng.integers(0, 6, 30).tolist() for _ in range(4)]
    prop.draft_limits(lanes, 8)
    assert prop._lookups(lanes, 3) == [lookup(t, 3, ratio) for t in lanes]


def windowed_lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int, ratio: float) -> list[int]:
    """The lookup by its definition: every earlier window of n tokens (n = max_n down to min_n) against the
    suffix, the most recent match's continuation."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            hit = int(hits[-1])
            draft = tokens[hit + n:hit + n + k]
            if ratio > 0:
                draft = draft[:math.ceil(ratio * match_length(tokens, hit, n, math.ceil(k / ratio)))]
            return draft.tolist()
    return []


def test_the_one_pass_lookup_is_the_windowed_scan():
    """ngram_lookup filters n-gram matches out of (n - 1)-gram ones in one pass; it finds what scanning every
    window for every n finds, on random sequences with many repeats, for any n range, k and ratio."""
    rng = np.random.default_rng(3)
    for i in range(1500):
        dtype = (np.int64, np.int32)[i % 2]
        tokens = rng.integers(0, int(rng.integers(2, 8)), int(rng.integers(0, 50))).astype(dtype)
        k = int(rng.integers(1, 9))
        for min_n, max_n in ((1, 4), (2, 3), (1, 1), (3, 5), (2, 8), (3, 2)):
            for ratio in (0.0, 0.5, 1.0):
                want = windowed_lookup(tokens, k, min_n, max_n, ratio)
                assert ngram_lookup(tokens, k, min_n, max_n, ratio) == want, (tokens.tolist(), k, min_n, max_n)


def test_host_tokens_follow_growing_lists_and_drop_the_oldest():
    """The lookup's int64 copies: each list's copy is the list after every growth (by one token or many, past
    the buffer's room), a list written over is copied afresh, and once a batch's 2 x lanes + 8 are held the least
    recently asked for go."""
    rng = np.random.default_rng(4)
    host = HostTokens()
    lists = [rng.integers(0, 50, int(rng.integers(0, 5))).tolist() for _ in range(3)]
    for _ in range(60):
        for t in lists:
            t += rng.integers(0, 50, int(rng.integers(0, 6))).tolist()
        assert [a.tolist() for a in host.batch(lists, running=3)] == lists
    lists[0][-1] += 1  # written over: not the list the copy was made from
    assert host.array(lists[0]).tolist() == lists[0]
    others = [[i] for i in range(13)]
    for t in others:
        host.array(t)
    assert host.capacity == 2 * 3 + 8 and len(host) == 14
    kept = set(host._arrays)
    assert {id(t) for t in others} <= kept and id(lists[0]) in kept  # lists[0] was asked for after lists[1], [2]
    assert id(lists[1]) not in kept and id(lists[2]) not in kept
    assert host.array(lists[1]).tolist() == lists[1]


def test_a_batch_mixing_kept_and_fresh_lookups_drafts_each_lanes_own():
    """draft_limits' lookups are reused for lanes unchanged since; lanes that grew are looked up afresh, and each
    lane gets its own draft whatever the mix."""
    rng = np.random.default_rng(6)
    prop = NgramProposer(torch.device("cpu"), match_ratio=0.0)
    lanes = [rng.integers(0, 4, 20).tolist() for _ in range(6)]
    prop.draft_limits(lanes, 4)
    for t in lanes[::2]:
        t += rng.integers(0, 4, 3).tolist()
    seqs = [SimpleNamespace(token_ids=t) for t in lanes]
    assert prop.propose_host(seqs, 4) == [lookup(t, 4, 0.0) for t in lanes]
    prop.draft_limits(lanes, 2)  # kept at 2 drafts: a step drafting 4 looks up again
    assert prop.propose_host(seqs, 4) == [lookup(t, 4, 0.0) for t in lanes]


def test_the_proposer_drafts_what_the_lookup_finds_as_lists_grow():
    """Across steps of a growing batch (the proposer's copies extended, its draft_limits lookups reused), every
    draft is the lookup's on the list as it is now."""
    rng = np.random.default_rng(5)
    prop = NgramProposer(torch.device("cpu"), match_ratio=1.0)
    lanes = [rng.integers(0, 5, 12).tolist() for _ in range(4)]
    for step in range(80):
        for t in lanes:
            t += rng.integers(0, 5, int(rng.integers(1, 6))).tolist()
        if step % 2:
            prop.draft_limits(lanes, 4)
        seqs = [SimpleNamespace(token_ids=t) for t in lanes]
        assert prop.propose_host(seqs, 4) == [lookup(t, 4, 1.0) for t in lanes]
