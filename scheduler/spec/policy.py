"""Knowing when to stop betting: choose k per step and per request from measured acceptance and step costs.

For request i with per-position acceptance alpha_i, a chain of k drafts emits in expectation
    E_i(k) = 1 + alpha_i + alpha_i^2 + ... + alpha_i^k        tokens per step (the bonus counted).
A step whose lanes draft n_i tokens costs C(n), measured live (`costs.StepCosts`: t(B, k) per lane layout
for model proposers and graphs, t(B, 0) + m * sum(n) for n-gram's ragged verify). The policy maximises
expected tokens per second of device time,
    (B + sum_i (E_i(n_i) - 1)) / C(n),
over k among the candidates and the set of requests that draft k: model proposers run the draft loop over
every lane once anyone drafts, so it is everyone worth a draft or nobody; n-gram adds requests in order of
gain while each improves the ratio. Hysteresis: the batch's k changes only when the new choice is expected
to beat the current one by `margin`.

"Off" is plain decoding for every proposer: a step in which nobody drafts drops the proposer's refill, and
the draft model (or MTP head, from the target hidden states it kept) catches up on the skipped tokens in
the step that resumes speculating; that catch-up is charged to the step that pays it.

Measurements that stay true: each step's cost is recorded under the k it actually drafted; before the cost
model is trusted each runnable k is measured `explore_samples` times (plain: `plain_samples` times per
bucket); after that, in every bucket, one step in `remeasure_every` re-measures the stalest other candidate
(plain decoding included), so costs follow context length and machine load.

The floor: `governor.Governor` watches the realised throughput of speculative steps against plain
decoding and switches speculation off when it is confidently below (1 - delta) of plain; while off, only
probes (at most a fraction epsilon of steps, and of the off time) speculate. The loss against plain is bounded by
about delta while on plus epsilon while off (defaults 0.02 each), under the assumptions the governor's docstring
states (stationary plain cost and acceptance over its windows, a probe's catch-up small against its budget).

Objectives: `throughput` maximises tokens per second; `latency` only allows speculative steps expected to take
at most `itl_budget` times a plain step (a step's duration is the gap between a stream's messages, so this
bounds p99 inter-token latency), explores no k past the first that breaks the budget, and probes rarely.

Carried over: the step costs, across runs, per (model, proposer, host, kernel plan), as a prior
(`cost_store.StepCostStore`); the acceptance, across the requests an engine serves, per sampling kind (greedy
requests accept far more than sampled ones of the same model), as the prior a new request starts from.

Where each part lives: `throughput.ThroughputModel` (the choice by expected tokens per second),
`exploration.Exploration` (what to measure first, and re-measurement), `probes.Probes` (per-request and governor
probes), `plain_hold.PlainHold` (a plain choice reused while nothing it reads changes), `config.PolicyConfig`; this
class owns the measurements and composes them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np

from specstep.scheduler.spec.config import OBJECTIVES, PolicyConfig
from specstep.scheduler.spec.cost_store import StepCostStore
from specstep.scheduler.spec.costs import StepCosts, bucket
from specstep.scheduler.spec.decision import Decision, PendingEffects, RequestAcceptance
from specstep.scheduler.spec.exploration import Exploration
from specstep.scheduler.spec.governor import Governor
from specstep.scheduler.spec.plain_hold import PlainHold
from specstep.scheduler.spec.probes import PROBE_CATCH_UP, Probes
from specstep.scheduler.spec.throughput import Lanes, ThroughputModel, chain_sums, expected_tokens

__all__ = ["OBJECTIVES", "AdaptivePolicy", "PolicyConfig", "chain_sums", "expected_tokens"]


class AdaptivePolicy:
    """Owns the measurements (cost model, governor, acceptance) and composes the choice from the throughput model,
    exploration and probes; each of those reads what it is handed and writes only its own state, in `commit`."""

    PROBE_CATCH_UP = PROBE_CATCH_UP
    SAVE_EVERY = 256  # measured steps between writes of the cost store

    def __init__(self, cfg: PolicyConfig, store: StepCostStore | None = None) -> None:
        self.cfg = cfg
        self.costs = StepCosts(cfg.cost_decay, cfg.cost_shape)
        self.store = store if cfg.kind != "fixed" else None
        self.prior_loaded = self.store is not None and self.store.load(self.costs)
        self.observed = 0
        self.governor = Governor(cfg.governor)
        self.model = ThroughputModel(cfg, self.costs, self.governor)
        self.exploration = Exploration(cfg, self.costs, self.model)
        self.probes = Probes(cfg, self.model)
        self.hold = PlainHold()  # a plain choice reused while nothing it reads changes (plain_hold.py)
        self.current_k = cfg.k_max
        self.global_acc = RequestAcceptance()
        # ... and per sampling kind (sampled: True), the prior a new request of that kind starts from
        self.kind_acc = {False: RequestAcceptance(), True: RequestAcceptance()}
        # Acceptance of drafts by their lane's limit (what the proposer could draft before the decision): a long
        # n-gram match predicts its continuation far better than a short one (35% of first drafts accepted after
        # a 1-token match, 98% after 16 or more on held-out code), which one estimate per request averages away
        self.by_limit: dict[int, RequestAcceptance] = {}
        self.steps = 0
        self.bucket_steps: Counter[int] = Counter()
        self.reasons: Counter[str] = Counter()  # decisions by reason, for metrics

    # ---- measurements (no extra syncs: the host already read these back) ---------------------------------------
    def observe_request(self, acc: RequestAcceptance, num_draft: int, num_accepted: int, probe: bool = False,
                        break_even: float | None = None, limit: int | None = None) -> None:
        """A request's step. A probe backs off by whether it paid: whether speculating this request at its
        acceptance estimate, now updated, emits more than `break_even` extra tokens a step (its share of the
        step's overhead), not whether it accepted a token (one lucky token used to halve the interval, and a
        request whose acceptance fell went on probing a fifth of the steps)."""
        acc.update(num_draft, num_accepted, self.cfg.alpha_decay, probe)
        if num_draft > 0:
            self.hold.drop()
        if probe and num_draft > 0:
            if break_even is None:
                acc.back_off(num_accepted > 0)
            else:
                acc.back_off(float(expected_tokens(self.acceptance_estimate(acc), num_draft)[0]) - 1 >= break_even)
            self.probes.saw(num_accepted)
        if num_draft > 0:
            self.global_acc.update(num_draft, num_accepted, 0.98)
            self.kind_acc[acc.sampled].update(num_draft, num_accepted, 0.98)
            if limit is not None and limit > 0:
                self.by_limit.setdefault(limit, RequestAcceptance()).update(num_draft, num_accepted, 0.98)

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A stale draft consumed `tokens` skipped tokens in `seconds`: what the next probe's catch-up costs."""
        self.hold.drop()
        self.probes.observe_catch_up(tokens, seconds)

    @property
    def catch_up_rate(self) -> float | None:
        """Seconds per token a stale draft catches up (EMA; None until measured)."""
        return self.probes.catch_up_rate

    def observe_step(self, batch: int, num_draft: np.ndarray, refill: bool, seconds: float,
                     tokens: int | None = None, catch_up_s: float = 0.0, auto_drafted: bool = False,
                     timed: bool = True) -> None:
        """A finished step: its device seconds (body only), under what it really drafted; for the governor, the
        tokens it emitted and the catch-up it paid, when policy-chosen requests drafted in it. `timed` False: the
        decode rows of a fused mixed step, whose own cost cannot be told from the prompt chunks' (`seconds` is the
        predicted one): the governor judges the tokens against it, the step costs learn nothing."""
        num_draft = np.asarray(num_draft, dtype=np.int64)
        if num_draft.any():
            self.hold.drop()
        self.exploration.observed()
        probed, probe_acc = self.probes.take_seen()
        drafting = int((num_draft > 0).sum())
        # A probe of a subset of lanes speaks for the batch: what everyone would emit at the probed acceptance
        # (lanes shape: the step already costs what everyone drafting costs).
        subset = 0 < probed == drafting < batch and self.cfg.cost_shape == "lanes"
        judged_tokens = batch * (1.0 + probe_acc / probed) if subset else tokens
        b = bucket(batch)
        if timed:
            self.costs.observe(batch, num_draft, refill, seconds, self.bucket_steps[b])
        gov, plain_refill = self.governor, self.model.plain_refill
        if timed and not num_draft.any() and refill == plain_refill:
            gov.observe_plain(b, seconds)
        if auto_drafted and tokens is not None:
            # Judged against the governor's own recent plain steps; the model's estimate only until there are some.
            plain = gov.plain(b) or self.costs.plain(batch, plain_refill)
            if plain:
                if gov.on:
                    gov.observe(judged_tokens, batch * (seconds + catch_up_s) / plain)
                else:
                    # A probe asks what speculating would give from now on: its catch-up is the price of asking
                    # (the probe budget pays it), not a cost speculating would go on paying. It owes what it cost
                    # beyond the plain time of the tokens it emitted: a probe that paid owes nothing.
                    gov.owe(catch_up_s + seconds - plain * tokens / batch)
                    gov.observe(judged_tokens, batch * seconds / plain)
        gov.ran(seconds + catch_up_s)
        self.observed += 1
        if self.store is not None and self.observed % self.SAVE_EVERY == 0:
            self.store.save(self.costs)

    def close(self) -> None:
        """The engine stops: store what was measured (the next run starts from it)."""
        if self.store is not None and self.observed:
            self.store.save(self.costs)

    def acceptance_estimate(self, acc: RequestAcceptance, limit: int | None = None) -> float:
        """A request's per-position acceptance as the policy sees it: its own, pulled toward the global one; with
        the lane's limit known, the acceptance of drafts under that limit, pulled toward the request's own."""
        own = acc.alpha(self.kind_prior(acc))
        by = self.by_limit.get(limit) if limit else None
        return own if by is None else by.alpha(own, 2.0)

    def kind_prior(self, acc: RequestAcceptance) -> float:
        """Where a request's acceptance starts: its sampling kind's so far, pulled toward every request's."""
        return self.kind_acc[acc.sampled].alpha(self.global_acc.alpha(self.cfg.prior_alpha, 2.0), 2.0)

    @property
    def proposer_current(self) -> bool:
        """Should the proposer keep up with new prompts? Not while speculation is off (it catches up later)."""
        if self.cfg.kind == "fixed" or not self.cfg.can_drop_refill:
            return True
        return self.governor.on and self.current_k > 0

    @property
    def governor_state(self) -> str:
        if self.cfg.kind == "fixed" or not self.cfg.governor.enabled:
            return "disabled"
        return "on" if self.governor.on else "off"

    def plain_seconds(self, b: int) -> float | None:
        """A plain step at batch b: the governor's own recent median, else the cost model's estimate."""
        return self.model.plain_seconds(b)

    # ---- the decision -------------------------------------------------------------------------------------------
    def choose(self, accs: list[RequestAcceptance], overrides: list[int | None], room: np.ndarray,
               behind: np.ndarray | None = None, commit: bool = True, limits: np.ndarray | None = None) -> Decision:
        """accs: per-request acceptance; overrides: per-request fixed k (None = auto); room: max drafts each;
        behind: tokens each request's draft must catch up before it drafts (None: all current); limits: the drafts
        each lane's proposer would make now, where it knows (n-gram's lookup): they cap room, and its acceptance is
        the one measured under the same limit.

        commit=False has no side effects (on the policy, its governor, its cost model or `accs`): the decision
        carries what committing it applies (`Decision.effects`), and `commit` applies it when its step runs. A
        decision never committed changes nothing. commit=True is choose-then-commit. A committed plain choice is
        reused while nothing it reads changes (`plain_hold`)."""
        key = None if self.cfg.kind == "fixed" else self.hold.key(overrides, room, limits, self.cfg.k_max,
                                                                         self.governor.on)
        d = self.hold.reuse(accs, key, self.steps)
        if d is None:
            pending = PendingEffects()
            if limits is not None:
                limits = np.asarray(limits, dtype=np.int64)
                room = np.minimum(np.asarray(room, dtype=np.int64), limits)
            d = self._choose(accs, overrides, room, behind, pending, limits)
            d = replace(d, effects=pending.freeze(), limits=limits)
            if key is not None:
                probe_in = self.probes.steps_to_due(accs) if self.governor.on else self.governor.steps_to_probe()
                d = replace(d, hold=self.hold.ticket(key, d, accs, probe_in))
        if commit:
            self.commit(d)
        return d

    def commit(self, decision: Decision) -> None:
        """The decision's step runs: count it and apply its effects (call once per decision)."""
        self.hold.committed(decision, self.steps)
        self.steps += 1
        self.reasons[decision.reason] += 1
        fx = decision.effects
        self.exploration.commit(decision.k if decision.reason == "explore" else None, fx)
        if fx is None:
            return
        if fx.bucket is not None:
            self.bucket_steps[fx.bucket] += 1
        self.governor.commit_tick(fx.governor_counted, fx.governor_probe)
        if fx.current_k is not None:
            self.current_k = fx.current_k
        self.probes.commit(fx.probe_clock_reset)
        for acc, idle, interval in fx.acceptance:
            if idle is not None:
                acc.idle_steps = idle
            acc.probe_interval = interval

    def _choose(self, accs: list[RequestAcceptance], overrides: list[int | None], room: np.ndarray,
                behind: np.ndarray | None, px: PendingEffects, limits: np.ndarray | None = None) -> Decision:
        cfg, b, model = self.cfg, len(accs), self.model
        room = np.asarray(room, dtype=np.int64).clip(0)
        auto = np.array([o is None for o in overrides], dtype=bool)
        fixed_k = np.array([o or 0 for o in overrides], dtype=np.int64)
        if cfg.kind == "fixed":
            nd = np.minimum(np.where(auto, cfg.k_max, fixed_k), room)
            return Decision(nd, int(nd.max(initial=0)), cfg.keeps_draft_kv, 0.0, 0.0, "fixed", auto)
        px.bucket = bucket(b)
        forced = np.where(auto, 0, np.minimum(fixed_k, room))  # what fixed-k requests draft whatever we decide
        px.governor_counted, probe_due = self.governor.peek()
        px.governor_probe = probe_due
        k_explore = self.exploration.unmeasured(b, forced, room, auto, px, self.global_acc)
        if k_explore is not None:
            return model.decision(self.exploration.explore(k_explore, auto, forced, room), auto, "explore")
        if not self.governor.on and not probe_due:
            return model.decision(forced, auto, "off")
        lanes = Lanes(auto, forced, room, self._alpha(accs, limits), self._threshold(accs))
        best = model.best(b, lanes, self.current_k)
        if best is None:  # nothing measured fits (latency budget): only the fixed-k requests draft
            return model.decision(forced, auto, "model")
        px.current_k = best.k
        if probe_due:  # governor off: speculate with everyone at a k that could pay, to re-measure
            return self.probes.governor_probe(b, lanes, behind, self.global_acc)
        # Re-measure only while speculating: when the choice is plain, measuring drafts is what probes do, and
        # they are rate-limited by epsilon.
        stale = None
        if best.num_draft[auto].any():
            stale = self.exploration.stale(b, forced, best.k, self.bucket_steps[px.bucket], px)
        if stale is not None:
            nd = np.where(auto, np.minimum(stale, room), forced)
            return model.decision(nd, auto, "remeasure", best.expected_tokens, best.expected_cost)
        prior = self.global_acc.alpha(cfg.prior_alpha, 2.0)
        return self.probes.with_probes(accs, best, b, lanes, behind, prior, px, self.kind_acc)

    def _alpha(self, accs: list[RequestAcceptance], limits: np.ndarray | None = None) -> np.ndarray:
        per_lane = [None] * len(accs) if limits is None else limits.tolist()
        return np.array([self.acceptance_estimate(a, n) for a, n in zip(accs, per_lane)])

    def _threshold(self, accs: list[RequestAcceptance]) -> np.ndarray:
        """Hysteresis on each request's inclusion: one that drafted last step stays in at 0.65 of min_gain."""
        return np.array([self.cfg.min_gain * (0.65 if a.idle_steps == 0 and a.trials > 0 else 1.0) for a in accs])
