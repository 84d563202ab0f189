"""Adaptive-policy scenarios on both stream paths: each keeps at least 0.97x plain decoding, and speculation comes
back where it pays. Long prompts fail on the inline path when the policy does not resume after them, and on the
overlap path when probes are lost (it becomes plain decoding); batch 64 with a costly catch-up fails (0.89x / 0.90x)
unless probes from plain decoding catch up a subset of lanes."""

from __future__ import annotations

import pytest

from tests.sim_engine import Scenario, simulate
from tests.test_policy_harness import adaptive, mtp_cost


@pytest.fixture(params=[False, True], ids=["inline", "overlap"])
def overlap(request) -> bool:
    return request.param


def ratio(scenario, arrivals, max_tokens, overlap, **kw):
    plain = simulate(scenario, None, arrivals, max_tokens, overlap=overlap, **kw)
    ada = simulate(scenario, "mtp", arrivals, max_tokens, adaptive("mtp"), overlap=overlap, **kw)
    assert ada.tokens == plain.tokens
    return ada.throughput / plain.throughput, ada


def steady_turning_predictable():
    """Requests one after another (batch about 2), unpredictable then predictable: on the overlap path every
    probe was decided for a chained step that then had to drain, and thrown away."""
    return Scenario(mtp_cost(), alpha=lambda rid, t: 0.0 if t < 2000 else 0.9), \
        [(100 * i, f"r{i}", None) for i in range(80)], 200


def noisy_plain_sample():
    """The first decode step, plain (the adaptive policy's exploration starts there), takes 2x: the model and
    the governor both took plain decoding to be slow, and speculation at a loss to be a win."""
    base = mtp_cost()

    def cost(b, nd, refill, tokens):
        return base(b, nd, refill, tokens) * (2.0 if tokens == 0 and not nd.any() else 1.0)
    return Scenario(cost, alpha=lambda rid, t: 0.3), [(0, f"r{i}", None) for i in range(4)], 600


def long_prompts_b1():
    """2,000-token prompts one at a time, nothing predictable: each probe catches up a whole prompt."""
    return Scenario(mtp_cost(), alpha=lambda rid, t: 0.03), \
        [(150 * i, f"r{i}", None) for i in range(30)], 150, {"prompt_len": 2000}


def batch_64_costly_catch_up():
    """64 requests, nothing predictable, a draft-model-like catch-up (10x the MTP head's per token): every probe
    that caught up every lane paid batch x off steps x that rate, a fixed fraction of all the off time."""
    return Scenario(mtp_cost(), alpha=lambda rid, t: 0.03, catch_up_per_token=2e-4), \
        [(0, f"r{i}", None) for i in range(64)], 600


def acceptance_dropping():
    """Acceptance 0.8, then 0.4 after 2,000 tokens, with a proposer that loses at 0.4 (refill half a plain step):
    speculation must turn off soon after the drop, not go on probing a fifth of the steps."""
    return Scenario(mtp_cost(per_k=0.1, refill=0.5), alpha=lambda rid, t: 0.8 if t < 2000 else 0.4), \
        [(0, f"r{i}", None) for i in range(4)], 1500


def test_batch_64_with_a_costly_catch_up(overlap):
    r, ada = ratio(*batch_64_costly_catch_up(), overlap)
    assert r >= 0.97, f"{r:.3f}x plain"
    # Speculation stays off: by the governor, or by the probes' own pricing (a probe that cannot pay back at
    # the acceptance the evidence allows waits), which may leave the governor on with nothing to judge.
    assert ada.speculating(0.5) < 0.05


def test_acceptance_dropping_from_0_8_to_0_4(overlap):
    scenario, arrivals, max_tokens = acceptance_dropping()
    plain = simulate(scenario, None, arrivals, max_tokens, overlap=overlap)
    ada = simulate(scenario, "mtp", arrivals, max_tokens, adaptive("mtp"), overlap=overlap)
    assert ada.tokens == plain.tokens
    # After the drop only (over the whole run the good part hides it). Each request probing on its own clock made
    # four times the whole-step probes, at 1.6x a plain step each: 0.944x inline, 0.934x overlap. With every lane
    # joining the probe that is due (a model proposer's lanes pay its draft loop together): 0.971x and 0.975x.
    r = ada.throughput_from(2000) / plain.throughput_from(2000)
    assert r >= 0.97, f"{r:.3f}x plain after the drop"
    assert ada.speculating(0.0, 0.2) > 0.7, "did not speculate while it paid"
    drop = next(i for i, (t, _) in enumerate(ada.trace) if t >= 2000)
    late = ada.steps[drop + 100:]
    assert sum(k > 0 for _, k, _ in late) / len(late) < 0.1, "went on speculating after acceptance dropped"


def test_turning_predictable_under_steady_arrivals(overlap):
    r, ada = ratio(*steady_turning_predictable(), overlap)
    assert r >= 0.97, f"{r:.3f}x plain"
    assert ada.speculating(0.75) > 0.4, "speculation did not come back"


def test_one_slow_plain_sample_during_exploration(overlap):
    r, _ = ratio(*noisy_plain_sample(), overlap)
    assert r >= 0.97, f"{r:.3f}x plain"


def test_long_prompts_at_batch_1(overlap):
    """A probe's catch-up (a whole prompt) is charged to the probe budget, not judged as speculation's cost."""
    scenario, arrivals, max_tokens, kw = long_prompts_b1()
    r, _ = ratio(scenario, arrivals, max_tokens, overlap, **kw)
    assert r >= 0.97, f"{r:.3f}x plain"
