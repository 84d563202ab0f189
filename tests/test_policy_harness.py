"""The adaptive policy, governor and engine core on injected step costs and acceptance (tests/sim_engine.py):
in every scenario the adaptive policy keeps at least 0.97x plain decoding's throughput with a bounded number
of k switches, and speculates where it pays. Each scenario also runs with a fixed k, which loses (so these
tests fail without the adaptive policy). Every scenario runs on both stream paths: inline, and the overlap path
a GPU runs by default (steps chained: the next one decided before this one is read back)."""

from __future__ import annotations

import numpy as np
import pytest

from specstep.scheduler.spec.policy import PolicyConfig
from tests.sim_engine import Scenario, simulate

MS = 1e-3


@pytest.fixture(params=[False, True], ids=["inline", "overlap"])
def overlap(request) -> bool:
    return request.param


def plain_cost(b: int) -> float:
    return 10 * MS * (1 + 0.04 * b)


def mtp_cost(per_k: float = 0.08, refill: float = 0.24, batch_growth: float = 0.0):
    """Model-proposer shape: every lane pays the draft loop and the refill once anyone drafts."""
    def cost(b, nd, with_refill, tokens):
        k = int(nd.max(initial=0))
        return plain_cost(b) * (1 + (refill if with_refill else 0.0) + k * (per_k + batch_growth * b))
    return cost


def ngram_cost(per_row: float = 0.06):
    """Host-proposer shape: ragged verify pays per draft row."""
    def cost(b, nd, with_refill, tokens):
        return plain_cost(b) + 10 * MS * per_row * float(nd.sum())
    return cost


def adaptive(proposer: str, **kw) -> PolicyConfig:
    return PolicyConfig(kind="adaptive", k_max=4, keeps_draft_kv=proposer == "mtp",
                        cost_shape="lanes" if proposer == "mtp" else "rows", **kw)


def fixed(proposer: str) -> PolicyConfig:
    return PolicyConfig(kind="fixed", k_max=4, keeps_draft_kv=proposer == "mtp")


def run_all(scenario, proposer, arrivals, max_tokens, overlap=False, **kw):
    plain = simulate(scenario, None, arrivals, max_tokens, overlap=overlap)
    ada = simulate(scenario, proposer, arrivals, max_tokens, adaptive(proposer, **kw), overlap=overlap)
    fix = simulate(scenario, proposer, arrivals, max_tokens, fixed(proposer), overlap=overlap)
    assert ada.tokens == plain.tokens == fix.tokens
    return plain, ada, fix


def check_floor(plain, ada, max_switches: int) -> None:
    ratio = ada.throughput / plain.throughput
    assert ratio >= 0.97, f"adaptive at {ratio:.3f}x plain"
    assert ada.k_switches() <= max_switches, f"{ada.k_switches()} k switches in {len(ada.steps)} steps"


@pytest.mark.parametrize("proposer", ["mtp", "ngram"])
def test_unpredictable_load_stays_at_plain(proposer, overlap):
    cost = mtp_cost() if proposer == "mtp" else ngram_cost()
    scenario = Scenario(cost, alpha=lambda rid, t: 0.03)
    plain, ada, fix = run_all(scenario, proposer, [(0, f"r{i}", None) for i in range(4)], 600, overlap=overlap)
    check_floor(plain, ada, max_switches=60)
    assert fix.throughput / plain.throughput < 0.9  # what the adaptive policy avoids
    assert ada.speculating(0.2) < 0.05


def test_fixed_k_neighbour_does_not_block_or_pollute(overlap):
    """A fixed-k request drafts every step; the auto request next to it (acceptance 0.9) drafts too, costs are
    recorded under what really ran, and exploration ends."""
    scenario = Scenario(mtp_cost(), alpha=lambda rid, t: 0.9 if rid == "auto" else 0.3)
    arrivals = [(0, "fixed", 2), (0, "auto", None)]
    ada = simulate(scenario, "mtp", arrivals, 400, adaptive("mtp"), overlap=overlap)
    auto = next(r for r in ada.requests if r.request_id == "auto")
    together = sum(b == 2 for b, _, _ in ada.steps)
    assert auto.stats.steps >= 0.9 * together, "the predictable auto request did not draft"
    reasons = ada.core.policy.reasons
    assert reasons["explore"] <= 12, reasons
    # Every k = 0 cost sample is a real plain step: none were recorded while the fixed request drafted.
    assert ada.core.policy.costs.samples(2, 0, False) == 0
    best_fixed = simulate(scenario, "mtp", [(0, "fixed", 2), (0, "auto", 4)], 400, overlap=overlap)
    assert ada.throughput >= 0.95 * best_fixed.throughput


