"""What the adaptive policy carries over: step costs across runs (`scheduler.spec.cost_store`, in the user
cache, per model, proposer, host and kernel plan), and the acceptance across an engine's requests per sampling
kind. A second run starts from the first one's costs and explores nothing but plain decoding; a stored file that
is corrupt, of another version or key, or holds nonsense is ignored with a warning, never a crash."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from specstep.engine.model_source import cache_root
from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler.spec.cost_store import StepCostStore, store_folder
from specstep.scheduler.spec.decision import RequestAcceptance
from specstep.scheduler.spec.policy import AdaptivePolicy
from tests.helpers import make_core, run_to_completion
from tests.sim_engine import Scenario, simulate
from tests.test_policy_harness import adaptive, mtp_cost

KEY = {"model": "m", "spec": "mtp", "host": "h", "kernels": "k"}


def scenario() -> Scenario:
    """Speculation pays (every k is worth exploring on a cold start)."""
    return Scenario(mtp_cost(), alpha=lambda rid, t: 0.8)


def explored(result) -> int:
    """Exploration steps that drafted (plain decoding's cost nothing and are always measured live)."""
    return sum(n for k, n in result.core.policy.exploration.tries.items() if k > 0)


def run(store: StepCostStore | None, overlap: bool = False):
    arrivals = [(0, f"r{i}", None) for i in range(4)]
    return simulate(scenario(), "mtp", arrivals, 256, adaptive("mtp"), overlap=overlap, store=store)


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlap"])
def test_second_run_starts_from_the_first_runs_costs(tmp_path, overlap):
    store = StepCostStore(tmp_path, KEY)
    cold = run(store, overlap)
    assert store.path.is_file()
    assert explored(cold) >= 8  # k = 1..4, twice each
    warm = run(StepCostStore(tmp_path, KEY), overlap)
    assert warm.core.policy.prior_loaded and not cold.core.policy.prior_loaded
    # Only plain decoding is explored: every k > 0 cost came from the prior.
    assert explored(warm) == 0, dict(warm.core.policy.exploration.tries)
    assert warm.tokens == cold.tokens
    # The prior's ratios price k at its stored ratio times the live plain step.
    stored = json.loads(store.path.read_text())["ratios"]
    fresh = AdaptivePolicy(adaptive("mtp"), StepCostStore(tmp_path, KEY))
    fresh.costs.observe(4, np.zeros(4, np.int64), False, 0.02)
    assert stored["4/4/1"][0] == pytest.approx(1.24 + 4 * 0.08, rel=0.01)  # mtp_cost: refill 0.24, 0.08 per k
    assert fresh.costs.predict(4, np.full(4, 4), True) == pytest.approx(stored["4/4/1"][0] * 0.02)
    assert fresh.costs.total_samples(4, True) == 2  # counted as explored


def test_another_key_is_another_file(tmp_path):
    a, b = StepCostStore(tmp_path, KEY), StepCostStore(tmp_path, KEY | {"host": "another"})
    assert a.path != b.path and a.path.parent == b.path.parent


@pytest.mark.parametrize("content", [
    "{not json", json.dumps([1, 2]), json.dumps({"version": 999, "key": KEY, "ratios": {}, "row_ratios": {}}),
    json.dumps({"version": 1, "key": KEY | {"host": "elsewhere"}, "ratios": {}, "row_ratios": {}}),
    json.dumps({"version": 1, "key": KEY, "ratios": {"8/1/1": [-2.0, 3]}, "row_ratios": {}}),
    json.dumps({"version": 1, "key": KEY, "ratios": {"8/x/1": [2.0, 3]}, "row_ratios": {}}),
    json.dumps({"version": 1, "key": KEY, "ratios": {"8/1/1": ["a", 3]}, "row_ratios": {}}),
    json.dumps({"version": 1, "key": KEY, "ratios": {"8/1/1": [float("nan"), 3]}, "row_ratios": {}}),
], ids=["corrupt", "not-a-table", "version", "key", "negative", "bad-name", "not-a-number", "nan"])
def test_a_bad_file_is_ignored_with_a_warning(tmp_path, caplog, content):
    store = StepCostStore(tmp_path, KEY)
    store.path.parent.mkdir(parents=True, exist_ok=True)
    store.path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="specstep.spec"):
        result = run(store)
    assert not result.core.policy.prior_loaded
    assert "ignoring the stored step costs" in caplog.text
    assert result.core.policy.reasons["explore"] > 3  # a cold start, as without a file
    json.loads(store.path.read_text())  # and the run wrote a good file over it


def test_engine_keeps_its_costs_in_the_user_cache(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTEP_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECSTEP_STEP_COSTS")  # (tests keep theirs apart: tests/conftest.py)
    assert store_folder() == cache_root() / "step_costs" == tmp_path / "step_costs"
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    core = make_core(tiny_target, spec="ngram", spec_policy="adaptive", overlap=False)
    assert not core.policy.prior_loaded
    run_to_completion(core, [list(range(5, 20))] * 2, params)
    core.close()
    files = list((tmp_path / "step_costs").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["spec"] == "ngram"
    again = make_core(tiny_target, spec="ngram", spec_policy="adaptive", overlap=False)
    assert again.policy.prior_loaded
    again.close()
    monkeypatch.setenv("SPECSTEP_STEP_COSTS", str(tmp_path / "elsewhere"))
    assert store_folder() == tmp_path / "elsewhere"
    fixed = make_core(tiny_target, spec="ngram", spec_policy="fixed", overlap=False)
    assert fixed.policy.store is None


def test_acceptance_prior_is_kept_per_sampling_kind():
    pol = AdaptivePolicy(adaptive("mtp"))
    greedy, sampled = RequestAcceptance(), RequestAcceptance(sampled=True)
    for _ in range(40):
        pol.observe_request(greedy, 4, 4)
        pol.observe_request(sampled, 4, 0)
    fresh_greedy, fresh_sampled = RequestAcceptance(), RequestAcceptance(sampled=True)
    assert pol.acceptance_estimate(fresh_greedy) > 0.8
    assert pol.acceptance_estimate(fresh_sampled) < 0.2
