"""The adaptive speculation policy on synthetic measurements (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest

from specstep.scheduler.spec.costs import BUCKETS, bucket
from specstep.scheduler.spec.decision import RequestAcceptance
from specstep.scheduler.spec.policy import AdaptivePolicy, PolicyConfig, expected_tokens


def policy_with_costs(cost, batch: int, k_max: int = 6, candidates=None, plain_cost=None, **kw) -> AdaptivePolicy:
    """A policy whose cost table is filled with cost(k) for the batch's bucket (past exploration)."""
    pol = AdaptivePolicy(PolicyConfig(kind="adaptive", k_max=k_max, candidates=candidates, **kw))
    for k in pol.cfg.ks:
        for _ in range(pol.cfg.plain_samples if k == 0 else pol.cfg.explore_samples):
            nd = np.full(batch, k)
            if k == 0:
                pol.observe_step(batch, nd, False, plain_cost if plain_cost is not None else cost(0))
            else:
                pol.observe_step(batch, nd, True, cost(k))
    return pol


def requests_with_alpha(alphas: list[float], steps: int = 30, k: int = 4, seed: int = 0) -> list[RequestAcceptance]:
    """Acceptance trackers fed with `steps` simulated chains of k drafts at the given per-position acceptance."""
    rng = np.random.default_rng(seed)
    accs = []
    for a in alphas:
        acc = RequestAcceptance()
        for _ in range(steps):
            n = 0
            while n < k and rng.random() < a:
                n += 1
            acc.update(k, n, 0.7)
        accs.append(acc)
    return accs


def choose(pol, accs, room=100):
    return pol.choose(accs, [None] * len(accs), np.full(len(accs), room))


def test_expected_tokens_is_the_chain_sum():
    assert expected_tokens(np.array([0.5]), 3)[0] == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(np.array([0.0]), 5)[0] == pytest.approx(1.0)
    assert expected_tokens(np.array([1.0]), 4)[0] == pytest.approx(5.0)


def test_high_acceptance_and_cheap_draft_choose_large_k():
    pol = policy_with_costs(lambda k: 1.0 + 0.05 * k, batch=1)
    d = choose(pol, requests_with_alpha([0.95]))
    assert d.k == 6 and d.num_draft.tolist() == [6]


def test_collapsed_request_stops_speculating_alone():
    pol = policy_with_costs(lambda k: 1.0 + 0.1 * k, batch=4)
    d = choose(pol, requests_with_alpha([0.9, 0.9, 0.0, 0.9]))
    assert d.k > 0
    assert d.num_draft[2] == 0
    assert all(d.num_draft[i] == d.k for i in (0, 1, 3))


def test_expensive_draft_at_large_batch_turns_speculation_off():
    pol = policy_with_costs(lambda k: 1.0 + 1.0 * k, batch=32)
    d = choose(pol, requests_with_alpha([0.6] * 32))
    assert d.k == 0 and not d.num_draft.any()


def test_only_captured_k_values_are_chosen():
    pol = policy_with_costs(lambda k: 1.0 + 0.05 * k, batch=8, candidates=(2, 4))
    for alpha in (0.2, 0.5, 0.7, 0.95):
        d = choose(pol, requests_with_alpha([alpha] * 8))
        assert d.k in (0, 2, 4)
        assert set(d.num_draft.tolist()) <= {0, 2, 4}


def test_fixed_override_is_respected():
    pol = policy_with_costs(lambda k: 1.0 + 1.0 * k, batch=2)
    accs = requests_with_alpha([0.0, 0.0])
    d = pol.choose(accs, [3, None], np.array([100, 100]))
    assert d.num_draft.tolist() == [3, 0]


def test_room_caps_drafts():
    pol = policy_with_costs(lambda k: 1.0 + 0.05 * k, batch=2)
    d = pol.choose(requests_with_alpha([0.95, 0.95]), [None, None], np.array([2, 0]))
    assert d.num_draft.tolist() == [2, 0]


