"""The governor on realised throughput: it switches speculation off once confident it loses more than delta,
probes at most a fraction epsilon of steps while off, and switches back on when probes win."""

from __future__ import annotations

import numpy as np

from specstep.scheduler.spec.governor import Governor, GovernorConfig


def feed(gov: Governor, ratio: float, steps: int, rng, batch: int = 4) -> int:
    """Speculative steps whose tokens are noisy around ratio x plain; returns how many were taken."""
    n = 0
    for _ in range(steps):
        if not gov.on:
            break
        gov.observe(max(0.0, rng.normal(ratio * batch, 0.5)), float(batch))
        n += 1
    return n


def test_losing_speculation_is_switched_off_quickly():
    gov = Governor(GovernorConfig(delta=0.02))
    taken = feed(gov, 0.7, 200, np.random.default_rng(0))
    assert not gov.on and taken <= 20


def test_a_small_loss_within_delta_is_tolerated_and_a_win_is_kept():
    rng = np.random.default_rng(1)
    gov = Governor(GovernorConfig(delta=0.05))
    assert feed(gov, 0.99, 400, rng) == 400 and gov.on
    assert feed(gov, 0.8, 400, rng) < 400 and not gov.on  # the same governor does switch off a real loss
    gov = Governor(GovernorConfig(delta=0.02))
    assert feed(gov, 1.4, 400, rng) == 400 and gov.on


def test_probes_are_rate_limited_and_bring_speculation_back():
    cfg = GovernorConfig(epsilon=0.02)
    gov = Governor(cfg)
    rng = np.random.default_rng(2)
    feed(gov, 0.5, 100, rng)
    assert not gov.on
    probes = [gov.tick() for _ in range(1000)]
    assert sum(probes) <= 0.02 * 1000 + 1
    # Probes that lose keep it off; probes that win bring it back within a few.
    for _ in range(10):
        gov.observe(2.0, 4.0)
    assert not gov.on
    gov._samples.clear()
    wins = 0
    while not gov.on and wins < 20:
        gov.observe(rng.normal(6.0, 0.3), 4.0)
        wins += 1
    assert gov.on and wins <= cfg.resume_samples + 2


def test_one_slow_plain_step_does_not_move_the_baseline():
    gov = Governor(GovernorConfig())
    for x in (2.0, 1.0, 1.0):  # the first plain step 2x slow
        gov.observe_plain(4, x)
    assert gov.plain(4) == 1.0 and gov.plain(8) is None
    # Judged against that baseline, steps 0.8x as fast as plain (what the slow sample would have called 1.6x)
    # switch speculation off.
    for _ in range(40):
        gov.observe(4 * 0.8, 4 * 1.0 / gov.plain(4))
    assert not gov.on


def test_a_probes_overhead_defers_the_next_probe_until_off_time_pays_for_it():
    cfg = GovernorConfig(epsilon=0.02)
    gov = Governor(cfg)
    feed(gov, 0.5, 100, np.random.default_rng(3))
    assert not gov.on
    gov.owe(1.0)  # a probe that cost one second beyond plain (a large catch-up)
    due = []
    for _ in range(800):  # 0.1 s steps: 50 s of off time (500 steps) pay for it at epsilon = 0.02
        due.append(gov.tick())
        gov.ran(0.1)
    assert not any(due[:450]), "probed before the last probe's overhead was paid for"
    assert any(due[500:])


def test_a_decision_that_never_runs_keeps_its_probe_due():
    gov = Governor(GovernorConfig(epsilon=0.02))
    feed(gov, 0.5, 100, np.random.default_rng(4))
    for _ in range(10 * gov.cfg.probe_every):  # bounded: a governor that never switched off never probes
        counted, probe = gov.peek()
        if probe:
            break
        gov.commit_tick(counted, probe)
    else:
        raise AssertionError("no probe came due while off")
    assert gov.peek() == (True, True), "peeking spent the probe"  # the probe's chained step was re-planned
    assert gov.tick(), "the probe was lost"