@pytest.mark.parametrize("proposer", ["mtp", "ngram"])
def test_load_change_halfway_keeps_speculating(proposer, overlap):
    base = mtp_cost() if proposer == "mtp" else ngram_cost()
    scenario = Scenario(lambda b, nd, r, t: base(b, nd, r, t) * (2.0 if t > 1200 else 1.0), alpha=lambda rid, t: 0.8)
    plain, ada, fix = run_all(scenario, proposer, [(0, f"r{i}", None) for i in range(4)], 600, overlap=overlap)
    check_floor(plain, ada, max_switches=40)
    assert ada.throughput / plain.throughput > 1.4  # seed-sensitive: 1.42-1.61 over seeds 0-4 (n-gram)
    # Up to the last tenth of the steps: there the requests end (max_tokens leaves no room to draft, and each
    # finished request moves the batch to a bucket measured afresh), which takes a few more steps when n-gram's
    # plain steps chain on the overlap path.
    assert ada.speculating(0.6, 0.9) > 0.9, "speculation stopped after the load changed"


def test_bucket_change_turns_speculation_off_where_it_loses(overlap):
    """One stream alone speculates (cheap at batch 1); when 15 more arrive, verify rows cost too much at batch
    16 and the policy goes plain there."""
    scenario = Scenario(mtp_cost(per_k=0.05, batch_growth=0.05), alpha=lambda rid, t: 0.6)
    arrivals = [(0, "solo", None)] + [(300, f"r{i}", None) for i in range(15)]
    plain, ada, fix = run_all(scenario, "mtp", arrivals, 400, overlap=overlap)
    check_floor(plain, ada, max_switches=80)
    solo_steps = [k for b, k, _ in ada.steps if b == 1]
    big_steps = [k for b, k, _ in ada.steps if b >= 9]
    assert sum(k > 0 for k in solo_steps[10:]) > 0.8 * len(solo_steps[10:])
    assert sum(k > 0 for k in big_steps) < 0.1 * len(big_steps)


@pytest.mark.parametrize("proposer", ["mtp", "ngram"])
def test_proposer_costing_more_than_it_gains(proposer, overlap):
    cost = mtp_cost(per_k=0.6) if proposer == "mtp" else ngram_cost(per_row=0.3)
    scenario = Scenario(cost, alpha=lambda rid, t: 0.5)
    # Long enough for the one-off exploration (each k measured twice, k = 4 at 3.6x plain) to amortise.
    plain, ada, fix = run_all(scenario, proposer, [(0, f"r{i}", None) for i in range(4)], 1500, overlap=overlap)
    check_floor(plain, ada, max_switches=60)
    assert fix.throughput / plain.throughput < 0.9


@pytest.mark.parametrize("proposer", ["mtp", "ngram"])
def test_workload_turning_predictable_brings_speculation_back(proposer, overlap):
    cost = mtp_cost() if proposer == "mtp" else ngram_cost()
    scenario = Scenario(cost, alpha=lambda rid, t: 0.0 if t < 1600 else 0.9)
    plain, ada, fix = run_all(scenario, proposer, [(0, f"r{i}", None) for i in range(4)], 1200, overlap=overlap)
    check_floor(plain, ada, max_switches=80)
    assert ada.speculating(0.0, 0.3) < 0.1
    assert ada.speculating(0.75) > 0.7, "speculation did not come back"


def test_probe_rate_is_bounded_while_off(overlap):
    scenario = Scenario(mtp_cost(), alpha=lambda rid, t: 0.0)
    ada = simulate(scenario, "mtp", [(0, "r", None)], 2000, adaptive("mtp"), overlap=overlap)
    late = ada.steps[200:]
    frac = sum(k > 0 for _, k, _ in late) / len(late)
    assert frac <= 0.025, f"{frac:.3f} of steps drafted while speculation should be off"
    # The model alone also stops drafting here (its per-request probes back off to 1 in 64): what bounds the
    # rate must be the governor, off and probing, so the test fails with it disabled or never switching off.
    pol = ada.core.policy
    assert pol.governor_state == "off" and pol.governor.probes >= 1
    assert pol.reasons["off"] >= 0.9 * len(late), dict(pol.reasons)
    assert np.isfinite(ada.throughput)
