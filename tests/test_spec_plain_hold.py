"""A plain choice is derived once and reused while nothing it reads changes (`scheduler/spec/plain_hold.py`):
deriving it every step cost an adaptive engine that drafted nothing 10-16% of a plain engine's throughput on the
default model. Checked on the simulated engine (virtual clock): the hold derives a small share of the decisions,
runs the same tokens at the same throughput with the same probes, and ends as soon as an input changes."""

from __future__ import annotations

import numpy as np
import pytest

from specstep.scheduler.spec import plain_hold
from specstep.scheduler.spec.decision import RequestAcceptance
from specstep.scheduler.spec.policy import AdaptivePolicy
from tests.sim_engine import Scenario, simulate
from tests.test_policy_harness import adaptive, mtp_cost, ngram_cost

HOLD = plain_hold.HOLD_STEPS
COSTS = {"mtp": mtp_cost(per_k=0.3), "ngram": ngram_cost(per_row=0.3)}


class CountingPolicy(AdaptivePolicy):
    """Counts the decisions it derives (a held one is not derived)."""

    def __init__(self, cfg, store=None) -> None:
        super().__init__(cfg, store)
        self.derived = 0

    def _choose(self, *args, **kw):
        self.derived += 1
        return super()._choose(*args, **kw)


def run(proposer: str, overlap: bool, monkeypatch, hold_steps: int):
    """Four requests whose drafts are never accepted: the model's choice is plain almost throughout."""
    monkeypatch.setattr(plain_hold, "HOLD_STEPS", hold_steps)
    monkeypatch.setattr("tests.sim_engine.AdaptivePolicy", CountingPolicy)
    scenario = Scenario(COSTS[proposer], alpha=lambda rid, t: 0.0)
    res = simulate(scenario, proposer, [(0, f"r{i}", None) for i in range(4)], 600, adaptive(proposer),
                   overlap=overlap)
    return res, res.core.policy


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlap"])
@pytest.mark.parametrize("proposer", ["mtp", "ngram"])
def test_a_plain_choice_is_derived_once_a_hold(proposer, overlap, monkeypatch):
    every, every_pol = run(proposer, overlap, monkeypatch, 1)
    held, held_pol = run(proposer, overlap, monkeypatch, HOLD)
    steps = len(held.steps)
    assert every_pol.derived >= len(every.steps)  # (overlap re-plans: more decisions than steps)
    assert held_pol.derived <= steps / 4, (held_pol.derived, steps, held_pol.reasons)
    assert held.tokens == every.tokens
    # What ran is what deriving every step runs: the same probes (a due probe ends the hold), about as fast.
    assert held_pol.reasons["probe"] == pytest.approx(every_pol.reasons["probe"], abs=2)
    assert held.throughput == pytest.approx(every.throughput, rel=0.01)


def test_the_hold_ends_when_what_it_reads_changes(monkeypatch):
    _, pol = run("ngram", False, monkeypatch, HOLD)
    assert pol.governor.on  # (a held choice is the throughput model's, with the governor on)
    accs = [RequestAcceptance(accepted=0.0, trials=40.0, probe_interval=64) for _ in range(4)]
    auto, room = [None] * 4, np.full(4, 100)
    d = pol.choose(accs, auto, room)
    assert d.reason == "model" and not d.num_draft.any() and d.hold is not None
    assert pol.choose(accs, auto, room - 50, commit=False) is d  # room past k_max is not read
    assert pol.choose(list(accs), auto, room, commit=False) is d  # the same requests, another list
    fresh = accs[:3] + [RequestAcceptance(accepted=0.0, trials=40.0, probe_interval=64)]
    for changed in (dict(accs=fresh), dict(room=np.array([100, 100, 100, 2])), dict(overrides=[None, None, None, 0]),
                    dict(limits=np.array([4, 4, 4, 1]))):
        args = dict(accs=accs, overrides=auto, room=room) | changed
        assert pol.choose(commit=False, **args) is not d, changed
    for _ in range(HOLD - 1):  # its span, in committed steps
        assert pol.choose(accs, auto, room) is d
    d2 = pol.choose(accs, auto, room)
    assert d2 is not d and d2.hold is not None
    assert pol.choose(accs, auto, room, commit=False) is d2
    pol.observe_request(accs[0], 2, 0)  # a measurement: derived afresh
    assert pol.choose(accs, auto, room, commit=False) is not d2


def test_a_due_probe_ends_the_hold(monkeypatch):
    _, pol = run("ngram", False, monkeypatch, HOLD)
    interval = pol.probes.intervals([RequestAcceptance(probe_interval=6)])[0]
    accs = [RequestAcceptance(accepted=0.0, trials=40.0, probe_interval=6, idle_steps=interval - 3) for _ in range(4)]
    d = pol.choose(accs, [None] * 4, np.full(4, 100))
    assert d.hold is not None and d.hold.span == 3


def test_a_plain_choice_that_spends_the_governors_probe_is_not_held(monkeypatch):
    """Off, its probe due, and nobody able to draft (no n-gram match): the step is plain but spends the governor's
    probe. Held, each reuse would spend it again (and push the next one back)."""
    counts = []
    for steps in (1, HOLD):
        _, pol = run("ngram", False, monkeypatch, steps)
        pol.governor._switch(False)
        pol.governor._since_probe = pol.governor.cfg.probe_every - 1
        accs = [RequestAcceptance(accepted=0.0, trials=40.0, probe_interval=64) for _ in range(4)]
        for _ in range(HOLD):
            d = pol.choose(accs, [None] * 4, np.full(4, 100), limits=np.zeros(4, np.int64))
            assert not d.num_draft.any()
        counts.append((pol.governor.probes, pol.governor._since_probe))
    assert counts[0] == counts[1] == (1, HOLD - 1)


def test_a_request_that_waits_does_not_hold_back_anothers_probe(monkeypatch):
    """A request due already but unable to probe (no room) must not stretch the hold past another's coming probe."""
    _, pol = run("ngram", False, monkeypatch, HOLD)
    interval = pol.probes.intervals([RequestAcceptance(probe_interval=6)])[0]
    accs = [RequestAcceptance(accepted=0.0, trials=40.0, probe_interval=6, idle_steps=interval + 5)] + \
           [RequestAcceptance(accepted=0.0, trials=40.0, probe_interval=6, idle_steps=interval - 2) for _ in range(3)]
    d = pol.choose(accs, [None] * 4, np.array([0, 100, 100, 100]))
    assert d.hold is not None and d.hold.span == 2
