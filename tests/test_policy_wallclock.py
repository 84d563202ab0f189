"""The adaptive policy in real time: step costs slept, the engine core on the real streams (inline, and the
worker-thread stream whose `device_seconds` the overlap path reads) and the real clock. Where nothing is
predictable the adaptive policy stays near plain decoding's wall-clock throughput; the same run with the fixed
policy (`--spec-policy fixed`, k = 4) loses, so this fails without the adaptive policy."""

from __future__ import annotations

import pytest

from tests.sim_engine import Scenario, simulate
from tests.test_policy_harness import adaptive, fixed, mtp_cost


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlap"])
def test_adaptive_policy_keeps_plain_speed_in_wall_clock(overlap):
    scenario = Scenario(mtp_cost(per_k=0.3), alpha=lambda rid, t: 0.03)  # k = 4 costs 2.44x a plain step
    arrivals = [(0, f"r{i}", None) for i in range(4)]
    plain = simulate(scenario, None, arrivals, 200, overlap=overlap, real_time=True)
    ada = simulate(scenario, "mtp", arrivals, 200, adaptive("mtp"), overlap=overlap, real_time=True)
    fix = simulate(scenario, "mtp", arrivals, 200, fixed("mtp"), overlap=overlap, real_time=True)
    assert ada.tokens == plain.tokens == fix.tokens
    r, rf = ada.throughput / plain.throughput, fix.throughput / plain.throughput
    # Looser than the virtual-clock harness (0.97): 200 steps leave the one-off exploration (each k measured,
    # up to 2.44x a plain step) ~5% of the run, and a loaded 2-core host adds sleep and thread jitter (0.81x
    # measured once beside a benchmark); fixed k = 4 runs ~0.45x.
    assert r >= 0.75, f"adaptive at {r:.3f}x plain in wall-clock time (fixed k = 4: {rf:.3f}x)"
    assert rf < 0.6, f"fixed k = 4 at {rf:.3f}x plain: the scenario does not tell the policies apart"