def test_refill_dropped_when_nobody_speculates():
    """"Off" is plain decoding: no refill, costed as the plain steps measured without it."""
    pol = policy_with_costs(lambda k: 1.3 + 0.3 * k, batch=4, plain_cost=1.0)
    d = choose(pol, requests_with_alpha([0.0] * 4))
    assert d.k == 0 and not d.refill and d.expected_cost == pytest.approx(1.0)


def test_collapsed_request_is_probed_again():
    pol = policy_with_costs(lambda k: 1.0 + 0.05 * k, batch=2, probe_every=5)
    accs = requests_with_alpha([0.95, 0.0])
    probed = False
    for _ in range(12):
        d = choose(pol, accs)
        for acc, nd in zip(accs, d.num_draft):
            acc.update(int(nd), 0 if acc is accs[1] else int(nd), 0.7)
        probed |= bool(d.num_draft[1] > 0)
    assert probed


def test_hysteresis_on_a_noisy_acceptance_series():
    """Acceptance hovering around the break-even point must not flip k every step."""
    pol = policy_with_costs(lambda k: 1.0 + 0.25 * k, batch=1, k_max=4)
    rng = np.random.default_rng(1)
    acc = RequestAcceptance()
    ks = []
    for _ in range(200):
        d = choose(pol, [acc])
        ks.append(d.k)
        k = max(d.k, 1)
        n = 0
        while n < k and rng.random() < 0.45:
            n += 1
        acc.update(k, n, 0.7)
    switches = sum(a != b for a, b in zip(ks, ks[1:]))
    assert switches < 40, f"k flapped {switches} times in 200 steps"


def test_exploration_measures_each_candidate_first():
    pol = AdaptivePolicy(PolicyConfig(kind="adaptive", k_max=2))
    seen = []
    for _ in range(pol.cfg.plain_samples + 2 * pol.cfg.explore_samples):
        d = choose(pol, requests_with_alpha([0.5]))
        assert d.explored
        seen.append(d.k)
        pol.observe_step(1, d.num_draft, d.refill, 1.0 + d.k)
    assert sorted(set(seen)) == [0, 1, 2]
    assert not choose(pol, requests_with_alpha([0.5])).explored


def test_exploration_keeps_fixed_k_requests_drafting_and_ends():
    """A request with a fixed k drafts in every step, exploration measures only what can run next to it (and
    ends), and every cost lands under the k the step really drafted."""
    pol = AdaptivePolicy(PolicyConfig(kind="adaptive", k_max=4))
    accs = requests_with_alpha([0.5, 0.9])
    explored = 0
    for _ in range(30):
        d = pol.choose(accs, [3, None], np.full(2, 100))
        assert d.num_draft[0] == 3 and d.refill
        explored += d.explored
        pol.observe_step(2, d.num_draft, d.refill, 1.0 + d.k)
    assert explored <= 4
    assert pol.costs.samples(2, 0, False) == 0 and pol.costs.samples(2, 0, True) == 0
    assert d.num_draft[1] > 0, "the predictable auto request next to the fixed one never drafted"


def test_costs_are_a_real_exponential_average():
    """After 200 samples at 1.0 and 50 at 2.0 the cost reads 2.0 (a running mean would say 1.2)."""
    pol = AdaptivePolicy(PolicyConfig(kind="adaptive", k_max=2))
    for x in [1.0] * 200 + [2.0] * 50:
        pol.observe_step(1, np.zeros(1), False, x)
    assert pol.costs.plain(1, False) == pytest.approx(2.0, rel=0.01)


def test_costs_are_recorded_under_the_k_that_ran():
    pol = AdaptivePolicy(PolicyConfig(kind="adaptive", k_max=4, cost_shape="rows", keeps_draft_kv=False))
    pol.observe_step(2, np.array([0, 0]), False, 1.0)
    pol.observe_step(2, np.array([3, 1]), False, 1.4)  # asked for 4, n-gram matched 3 and 1
    assert pol.costs.samples(2, 3, False) == 1 and pol.costs.samples(2, 4, False) == 0
    assert pol.costs.predict(2, np.array([3, 1]), False) == pytest.approx(1.4)
    assert pol.costs.predict(2, np.array([3, 3]), False) == pytest.approx(1.6)


