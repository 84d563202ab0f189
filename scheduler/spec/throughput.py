"""The choice by expected tokens per second: which requests draft how many tokens, from acceptance and step costs.

A request with per-position acceptance alpha_i drafting a chain of k emits in expectation
    E_i(k) = 1 + alpha_i + alpha_i^2 + ... + alpha_i^k        tokens per step (the bonus counted),
and a step whose lanes draft n_i costs C(n) (`costs.StepCosts`). The model ranks a request set and its k by
    (B + sum_i (E_i(n_i) - 1)) / C(n).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from specstep.scheduler.spec.costs import StepCosts, bucket
from specstep.scheduler.spec.decision import Decision
from specstep.scheduler.spec.governor import Governor

if TYPE_CHECKING:
    from specstep.scheduler.spec.config import PolicyConfig


def chain_sums(alpha: np.ndarray, k_max: int) -> np.ndarray:
    """[B, k_max + 1]: entry (i, k) = E_i(k) = 1 + a_i + a_i^2 + ... + a_i^k."""
    return np.cumsum(np.power.outer(np.asarray(alpha, dtype=np.float64), np.arange(k_max + 1)), axis=-1)


def expected_tokens(alpha: np.ndarray, k: int | np.ndarray) -> np.ndarray:
    """E_i(k) elementwise (k: one for all, or one per request)."""
    alpha = np.atleast_1d(np.asarray(alpha, dtype=np.float64))
    k = np.broadcast_to(np.asarray(k, dtype=np.int64), alpha.shape)
    return chain_sums(alpha, int(k.max(initial=0)))[np.arange(len(alpha)), k]


def rate(d: Decision) -> float:
    return d.expected_tokens / d.expected_cost


@dataclass(frozen=True, slots=True)
class Lanes:
    """One decision's per-request inputs: who the policy decides for, what fixed-k requests draft, the room each
    has, the acceptance estimates and the inclusion thresholds."""

    auto: np.ndarray
    forced: np.ndarray
    room: np.ndarray
    alpha: np.ndarray
    threshold: np.ndarray


class ThroughputModel:
    """Expected tokens per second of the candidate steps, from the live cost model; reads the governor only for
    its plain baseline. Stateless itself: everything it knows is in `costs` and `governor`."""

    def __init__(self, cfg: PolicyConfig, costs: StepCosts, governor: Governor) -> None:
        self.cfg = cfg
        self.costs = costs
        self.governor = governor

    def refill(self, nd: np.ndarray) -> bool:
        """Whether a step drafting `nd` refills the proposer: only a step in which nobody drafts may skip it."""
        if not self.cfg.keeps_draft_kv:
            return False
        return bool(nd.any()) or not self.cfg.can_drop_refill

    @property
    def plain_refill(self) -> bool:
        return self.refill(np.zeros(1, np.int64))

    def plain_seconds(self, b: int) -> float | None:
        """A plain step at batch b: the governor's own recent median, else the cost model's estimate."""
        return self.governor.plain(bucket(b)) or self.costs.plain(b, self.plain_refill)

    def break_even(self, b: int, k: int, refill: bool) -> float | None:
        """Accepted drafts a lane drafting k needs to pay for its share of the step's overhead over plain, were
        every lane to draft (lanes: t(B, k) / t(B, 0) - 1; rows: its k verify rows over its share of t(B, 0))."""
        plain = self.plain_seconds(b)
        if not plain or k <= 0:
            return None
        cost = self.costs.predict(b, np.array([k]), refill)
        if cost is None:
            return None
        return (cost - plain) / plain * (b if self.cfg.cost_shape == "rows" else 1)

    def decision(self, nd: np.ndarray, auto: np.ndarray, reason: str, tokens: float = 0.0, cost: float = 0.0,
                 probing: np.ndarray | None = None) -> Decision:
        probing = probing if probing is not None else np.zeros(len(nd), dtype=bool)
        refill = self.refill(nd)
        speculating = bool((nd[auto & ~probing] > 0).any())
        # A probe from plain decoding catches up only the lanes that draft; a speculating step all of them.
        catch_up = (nd > 0) if probing.any() and not speculating else None
        k = int(nd.max(initial=0))
        return Decision(nd, k, refill, tokens, cost, reason, auto, probing, catch_up,
                        self.break_even(len(nd), k, refill) if probing.any() else None)

    def budget_ok(self, b: int, nd: np.ndarray, refill: bool) -> bool:
        """The latency objective: a speculative step may take at most `itl_budget` plain steps (unmeasured: yes)."""
        if self.cfg.objective != "latency" or not nd.any():
            return True
        cost = self.costs.predict(b, nd, refill)
        plain = self.costs.plain(b, self.plain_refill)
        return cost is None or plain is None or cost <= self.cfg.itl_budget * plain

    def allowed_ks(self, b: int, forced: np.ndarray) -> list[int]:
        """Candidate k for the auto requests (the latency objective drops those over the ITL budget)."""
        if self.cfg.objective != "latency":
            return list(self.cfg.ks)
        ks = []
        for k in self.cfg.ks:
            nd = np.maximum(forced, k)
            if k == 0 or self.budget_ok(b, nd, self.refill(nd)):
                ks.append(k)
        return ks

    def best(self, b: int, ln: Lanes, current_k: int) -> Decision | None:
        """The model's best k by tokens per second, kept at `current_k` unless better by `margin`."""
        options = [d for d in self.options(self.allowed_ks(b, ln.forced), ln.alpha, ln.auto, ln.forced, ln.room, b,
                                           ln.threshold) if d is not None]
        if not options:
            return None
        best = max(options, key=rate)
        current = next((d for d in options if d.k == current_k), None)
        if current is not None and best is not current and rate(best) / rate(current) < 1 + self.cfg.margin:
            best = current
        return best

    def options(self, ks: list[int], alpha: np.ndarray, auto: np.ndarray, forced: np.ndarray, room: np.ndarray,
                b: int, threshold: np.ndarray, force_all: bool = False) -> list[Decision | None]:
        """For each k in `ks`: the best request set drafting k (with the fixed-k requests' drafts), or None if
        unmeasured. Every k's gains come from one table (rows: k; columns: requests): the decision runs every
        step, and a few numpy calls per k cost more than the whole choice at small batches."""
        if not ks:
            return []
        kk = np.minimum(np.asarray(ks, dtype=np.int64)[:, None], room)  # [K, B]: what request i drafts at k
        # E_i(j) for every j at once (the chain sums), then each request's entries
        chain = chain_sums(alpha, max(int(kk.max(initial=0)), int(forced.max(initial=0))))
        lane = np.arange(len(alpha))
        gain = np.where(auto, chain[lane, kk] - 1.0, 0.0)  # [K, B]: extra tokens if request i drafts k
        fixed_gain = float((chain[lane, forced] - 1.0)[~auto].sum())
        want = auto & (kk > 0) & ((gain >= threshold) | force_all)
        out: list[Decision | None] = []
        for j, k in enumerate(ks):
            if self.cfg.keeps_draft_kv or k == 0:
                # A model proposer's draft loop runs over every lane once anyone drafts: a speculating step costs
                # about t(B, k) however few requests draft. So it is all requests worth a draft at k, or nobody.
                nd = np.where(want[j], kk[j], forced) if k > 0 else forced
                refill = self.refill(nd)
                cost = self.costs.predict(b, nd, refill)
                widest = int(nd.max(initial=0))
            else:
                chosen = self._by_gain(b, forced, kk[j], gain[j], want[j], b + fixed_gain, force_all)
                if chosen is None:
                    out.append(None)
                    continue
                nd, cost, widest = chosen
                refill = self.refill(nd)
            # (summed over the drafting lanes in lane order, as it always was: not the greedy loop's running sum)
            tokens = b + fixed_gain + float(gain[j][(nd > 0) & auto].sum())
            out.append(None if cost is None or cost <= 0 else
                       Decision(nd, widest, refill, tokens, cost, "model", auto))
        return out

    def _by_gain(self, b: int, forced: np.ndarray, kk: np.ndarray, gain: np.ndarray, want: np.ndarray,
                 tokens: float, force_all: bool) -> tuple[np.ndarray, float, int] | None:
        """N-gram pays per verify row: add requests in order of gain while each improves tokens per second (all of
        `want` with force_all); the drafts, their predicted cost and widest lane, None if a step on the way is
        unmeasured. A step's predicted cost depends only on its widest lane's k and, in the rows shape, its draft
        rows (`StepCosts.predict`): it is kept as running sums, priced once per k (a step of batch B tries B sets,
        and predicting each from its array cost O(B) numpy calls)."""
        costs, rows_shape = self.costs, self.costs.shape == "rows"
        t0 = costs.plain(b, False)  # predict's price of a step in which nobody drafts, in both shapes
        if rows_shape and t0 is None:
            return None
        price: dict[int, float | None] = {}  # widest k -> seconds per draft row (rows), per step (lanes)

        def cost(k: int, rows: int) -> float | None:
            if k == 0:
                return t0
            if k not in price:
                price[k] = costs.row_cost(b, k, False, t0) if rows_shape else costs.predict(b, np.array([k]), False)
            p = price[k]
            return None if p is None else (t0 + p * rows if rows_shape else p)

        nd = forced.tolist()
        rows, widest = sum(nd), max(nd, default=0)
        base = cost(widest, rows)
        if base is None:
            return None
        g, kl, w = gain.tolist(), kk.tolist(), want.tolist()
        for i in np.argsort(-gain).tolist():  # (the order of ties is numpy's: the same decisions as before)
            if not w[i]:
                continue
            trial = cost(max(widest, kl[i]), rows - nd[i] + kl[i])
            if trial is None:
                return None
            if force_all or (tokens + g[i]) / trial > tokens / base:
                rows, widest, nd[i] = rows - nd[i] + kl[i], max(widest, kl[i]), kl[i]
                base, tokens = trial, tokens + g[i]
        return np.array(nd, dtype=np.int64), base, widest
