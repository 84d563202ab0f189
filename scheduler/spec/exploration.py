"""Measurements that stay true: explore each k before the cost model is trusted, then re-measure the stalest.

Before the cost model is trusted each runnable k is measured `explore_samples` times (plain: `plain_samples` times
per bucket); after that, in every bucket, one step in `remeasure_every` re-measures the stalest other candidate
(plain decoding included), so costs follow context length and machine load. Choosing only reads this state; what
a decision would change travels in its `Effects` and is applied by `commit` when its step runs.

Exploration goes from the cheapest k up and stops at the first k that could not pay back at the acceptance the
evidence allows (`payback.Payback`, priced at the widest k measured below it): on a host where verify grows
steeply with rows, a k = 1 step that accepted nothing keeps k = 2..4 from being tried at all. A larger k is
explored later, once acceptance makes it plausible.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING

import numpy as np

from specstep.scheduler.spec.costs import StepCosts, bucket
from specstep.scheduler.spec.decision import Effects, PendingEffects, RequestAcceptance
from specstep.scheduler.spec.payback import Payback, acceptance_upper
from specstep.scheduler.spec.throughput import ThroughputModel

if TYPE_CHECKING:
    from specstep.scheduler.spec.config import PolicyConfig


class Exploration:
    def __init__(self, cfg: PolicyConfig, costs: StepCosts, model: ThroughputModel) -> None:
        self.cfg = cfg
        self.costs = costs
        self.model = model
        self.payback = Payback(model)
        self.tries: Counter[int] = Counter()  # k > 0: tries of k; -bucket: tries of plain in it
        self.next_remeasure: dict[int, int] = {}  # bucket -> its step counter at the next re-measurement
        self.unobserved: deque[int | None] = deque()  # decisions not yet observed: the k each explores (or None)

    def unmeasured(self, b: int, forced: np.ndarray, room: np.ndarray, auto: np.ndarray,
                   px: PendingEffects, evidence: RequestAcceptance | None = None) -> int | None:
        """What to measure before trusting the cost model: plain decoding three times in this bucket (one noisy
        sample misled both the model and the governor) (when a fixed-k
        request does not make it impossible), then each runnable k a few times in some bucket (cost ratios
        carry over between buckets). The latency objective stops at the first k over its budget."""
        n = self.cfg.explore_samples
        kf = int(forced.max(initial=0))
        # (Tries, not samples, bound it: with overlap the next step is decided before this one ends.)
        n0 = self.cfg.plain_samples
        if kf == 0 and self.costs.samples(b, 0, self.model.plain_refill) < n0 and self.tries[-bucket(b)] < n0:
            px.explore_key = -bucket(b)
            return 0
        if not (auto & (room > 0)).any():
            return None  # no auto request can draft: nothing this batch could measure
        ks = [k for k in self.cfg.ks if k > 0 and k >= kf]
        # A step still in flight (overlap: decided before the last one was read back) counts as measured; n-gram may
        # draft less than asked: tries bound it too, so it does not insist for ever.
        pending = self.unobserved[-1] if self.unobserved else None
        first = next((k for k in ks if self.costs.total_samples(k, self.cfg.keeps_draft_kv) + (pending == k) < n
                      and self.tries[k] < 3 * n), None)
        if first is None:
            return None  # every k measured: no need to price any (the common case, every step once warm)
        hi = 1.0 if evidence is None else acceptance_upper(evidence.accepted, evidence.trials)
        for k in ks:
            if not self.payback.can_pay(b, k, hi):
                break  # nor any wider k: cheapest first
            if k == first:
                px.explore_key = k
                return k
            if self.cfg.objective == "latency" and not self.model.budget_ok(
                    b, np.maximum(forced, k), self.model.refill(np.ones(1, np.int64))):
                break
        return None

    def explore(self, k: int, auto: np.ndarray, forced: np.ndarray, room: np.ndarray) -> np.ndarray:
        """What each request drafts to measure k: every auto request, or one where k is a marginal per row."""
        who = auto.copy()
        if self.cfg.cost_shape == "rows" and k > 0:  # a marginal per row: one request measures it
            who[:] = False
            who[int(np.argmax(auto & (room > 0)))] = True
        return np.where(who, np.minimum(k, room), forced)

    def stale(self, b: int, forced: np.ndarray, chosen: int, bucket_steps: int, px: PendingEffects) -> int | None:
        """One step in `remeasure_every` per bucket: the candidate measured longest ago, if not the chosen one
        (`bucket_steps`: the steps the bucket has run)."""
        bk = bucket(b)
        now = bucket_steps + 1  # this decision's step counted
        due_at = self.next_remeasure.get(bk)
        if due_at is None:
            due_at = now + self.cfg.remeasure_every
            px.next_remeasure = (bk, due_at)
        if now < due_at:
            return None
        px.next_remeasure = (bk, now + self.cfg.remeasure_every)
        kf = int(forced.max(initial=0))
        keys = [k for k in self.model.allowed_ks(b, forced)
                if k != chosen and (k >= kf or k == 0) and not (k == 0 and kf)]
        if not keys:
            return None

        def last(k: int) -> int:
            return self.costs.last_step(b, k, self.model.refill(np.full(1, k)))
        k = min(keys, key=last)
        return k if now - last(k) >= self.cfg.remeasure_every else None

    def commit(self, k_explored: int | None, fx: Effects | None) -> None:
        """A decision's step runs (`k_explored`: the k it explores, else None)."""
        self.unobserved.append(k_explored)
        if fx is None:
            return
        if fx.explore_key is not None:
            self.tries[fx.explore_key] += 1
        if fx.next_remeasure is not None:
            self.next_remeasure[fx.next_remeasure[0]] = fx.next_remeasure[1]

    def observed(self) -> None:
        """The oldest step in flight was read back."""
        if self.unobserved:
            self.unobserved.popleft()