def test_latency_objective_keeps_speculative_steps_within_the_itl_budget():
    cost = {0: 1.0, 1: 1.08, 2: 1.15, 3: 1.3, 4: 1.4}
    accs = requests_with_alpha([0.95])
    thr = choose(policy_with_costs(cost.get, batch=1, k_max=4), accs)
    lat = choose(policy_with_costs(cost.get, batch=1, k_max=4, objective="latency", itl_budget=1.1), accs)
    assert thr.k == 4 and lat.k == 1


def test_bad_policy_settings_are_typed_errors():
    from specstep.engine.engine_config import EngineConfig
    from specstep.scheduler.spec.governor import GovernorConfig

    with pytest.raises(ValueError, match="spec-objective"):
        PolicyConfig(objective="fast")
    with pytest.raises(ValueError, match="itl-budget"):
        PolicyConfig(itl_budget=0.9)
    with pytest.raises(ValueError, match="epsilon"):
        PolicyConfig(governor=GovernorConfig(epsilon=0.0))
    with pytest.raises(ValueError, match="spec-epsilon"):
        EngineConfig(spec_epsilon=1.5)
    with pytest.raises(ValueError, match="spec-delta"):
        EngineConfig(spec_delta=-0.1)


def ngram_policy(batch: int, per_row: float) -> AdaptivePolicy:
    """n-gram's policy (ragged verify rows, no draft KV) past exploration, a step costing 1 + per_row a row."""
    pol = AdaptivePolicy(PolicyConfig(kind="adaptive", k_max=4, cost_shape="rows", keeps_draft_kv=False))
    for k in pol.cfg.ks:
        for _ in range(pol.cfg.plain_samples if k == 0 else pol.cfg.explore_samples):
            pol.observe_step(batch, np.full(batch, k), False, 1.0 + per_row * batch * k)
    return pol


def test_limits_cap_drafts_and_acceptance_is_measured_per_limit():
    """n-gram tells the policy how many drafts each lane's lookup would make (`limits`): they cap the lane's drafts
    (none without a match), and the lane's acceptance is the one measured under its limit, so a long match drafts
    all it can while a short one (rarely accepted) does not, where one estimate per request averages the two."""
    pol = ngram_policy(batch=2, per_row=0.12)
    own = requests_with_alpha([0.55, 0.55], steps=30, k=2)
    for _ in range(40):  # long matches: every draft accepted; one-token matches: a third of them
        pol.observe_request(RequestAcceptance(), 4, 4, limit=4)
        pol.observe_request(RequestAcceptance(), 1, int(pol.steps % 3 == 0), limit=1)
        pol.steps += 1
    d = pol.choose(own, [None, None], np.full(2, 100), limits=np.array([4, 1]))
    assert d.num_draft.tolist() == [4, 0] and d.limits.tolist() == [4, 1]
    assert pol.acceptance_estimate(own[0], 4) > 0.9 > 0.4 > pol.acceptance_estimate(own[1], 1)
    # without limits both lanes are the same to the policy: one k for both, neither 4 nor a split
    blind = pol.choose(own, [None, None], np.full(2, 100))
    assert blind.num_draft[0] == blind.num_draft[1] < 4
    # a lane drafts at most its limit, and nothing where its lookup found nothing, whatever its acceptance
    for _ in range(40):
        pol.observe_request(RequestAcceptance(), 2, 2, limit=2)
    sure = requests_with_alpha([0.97, 0.97], steps=30, k=4)
    assert pol.choose(sure, [None, None], np.full(2, 100), limits=np.array([2, 4])).num_draft.tolist() == [2, 4]
    assert pol.choose(sure, [None, None], np.full(2, 100), limits=np.array([0, 4])).num_draft.tolist() == [0, 4]


def test_a_batch_falls_in_the_smallest_bucket_holding_it():
    for batch in range(0, 300):
        assert bucket(batch) == next((b for b in BUCKETS if b >= batch), BUCKETS[-1]), batch
