"""The policy review's scenarios (issue 20), on both stream paths: each keeps at least 0.97x plain decoding,
and speculation comes back where it pays. Each failed with the policy as the review found it (long prompts: on the
inline path; on the overlap path the lost probes made it plain decoding)."""

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
