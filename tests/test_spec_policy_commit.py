"""A decision is made once and counted when its step runs: `choose(commit=False)` has no side effects (on the
policy, its governor, its cost model or the callers' `RequestAcceptance`s), and `commit` applies exactly what the
decision carries. Checked at every decision of harness runs that pass through exploration, speculation on, off
with governor probes due, and per-request probes due, on both stream paths."""

from __future__ import annotations

import copy
from collections import Counter, deque

import numpy as np
import pytest

from specstep.scheduler.spec.decision import Decision
from specstep.scheduler.spec.policy import AdaptivePolicy
from tests.sim_engine import Scenario, simulate
from tests.test_policy_harness import adaptive, mtp_cost, ngram_cost


def state(x, seen=None):
    """A comparable deep view of an object graph (plain classes, slotted dataclasses, numpy, containers)."""
    if isinstance(x, (int, float, str, bool, type(None))):
        return x
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype.str, x.tolist())
    if isinstance(x, (np.generic,)):
        return x.item()
    if isinstance(x, (Counter, dict)):
        return (type(x).__name__, tuple(sorted((state(k), state(v)) for k, v in x.items())))
    if isinstance(x, (list, tuple, deque)):
        return (type(x).__name__, tuple(state(v) for v in x))
    fields = getattr(x, "__dict__", None)
    if fields is None:
        fields = {s: getattr(x, s) for c in type(x).__mro__ for s in getattr(c, "__slots__", ())}
    return (type(x).__name__, tuple(sorted((k, state(v)) for k, v in fields.items())))


class CheckedPolicy(AdaptivePolicy):
    """At every decision: choose without committing, twice, with the policy's state (and the requests') checked
    unchanged; with random other inputs too; then commit the first decision (the second is dropped)."""

    def __init__(self, cfg, seed: int = 0) -> None:
        super().__init__(cfg)
        self.rng = np.random.default_rng(seed)
        self.checked = Counter()

    def choose(self, accs, overrides, room, behind=None, commit=True, limits=None) -> Decision:
        before = state((self, accs))
        first = super().choose(accs, overrides, room, behind, commit=False, limits=limits)
        again = super().choose(accs, overrides, room, behind, commit=False, limits=limits)
        assert state(first) == state(again), "the same inputs decided differently: a dropped decision left a trace"
        other_room = self.rng.integers(0, self.cfg.k_max + 1, len(accs))
        other_behind = self.rng.integers(0, 50, len(accs)) if behind is not None else None
        super().choose(accs, overrides, other_room, other_behind, commit=False, limits=limits)
        assert state((self, accs)) == before, f"choose(commit=False) changed state ({first.reason})"
        self.checked[first.reason] += 1
        if commit:
            self.commit(first)
        return first


class PlanThenCommit(AdaptivePolicy):
    """What the engine core does: plan (commit=False), drop a re-planned decision, commit when the step runs."""

    def choose(self, accs, overrides, room, behind=None, commit=True, limits=None) -> Decision:
        super().choose(accs, overrides, room, behind, commit=False, limits=limits)  # dropped
        d = super().choose(accs, overrides, room, behind, commit=False, limits=limits)
        if commit:
            self.commit(d)
        return d


def acceptance_dropping():
    """On (0.8), then off after the drop with governor and per-request probes (a proposer that loses at 0.4)."""
    return Scenario(mtp_cost(per_k=0.1, refill=0.5), alpha=lambda rid, t: 0.8 if t < 2000 else 0.4), \
        [(0, f"r{i}", None) for i in range(4)], 1500, "mtp", {}


def costly_catch_up():
    """Off at batch 16 with a costly catch-up: governor probes with a subset of lanes (the others backed off)."""
    return Scenario(mtp_cost(), alpha=lambda rid, t: 0.03, catch_up_per_token=2e-4), \
        [(0, f"r{i}", None) for i in range(16)], 400, "mtp", {}  # 400: the governor is off by ~250


def arrivals_ngram():
    """Requests arriving one after another (buckets change, exploration), n-gram rows, a fixed-k neighbour."""
    return Scenario(ngram_cost(), alpha=lambda rid, t: 0.1 if t < 600 else 0.8), \
        [(60 * i, f"r{i}", 2 if i == 3 else None) for i in range(12)], 150, "ngram", {}


SCENARIOS = {"acceptance_dropping": acceptance_dropping, "costly_catch_up": costly_catch_up,
             "arrivals_ngram": arrivals_ngram}


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlap"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_choose_without_commit_has_no_side_effects(name, overlap, monkeypatch):
    scenario, arrivals, max_tokens, proposer, kw = SCENARIOS[name]()
    policies = []

    def make(cfg, store=None):
        policies.append(CheckedPolicy(cfg))
        return policies[-1]
    monkeypatch.setattr("tests.sim_engine.AdaptivePolicy", make)
    simulate(scenario, proposer, arrivals, max_tokens, adaptive(proposer), overlap=overlap, **kw)
    (pol,) = policies
    assert sum(pol.checked.values()) > 100
    assert pol.checked["explore"] > 0, pol.checked
    if name != "arrivals_ngram":  # per-request probes (on), governor probes (off)
        assert pol.checked["probe"] > 0, pol.checked
    if name == "costly_catch_up":
        assert pol.checked["off"] > 0, pol.checked
    assert pol.checked["model"] > 0, pol.checked


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlap"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_plan_then_commit_equals_choose_and_commit(name, overlap, monkeypatch):
    scenario, arrivals, max_tokens, proposer, kw = SCENARIOS[name]()
    direct = simulate(scenario, proposer, arrivals, max_tokens, adaptive(proposer), overlap=overlap, **kw)
    monkeypatch.setattr("tests.sim_engine.AdaptivePolicy", PlanThenCommit)
    planned = simulate(scenario, proposer, arrivals, max_tokens, adaptive(proposer), overlap=overlap, **kw)
    assert type(planned.core.policy) is PlanThenCommit
    assert planned.steps == direct.steps and planned.trace == direct.trace
    assert planned.chosen_k == direct.chosen_k
    assert state(planned.core.policy)[1] == state(direct.core.policy)[1]  # (the class names differ)
    # Each effect applied at all (both runs commit through the same code): the one committed via
    # `next_remeasure` shows as re-measurements while speculating, those via the governor's clock as probes.
    if name == "acceptance_dropping":
        assert planned.core.policy.reasons["remeasure"] > 0
    if name == "costly_catch_up":
        assert planned.core.policy.governor.probes > 0 and planned.core.policy.reasons["probe"] > 0


def test_commit_applies_the_decision_once():
    """A decision chosen without commit, committed: the same state as choosing with commit (a fresh policy)."""
    cfg = adaptive("mtp")
    a, b = AdaptivePolicy(cfg), AdaptivePolicy(cfg)
    room = np.full(3, 4)
    for _ in range(5):
        accs_a = [copy.deepcopy(x) for x in [a.global_acc] * 3]
        accs_b = copy.deepcopy(accs_a)
        da = a.choose(accs_a, [None] * 3, room)
        db = b.choose(accs_b, [None] * 3, room, commit=False)
        assert b.steps == a.steps - 1
        b.commit(db)
        assert state((a, accs_a, da)) == state((b, accs_b, db))
