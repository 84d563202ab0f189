"""The governor on realised throughput: it switches speculation off once confident it loses more than delta,
probes at most a fraction epsilon of steps while off, and switches back on when probes win."""

from __future__ import annotations

import numpy as np

from specstep.scheduler.spec_governor import Governor, GovernorConfig


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
