"""The throughput model's choice, computed for every candidate k at once, against its per-k definition.

`ThroughputModel.options` evaluates all k from one gains table, and n-gram's greedy request set (`_by_gain`)
keeps its predicted cost as running sums instead of predicting each trial set from its array. The definition
below is the former form: for each k on its own, every trial predicted by `StepCosts.predict`. Both must agree
exactly on random states of every cost shape the engine builds, including costs measured for some k only (an
unmeasured step on the way makes the whole option unmeasured) and ties in gain (numpy's order decides).
"""

from __future__ import annotations

import numpy as np
import pytest

from specstep.scheduler.spec.config import PolicyConfig
from specstep.scheduler.spec.costs import StepCosts
from specstep.scheduler.spec.governor import Governor
from specstep.scheduler.spec.throughput import ThroughputModel, chain_sums


def option_by_definition(model: ThroughputModel, k: int, alpha, auto, forced, room, b, threshold, force_all):
    """(drafts, cost, tokens) of the best request set drafting k, or None if unmeasured."""
    kk = np.minimum(k, room)
    chain = chain_sums(alpha, max(int(kk.max(initial=0)), int(forced.max(initial=0))))
    lane = np.arange(len(alpha))
    gain = np.where(auto, chain[lane, kk] - 1.0, 0.0)
    fixed_gain = float((chain[lane, forced] - 1.0)[~auto].sum())
    want = auto & (kk > 0) & ((gain >= threshold) | force_all)
    if model.cfg.keeps_draft_kv or k == 0:
        nd = np.where(want, kk, forced) if k > 0 else forced
        cost = model.costs.predict(b, nd, model.refill(nd))
    else:
        nd = forced.copy()
        tokens = b + fixed_gain
        cost = model.costs.predict(b, nd, False)
        if cost is None:
            return None
        for i in np.argsort(-gain):  # by gain
            if not want[i]:
                continue
            trial = nd.copy()
            trial[i] = kk[i]
            c = model.costs.predict(b, trial, False)
            if c is None:
                return None
            if force_all or (tokens + gain[i]) / c > tokens / cost:
                nd, cost, tokens = trial, c, tokens + float(gain[i])
    if cost is None or cost <= 0:
        return None
    return nd, cost, b + fixed_gain + float(gain[(nd > 0) & auto].sum())


def measured_model(shape: str, keeps_draft_kv: bool, rng: np.random.Generator, b: int) -> ThroughputModel:
    """A model whose costs measured plain decoding (maybe not) and a random subset of k, maybe none (rows: per-row
    marginals that vary with k, some negative from noise, so the widest lane's k decides the row price; lanes:
    costs not monotone in k, as noise leaves them)."""
    rows = shape == "rows"
    cfg = PolicyConfig(k_max=6, cost_shape=shape, keeps_draft_kv=keeps_draft_kv, can_drop_refill=keeps_draft_kv)
    costs = StepCosts(cfg.cost_decay, shape)
    t0 = 0.004 + 0.0002 * b
    for _ in range(3 if rng.random() < 0.9 else 0):
        costs.observe(b, np.zeros(b, np.int64), False, t0 * rng.uniform(0.95, 1.05))
    for k in rng.permutation(np.arange(1, 7))[: int(rng.integers(0, 7))]:
        nd = np.zeros(b, np.int64)
        nd[: int(rng.integers(1, b + 1))] = k
        seconds = t0 + (rng.uniform(-0.00005, 0.0006) * nd.sum() if rows else rng.uniform(0.0, 0.0008) * k)
        costs.observe(b, nd, keeps_draft_kv, seconds)
    return ThroughputModel(cfg, costs, Governor(cfg.governor))


# (cost shape, keeps_draft_kv): n-gram's eager verify, model proposers, n-gram with captured graphs (`build.py`)
@pytest.mark.parametrize("shape,keeps_draft_kv", [("rows", False), ("lanes", True), ("lanes", False)])
def test_options_match_each_k_evaluated_alone(shape, keeps_draft_kv):
    rng = np.random.default_rng(7)
    compared = measured = 0
    for trial in range(400):
        b = int(rng.choice([1, 2, 3, 5, 8, 17, 40]))
        model = measured_model(shape, keeps_draft_kv, rng, b)
        # Few distinct acceptances: tied gains, whose order decides who drafts when only some pay.
        alpha = rng.choice(rng.uniform(0, 1, 3), size=b)
        auto = rng.random(b) < 0.85
        forced = np.where(auto, 0, rng.integers(0, 4, b))
        room = rng.integers(0, 9, b)
        threshold = rng.choice([0.0, 0.3, 0.195], size=b)
        force_all = bool(rng.random() < 0.2)
        ks = list(model.cfg.ks)
        got = model.options(ks, alpha, auto, forced, room, b, threshold, force_all)
        assert len(got) == len(ks)
        for k, d in zip(ks, got):
            want = option_by_definition(model, k, alpha, auto, forced, room, b, threshold, force_all)
            compared += 1
            if want is None:
                assert d is None, (trial, k)
                continue
            measured += 1
            nd, cost, tokens = want
            assert d is not None, (trial, k)
            np.testing.assert_array_equal(d.num_draft, nd)
            assert d.k == int(nd.max(initial=0))
            assert d.refill == model.refill(nd)
            assert d.expected_cost == cost  # the same arithmetic, not just close
            assert d.expected_tokens == tokens
            assert d.reason == "model" and d.auto is auto
    assert measured > compared // 3 and compared - measured > 50  # both outcomes exercised


def test_row_cost_is_the_price_predict_charges():
    rng = np.random.default_rng(3)
    model = measured_model("rows", False, rng, 4)
    t0 = model.costs.plain(4, False)
    for k in range(1, 7):
        m = model.costs.row_cost(4, k, False, t0)
        nd = np.array([k, 0, 1, k])  # the widest lane drafts k: its price per row
        want = model.costs.predict(4, nd, False)
        assert (m is None) == (want is None)
        if m is not None:
            assert m >= 0 and t0 + m * (2 * k + 1) == want


def test_total_samples_count_every_bucket():
    costs = StepCosts(0.9, "lanes")
    rng = np.random.default_rng(0)
    for _ in range(300):
        b, k, refill = int(rng.integers(1, 300)), int(rng.integers(0, 4)), bool(rng.random() < 0.5)
        costs.observe(b, np.full(b, k), refill, 0.01)
    for k in range(4):
        for refill in (False, True):
            want = sum(s.count for (_, kk, r), s in costs.seen.items() if kk == k and r == refill)
            assert costs.total_samples(k, refill) == want > 0
