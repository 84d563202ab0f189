"""Probes: speculating on purpose to re-measure acceptance where the model's choice would not draft.

Per request: one that has not drafted for its probe interval drafts so its acceptance estimate can recover; a
probe that did not pay backs off (probe_every doubling to probe_max). Inside a speculating step that is a few
more verify rows; when nobody speculates it is a whole speculative step and a catch-up. The governor's probe
while off: everyone at the best k that could pay (else the best k the model sees). A probe from plain decoding
drafts with a subset of lanes when catching up every stale draft would cost more than the probe can tell.

Every probe is priced by the host's measured costs (`payback.Payback`): it drafts only at a k that could pay back
at the acceptance its evidence still allows (the upper bound, the evidence ageing while it does not draft), none
wider than the first k not measured yet, and waits where none could: where verify is dear, a request that
accepted nothing probes rarely.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from specstep.scheduler.spec.decision import Decision, PendingEffects, RequestAcceptance
from specstep.scheduler.spec.payback import Payback, acceptance_upper, aged_upper
from specstep.scheduler.spec.throughput import Lanes, ThroughputModel, rate

if TYPE_CHECKING:
    from specstep.scheduler.spec.config import PolicyConfig

PROBE_CATCH_UP = 0.5  # the catch-up a probe from plain decoding may spend, in plain steps (one lane at least)


class Probes:
    def __init__(self, cfg: PolicyConfig, model: ThroughputModel) -> None:
        self.cfg = cfg
        self.model = model
        self.payback = Payback(model)
        self.since_probe = 0  # steps since auto requests last drafted (the global probe clock)
        self.catch_up_rate: float | None = None  # seconds per token a stale draft catches up (EMA)
        self.lanes_seen = [0, 0]  # this step's probing lanes and their accepted drafts (`saw`)

    @property
    def probe_max(self) -> int:
        return self.cfg.probe_max or (16 if self.cfg.cost_shape == "rows" else 64)

    # ---- measurements ----------------------------------------------------------------------------------------
    def saw(self, num_accepted: int) -> None:
        """A probing lane of this step came back with `num_accepted` accepted drafts."""
        self.lanes_seen[0] += 1
        self.lanes_seen[1] += num_accepted

    def take_seen(self) -> tuple[int, int]:
        """The step's probing lanes and their accepted drafts, counted afresh from the next step."""
        probed, accepted = self.lanes_seen
        self.lanes_seen = [0, 0]
        return probed, accepted

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            r = seconds / tokens
            self.catch_up_rate = r if self.catch_up_rate is None else 0.8 * self.catch_up_rate + 0.2 * r

    def commit(self, reset: bool | None) -> None:
        """The probe clock: reset (True), advanced (False), kept (None)."""
        if reset is not None:
            self.since_probe = 0 if reset else self.since_probe + 1

    # ---- the governor's probe ------------------------------------------------------------------------------
    def upper(self, acc: RequestAcceptance, kind_acc: dict[bool, RequestAcceptance] | None) -> float:
        """A request's acceptance upper bound, its evidence aged by its idle steps; with no evidence of its own,
        that of the requests of its sampling kind, aged by the steps since anyone drafted."""
        if acc.trials > 0 or kind_acc is None:
            return aged_upper(acc, acc.idle_steps, self.probe_max)
        return aged_upper(kind_acc[acc.sampled], self.since_probe, self.probe_max)

    def governor_probe(self, b: int, ln: Lanes, behind: np.ndarray | None, global_acc: RequestAcceptance) -> Decision:
        """The governor's probe while off: everyone at the best k among those that could pay back at the
        batch-wide acceptance's upper bound (n-gram pays per row: the smallest k is enough to see whether
        acceptance came back), a subset of lanes when catch-up is dear. Where none could, at the best k the model
        sees: this is the floor's own way back, and the governor bounds its cost by epsilon."""
        model = self.model
        probe_ks = [k for k in model.allowed_ks(b, ln.forced) if k > 0]
        payable = self.payback.payable(b, probe_ks, acceptance_upper(global_acc.accepted, global_acc.trials))
        probe_ks = payable or probe_ks
        if self.cfg.cost_shape == "rows":
            probe_ks = probe_ks[:1]
        forced_all = [d for d in model.options(probe_ks, ln.alpha, ln.auto, ln.forced, ln.room, b, ln.threshold,
                                               force_all=True) if d is not None and d.num_draft[ln.auto].any()]
        if not forced_all:
            return model.decision(ln.forced, ln.auto, "off")
        p = max(forced_all, key=rate)
        lanes = self.lanes(b, ln.auto & (p.num_draft > 0), behind)
        return model.decision(np.where(ln.auto & ~lanes, 0, p.num_draft), ln.auto, "probe", p.expected_tokens,
                              p.expected_cost, probing=lanes)

    # ---- per-request probes --------------------------------------------------------------------------------
    def with_probes(self, accs: list[RequestAcceptance], best: Decision, b: int, ln: Lanes,
                    behind: np.ndarray | None, prior: float, px: PendingEffects,
                    kind_acc: dict[bool, RequestAcceptance] | None = None) -> Decision:
        """The model's choice plus per-request probes (`prior`: the batch-wide acceptance a probed request is
        tried at). When nobody speculates a probe is a whole speculative step and a catch-up: the governor judges
        such steps, and once off it rate-limits them to epsilon."""
        nd, auto = best.num_draft, ln.auto
        speculating = bool(nd[auto].any())
        due = self.due(accs, nd, ln, speculating, px)
        payable: list[int] | None = None
        if due.any():
            hi = np.array([self.upper(accs[i], kind_acc) for i in np.flatnonzero(due)])
            ks = [k for k in self.model.allowed_ks(b, ln.forced) if k > 0 and (not speculating or k <= best.k)]
            payable = self.payback.payable(b, ks, hi)
            if not payable:  # none could pay: wait (the evidence ages), the intervals as they are
                due[:] = False
        if due.any() and not speculating:  # a whole probe step: a subset of lanes speaks for the others
            lanes = self.lanes(b, due, behind)
            for i in np.flatnonzero(due & ~lanes):  # covered by this probe: backed off as after a failed one
                # (were it to pay, the acceptance it measures moves theirs too)
                interval = px.acceptance[i][2] if i in px.acceptance else accs[i].probe_interval
                px.acceptance[i] = (accs[i], 0, min(2 * interval, self.probe_max))
            due = lanes
        probing = np.zeros(b, dtype=bool)
        k1 = self.probe_k(b, due, prior, ln, payable) if due.any() else 0
        if due.any() and k1:
            px.probe_clock_reset = True
            probing = due
            nd = np.where(due, min(k1, best.k) if speculating else k1, nd)
        nd = np.minimum(nd, np.where(auto, ln.room, nd))
        reason = "probe" if probing.any() and not speculating else "model"
        return self.model.decision(nd, auto, reason, best.expected_tokens, best.expected_cost, probing)

    def intervals(self, accs: list[RequestAcceptance]) -> list[int]:
        """Each request's probe interval as `due` reads it: its own, at least probe_every, at most probe_max."""
        probe_max = self.probe_max
        return [min(max(a.probe_interval, self.cfg.probe_every), probe_max) for a in accs]

    def steps_to_due(self, accs: list[RequestAcceptance]) -> int:
        """Steps before the first of `accs` that is not due yet comes due for its probe, by the clocks alone (under
        the latency objective the probe clock's spacing too); <= 0 where none is ahead (a request due already waits
        for its evidence to age, or for room)."""
        gate = self.cfg.governor.probe_every - (self.since_probe + 1) if self.cfg.objective == "latency" else 0
        ahead = [t for t in (max(n - a.idle_steps, gate) for a, n in zip(accs, self.intervals(accs))) if t > 0]
        return min(ahead, default=0)

    def due(self, accs: list[RequestAcceptance], nd: np.ndarray, ln: Lanes, speculating: bool,
            px: PendingEffects) -> np.ndarray:
        """Requests whose per-request probe is due (idle for their interval); none under the latency objective
        within epsilon's spacing of the last probe while nobody speculates."""
        cfg = self.cfg
        intervals = self.intervals(accs)
        for i, (a, interval) in enumerate(zip(accs, intervals)):
            if interval != a.probe_interval:
                px.acceptance[i] = (a, None, interval)
        eligible = ln.auto & (nd == 0) & (ln.room > 0)
        due = np.array([a.idle_steps >= n for a, n in zip(accs, intervals)], dtype=bool) & eligible
        if cfg.cost_shape == "lanes" and due.any() and not speculating:
            # Every lane pays a model proposer's draft loop and refill once one drafts, so every lane joins the
            # probe that is due: the batch's probes share steps instead of each request taking its own (four
            # requests probing in turn made four times the probe steps: 0.94x plain after an acceptance drop).
            due = eligible
        px.probe_clock_reset = speculating
        since_probe = 0 if speculating else self.since_probe + 1
        # The latency objective also keeps them to epsilon of the steps while on (each may exceed the budget).
        limited = cfg.objective == "latency" and since_probe < cfg.governor.probe_every
        if not speculating and limited:
            due[:] = False
        return due

    def probe_k(self, b: int, due: np.ndarray, prior: float, ln: Lanes, payable: list[int] | None = None) -> int:
        """The k a probe drafts, among those that could pay back (`payable`, cheapest first and none past the
        first unmeasured one): the best one for the probed requests if their acceptance were the batch-wide
        estimate (a refill's fixed cost, or n-gram's dear first draft row, can make one draft the dearest per token
        learned)."""
        trial = np.where(due, prior, ln.alpha)
        best, best_rate = 0, 0.0
        ks = [k for k in self.model.allowed_ks(b, ln.forced) if k > 0 and (payable is None or k in payable)]
        for k, d in zip(ks, self.model.options(ks, trial, due, ln.forced, ln.room, b, ln.threshold, force_all=True)):
            if d is not None and rate(d) > best_rate:
                best, best_rate = k, rate(d)
        return best

    def lanes(self, b: int, cand: np.ndarray, behind: np.ndarray | None) -> np.ndarray:
        """The lanes a probe from plain decoding drafts with: every candidate whose draft is current (n-gram, or
        nothing skipped); else those that catch up cheapest, as many as PROBE_CATCH_UP of a plain step's time buys
        (at least one; four while the catch-up rate is unknown). Catching up every lane of a large batch cost a
        fraction (batch x rate / plain step) of all the off time, whatever the probe interval."""
        if behind is None or not (cand & (behind > 0)).any():
            return cand
        order = [i for i in np.argsort(behind, kind="stable") if cand[i]]
        plain, r = self.model.plain_seconds(b), self.catch_up_rate
        chosen = np.zeros_like(cand)
        spent = 0.0
        for n, i in enumerate(order):
            cost = float(behind[i]) * (r or 0.0)
            if n > 0 and (spent + cost > PROBE_CATCH_UP * plain if r and plain else n >= 4):
                break
            chosen[i], spent = True, spent + cost
        return chosen
