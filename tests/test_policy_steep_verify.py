"""The adaptive policy on a host where verify grows steeply with rows (tests/sim_engine.py, virtual clock): as
measured on an AMD AVX-512 CPU at batch 6, a k = 4 verify step costs 3.1x a plain one and a whole k = 4 step with
the MTP head's drafts and refill about 4.5x; the head also costs 1% of a step while off (its bookkeeping), which a
plain engine never pays. On the held-out shape (6 requests, 256 tokens, acceptance 0.07 as sampled prose gets)
the policy prices what it tries to learn by these costs: it measures k = 1, sees it cannot pay, never tries a wider
k, and holds 0.97x plain on both stream paths."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.sim_engine import Scenario, simulate
from tests.test_policy_harness import adaptive, plain_cost

VERIFY_PER_ROW = 0.0875  # of a plain step, per draft row: a batch-6 k = 4 verify step 1 + 24 x 0.0875 = 3.1x
REFILL = 0.35  # the head's refill over the verified rows, of a plain step
DRAFT = 0.35  # each head forward of the draft loop after the first draft, of a plain step


def steep_cost(lanes: bool):
    """lanes (MTP): every lane verifies k + 1 rows and runs the draft loop once anyone drafts; rows (n-gram):
    each verified draft row costs VERIFY_PER_ROW, nothing else."""
    def cost(b, nd, refill, tokens):
        k = int(nd.max(initial=0))
        if not lanes:
            return plain_cost(b) * (1 + VERIFY_PER_ROW * float(nd.sum()))
        head = (REFILL if refill else 0.0) + DRAFT * max(k - 1, 0)
        return plain_cost(b) * (1 + VERIFY_PER_ROW * b * k + head)
    return cost


@pytest.fixture(params=[False, True], ids=["inline", "overlap"])
def overlap(request) -> bool:
    return request.param


def test_cost_shape_is_the_measured_one():
    cost = steep_cost(lanes=True)
    import numpy as np

    plain = cost(6, np.zeros(6, np.int64), False, 0)
    verify_only = plain_cost(6) * (1 + VERIFY_PER_ROW * 6 * 4)
    assert verify_only / plain == pytest.approx(3.1, abs=0.01)
    assert 4.4 < cost(6, np.full(6, 4), True, 0) / plain < 4.7


@pytest.mark.parametrize("proposer", ["mtp", "ngram"])
def test_steep_verify_holds_the_floor_and_tries_only_the_cheapest_k(proposer, overlap):
    scenario = Scenario(steep_cost(lanes=proposer == "mtp"), alpha=lambda rid, t: 0.07,
                        off_cost=0.01 if proposer == "mtp" else 0.0)
    arrivals = [(0, f"r{i}", None) for i in range(6)]
    plain = simulate(scenario, None, arrivals, 256, overlap=overlap)
    ada = simulate(scenario, proposer, arrivals, 256, adaptive(proposer), overlap=overlap)
    assert ada.tokens == plain.tokens
    ratio = ada.throughput / plain.throughput
    assert ratio >= 0.97, f"adaptive at {ratio:.3f}x plain"
    ks = Counter(k for b, k, _ in ada.steps if b == 6)
    assert set(ks) <= {0, 1}, f"a wider k was tried though k = 1 could not pay: {dict(ks)}"
    assert ks[1] <= 16, dict(ks)
