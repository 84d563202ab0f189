"""Knowing when to stop betting: choose k per step and per request from measured acceptance and step costs.

For request i with per-position acceptance alpha_i, a chain of k drafts emits in expectation
    E_i(k) = 1 + alpha_i + alpha_i^2 + ... + alpha_i^k        tokens per step (the bonus counted).
A step whose lanes draft n_i tokens costs C(n), measured live (`spec_costs.StepCosts`: t(B, k) per lane layout
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

The floor: `spec_governor.Governor` watches the realised throughput of speculative steps against plain
decoding and switches speculation off when it is confidently below (1 - delta) of plain; while off, only
probes (at most a fraction epsilon of steps, and of the off time) speculate. The loss against plain is bounded by
about delta while on plus epsilon while off (defaults 0.02 each), under the assumptions the governor's docstring
states (stationary plain cost and acceptance over its windows, a probe's catch-up small against its budget).

Objectives: `throughput` maximises tokens per second; `latency` only allows speculative steps expected to take
at most `itl_budget` times a plain step (a step's duration is the gap between a stream's messages, so this
bounds p99 inter-token latency), explores no k past the first that breaks the budget, and probes rarely.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field, replace

import numpy as np

from specstep.scheduler.spec.costs import StepCosts, bucket
from specstep.scheduler.spec.decision import Decision, Effects, RequestAcceptance
from specstep.scheduler.spec.governor import Governor, GovernorConfig

OBJECTIVES = ("throughput", "latency")


def chain_sums(alpha: np.ndarray, k_max: int) -> np.ndarray:
    """[B, k_max + 1]: entry (i, k) = E_i(k) = 1 + a_i + a_i^2 + ... + a_i^k."""
    return np.cumsum(np.power.outer(np.asarray(alpha, dtype=np.float64), np.arange(k_max + 1)), axis=-1)


def expected_tokens(alpha: np.ndarray, k: int | np.ndarray) -> np.ndarray:
    """E_i(k) elementwise (k: one for all, or one per request)."""
    alpha = np.atleast_1d(np.asarray(alpha, dtype=np.float64))
    k = np.broadcast_to(np.asarray(k, dtype=np.int64), alpha.shape)
    return chain_sums(alpha, int(k.max(initial=0)))[np.arange(len(alpha)), k]


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    kind: str = "adaptive"  # adaptive | fixed
    k_max: int = 4
    candidates: tuple[int, ...] | None = None  # k values allowed (e.g. those with captured graphs)
    objective: str = "throughput"  # throughput | latency
    itl_budget: float = 1.1  # latency objective: a speculative step may take at most this times a plain one
    prior_alpha: float = 0.6
    alpha_decay: float = 0.85  # EMA weight of the past, per drafting step
    cost_decay: float = 0.9  # EMA weight of the past, per measured step
    cost_shape: str = "lanes"  # lanes | rows (see spec_costs)
    margin: float = 0.05  # hysteresis on the batch's k
    probe_every: int = 4  # first probe of a request that stopped speculating; doubles after each failed probe
    # Longest probe interval; n-gram (rows) backs off less: its acceptance comes in bursts (a copied span)
    # that sparse probes miss, and a probe costs it a few verify rows, not a draft loop over every lane.
    probe_max: int | None = None  # None: 16 for rows, 64 for lanes
    keeps_draft_kv: bool = True  # model proposers refill a KV cache; n-gram has none
    can_drop_refill: bool = True  # the proposer catches up after steps without refill (every model proposer)
    explore_samples: int = 2  # measurements of each k (across buckets) before the cost model is trusted
    plain_samples: int = 3  # measurements of plain decoding per bucket first: one noisy sample misled it
    min_gain: float = 0.3  # expected extra tokens per step below which a request is not worth a draft
    remeasure_every: int = 32  # per bucket: one step in this many re-measures the stalest other candidate
    governor: GovernorConfig = GovernorConfig()

    def __post_init__(self) -> None:
        if self.kind not in ("adaptive", "fixed"):
            raise ValueError(f"spec policy must be adaptive or fixed, got {self.kind!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"--spec-objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.itl_budget < 1.0:
            raise ValueError(f"--spec-itl-budget must be >= 1.0 (a multiple of a plain step), got {self.itl_budget}")
        if self.cost_shape not in ("lanes", "rows"):
            raise ValueError(f"cost shape must be lanes or rows, got {self.cost_shape!r}")
        self.governor.validate()

    @property
    def drops_refill(self) -> bool:
        """Whether a step may skip the proposer's refill (`AdaptivePolicy._refill`: only when nobody drafts); the
        fixed policy always refills a model proposer. Graph capture follows this (`engine.step_graphs`)."""
        return self.kind != "fixed" and self.keeps_draft_kv and self.can_drop_refill

    @property
    def ks(self) -> tuple[int, ...]:
        if self.candidates is not None:
            return tuple(sorted({0, *(k for k in self.candidates if k <= self.k_max)}))
        return tuple(range(self.k_max + 1))


@dataclass(frozen=True, slots=True)
class _Lanes:
    """One decision's per-request inputs: who the policy decides for, what fixed-k requests draft, the room each
    has, the acceptance estimates and the inclusion thresholds."""

    auto: np.ndarray
    forced: np.ndarray
    room: np.ndarray
    alpha: np.ndarray
    threshold: np.ndarray


@dataclass(slots=True)
class _Pending:
    """The effects of the decision being made, gathered while choosing and frozen into `Decision.effects`."""

    bucket: int | None = None
    governor_counted: bool = False
    governor_probe: bool = False
    explore_key: int | None = None
    current_k: int | None = None
    probe_clock_reset: bool | None = None
    next_remeasure: tuple[int, int] | None = None
    acceptance: dict[int, tuple[RequestAcceptance, int | None, int]] = field(default_factory=dict)

    def freeze(self) -> Effects:
        return Effects(self.bucket, self.governor_counted, self.governor_probe, self.explore_key, self.current_k,
                       self.probe_clock_reset, self.next_remeasure, tuple(self.acceptance[i] for i in
                                                                           sorted(self.acceptance)))


class AdaptivePolicy:
    PROBE_CATCH_UP = 0.5  # the catch-up a probe from plain decoding may spend, in plain steps (one lane at least)

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.costs = StepCosts(cfg.cost_decay, cfg.cost_shape)
        self.governor = Governor(cfg.governor)
        self.current_k = cfg.k_max
        self.global_acc = RequestAcceptance()
        self.steps = 0
        self.bucket_steps: Counter[int] = Counter()
        self._next_remeasure: dict[int, int] = {}
        self._since_probe = 0  # steps since auto requests last drafted (the global probe clock)
        self.reasons: Counter[str] = Counter()  # decisions by reason, for metrics
        self._explore_tries: Counter[int] = Counter()  # k > 0: tries of k; -bucket: tries of plain in it
        self.catch_up_rate: float | None = None  # seconds per token a stale draft catches up (EMA)
        self._probe_lanes_seen = [0, 0]  # this step's probing lanes and their accepted drafts (observe_request)
        self._unobserved: deque[int | None] = deque()  # decisions not yet observed: the k each explores (or None)

    # ---- measurements (no extra syncs: the host already read these back) ---------------------------------------
    def observe_request(self, acc: RequestAcceptance, num_draft: int, num_accepted: int, probe: bool = False,
                        break_even: float | None = None) -> None:
        """A request's step. A probe backs off by whether it paid: whether speculating this request at its
        acceptance estimate, now updated, emits more than `break_even` extra tokens a step (its share of the
        step's overhead), not whether it accepted a token (one lucky token used to halve the interval, and a
        request whose acceptance fell went on probing a fifth of the steps)."""
        acc.update(num_draft, num_accepted, self.cfg.alpha_decay, probe)
        if probe and num_draft > 0:
            if break_even is None:
                acc.back_off(num_accepted > 0)
            else:
                acc.back_off(float(expected_tokens(self.acceptance_estimate(acc), num_draft)[0]) - 1 >= break_even)
            self._probe_lanes_seen[0] += 1
            self._probe_lanes_seen[1] += num_accepted
        if num_draft > 0:
            self.global_acc.update(num_draft, num_accepted, 0.98)

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A stale draft consumed `tokens` skipped tokens in `seconds`: what the next probe's catch-up costs."""
        if tokens > 0:
            rate = seconds / tokens
            self.catch_up_rate = rate if self.catch_up_rate is None else 0.8 * self.catch_up_rate + 0.2 * rate

    def observe_step(self, batch: int, num_draft: np.ndarray, refill: bool, seconds: float,
                     tokens: int | None = None, catch_up_s: float = 0.0, auto_drafted: bool = False) -> None:
        """A finished step: its device seconds (body only), under what it really drafted; for the governor, the
        tokens it emitted and the catch-up it paid, when policy-chosen requests drafted in it."""
        num_draft = np.asarray(num_draft, dtype=np.int64)
        if self._unobserved:
            self._unobserved.popleft()
        probed, probe_acc = self._probe_lanes_seen
        self._probe_lanes_seen = [0, 0]
        drafting = int((num_draft > 0).sum())
        # A probe of a subset of lanes speaks for the batch: what everyone would emit at the probed acceptance
        # (lanes shape: the step already costs what everyone drafting costs).
        subset = 0 < probed == drafting < batch and self.cfg.cost_shape == "lanes"
        judged_tokens = batch * (1.0 + probe_acc / probed) if subset else tokens
        b = bucket(batch)
        self.costs.observe(batch, num_draft, refill, seconds, self.bucket_steps[b])
        gov, plain_refill = self.governor, self._refill(np.zeros(1, np.int64))
        if not num_draft.any() and refill == plain_refill:
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

    def acceptance_estimate(self, acc: RequestAcceptance) -> float:
        """A request's per-position acceptance as the policy sees it (its own, pulled toward the global one)."""
        return acc.alpha(self.global_acc.alpha(self.cfg.prior_alpha, 2.0))

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

    # ---- the decision -------------------------------------------------------------------------------------------
    def _refill(self, nd: np.ndarray) -> bool:
        if not self.cfg.keeps_draft_kv:
            return False
        return bool(nd.any()) or not self.cfg.can_drop_refill

    def _decision(self, nd: np.ndarray, auto: np.ndarray, reason: str, tokens: float = 0.0, cost: float = 0.0,
                  probing: np.ndarray | None = None) -> Decision:
        probing = probing if probing is not None else np.zeros(len(nd), dtype=bool)
        refill = self._refill(nd)
        speculating = bool((nd[auto & ~probing] > 0).any())
        # A probe from plain decoding catches up only the lanes that draft; a speculating step all of them.
        catch_up = (nd > 0) if probing.any() and not speculating else None
        k = int(nd.max(initial=0))
        d = Decision(nd, k, refill, tokens, cost, reason, auto, probing, catch_up,
                     self._break_even(len(nd), k, refill) if probing.any() else None)
        return d

    def _break_even(self, b: int, k: int, refill: bool) -> float | None:
        """Accepted drafts a lane drafting k needs to pay for its share of the step's overhead over plain, were
        every lane to draft (lanes: t(B, k) / t(B, 0) - 1; rows: its k verify rows over its share of t(B, 0))."""
        plain = self.plain_seconds(b)
        if not plain or k <= 0:
            return None
        nd = np.array([k])
        cost = self.costs.predict(b, nd, refill)
        if cost is None:
            return None
        return (cost - plain) / plain * (b if self.cfg.cost_shape == "rows" else 1)

    def plain_seconds(self, b: int) -> float | None:
        """A plain step at batch b: the governor's own recent median, else the cost model's estimate."""
        return self.governor.plain(bucket(b)) or self.costs.plain(b, self._refill(np.zeros(1, np.int64)))

    def _probe_lanes(self, b: int, cand: np.ndarray, behind: np.ndarray | None) -> np.ndarray:
        """The lanes a probe from plain decoding drafts with: every candidate whose draft is current (n-gram, or
        nothing skipped); else those that catch up cheapest, as many as PROBE_CATCH_UP of a plain step's time buys
        (at least one; four while the catch-up rate is unknown). Catching up every lane of a large batch cost a
        fraction (batch x rate / plain step) of all the off time, whatever the probe interval."""
        if behind is None or not (cand & (behind > 0)).any():
            return cand
        order = [i for i in np.argsort(behind, kind="stable") if cand[i]]
        plain, rate = self.plain_seconds(b), self.catch_up_rate
        chosen = np.zeros_like(cand)
        spent = 0.0
        for n, i in enumerate(order):
            cost = float(behind[i]) * (rate or 0.0)
            if n > 0 and (spent + cost > self.PROBE_CATCH_UP * plain if rate and plain else n >= 4):
                break
            chosen[i], spent = True, spent + cost
        return chosen

    def choose(self, accs: list[RequestAcceptance], overrides: list[int | None], room: np.ndarray,
               behind: np.ndarray | None = None, commit: bool = True) -> Decision:
        """accs: per-request acceptance; overrides: per-request fixed k (None = auto); room: max drafts each;
        behind: tokens each request's draft must catch up before it drafts (None: all current).

        commit=False has no side effects (on the policy, its governor, its cost model or `accs`): the decision
        carries what committing it applies (`Decision.effects`), and `commit` applies it when its step runs. A
        decision never committed changes nothing. commit=True is choose-then-commit."""
        pending = _Pending()
        d = self._choose(accs, overrides, room, behind, pending)
        d = replace(d, effects=pending.freeze())
        if commit:
            self.commit(d)
        return d

    def commit(self, decision: Decision) -> None:
        """The decision's step runs: count it and apply its effects (call once per decision)."""
        self.steps += 1
        self.reasons[decision.reason] += 1
        self._unobserved.append(decision.k if decision.reason == "explore" else None)
        fx = decision.effects
        if fx is None:
            return
        if fx.bucket is not None:
            self.bucket_steps[fx.bucket] += 1
        self.governor.commit_tick(fx.governor_counted, fx.governor_probe)
        if fx.explore_key is not None:
            self._explore_tries[fx.explore_key] += 1
        if fx.current_k is not None:
            self.current_k = fx.current_k
        if fx.probe_clock_reset is not None:
            self._since_probe = 0 if fx.probe_clock_reset else self._since_probe + 1
        if fx.next_remeasure is not None:
            self._next_remeasure[fx.next_remeasure[0]] = fx.next_remeasure[1]
        for acc, idle, interval in fx.acceptance:
            if idle is not None:
                acc.idle_steps = idle
            acc.probe_interval = interval

    def _choose(self, accs: list[RequestAcceptance], overrides: list[int | None], room: np.ndarray,
                behind: np.ndarray | None, px: _Pending) -> Decision:
        cfg, b = self.cfg, len(accs)
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
        k_explore = self._unmeasured(b, forced, room, auto, px)
        if k_explore is not None:
            return self._explore(k_explore, auto, forced, room)
        if not self.governor.on and not probe_due:
            return self._decision(forced, auto, "off")
        lanes = _Lanes(auto, forced, room, self._alpha(accs), self._threshold(accs))
        best = self._best(b, lanes)
        if best is None:  # nothing measured fits (latency budget): only the fixed-k requests draft
            return self._decision(forced, auto, "model")
        px.current_k = best.k
        if probe_due:  # governor off: speculate with everyone at the best k the model sees, to re-measure
            return self._governor_probe(b, lanes, behind)
        # Re-measure only while speculating: when the choice is plain, measuring drafts is what probes do, and
        # they are rate-limited by epsilon.
        stale = self._stale(b, forced, best.k, px) if best.num_draft[auto].any() else None
        if stale is not None:
            nd = np.where(auto, np.minimum(stale, room), forced)
            return self._decision(nd, auto, "remeasure", best.expected_tokens, best.expected_cost)
        return self._with_probes(accs, best, b, lanes, behind, px)

    def _alpha(self, accs: list[RequestAcceptance]) -> np.ndarray:
        return np.array([self.acceptance_estimate(a) for a in accs])

    def _threshold(self, accs: list[RequestAcceptance]) -> np.ndarray:
        """Hysteresis on each request's inclusion: one that drafted last step stays in at 0.65 of min_gain."""
        return np.array([self.cfg.min_gain * (0.65 if a.idle_steps == 0 and a.trials > 0 else 1.0) for a in accs])

    def _explore(self, k: int, auto: np.ndarray, forced: np.ndarray, room: np.ndarray) -> Decision:
        who = auto.copy()
        if self.cfg.cost_shape == "rows" and k > 0:  # a marginal per row: one request measures it
            who[:] = False
            who[int(np.argmax(auto & (room > 0)))] = True
        return self._decision(np.where(who, np.minimum(k, room), forced), auto, "explore")

    def _best(self, b: int, ln: _Lanes) -> Decision | None:
        """The model's best k by tokens per second, kept at the current k unless better by `margin`."""
        options = [self._evaluate(k, ln.alpha, ln.auto, ln.forced, ln.room, b, ln.threshold)
                   for k in self._allowed_ks(b, ln.forced)]
        options = [d for d in options if d is not None]
        if not options:
            return None
        best = max(options, key=lambda d: d.expected_tokens / d.expected_cost)
        current = next((d for d in options if d.k == self.current_k), None)
        if current is not None and best is not current:
            gain = (best.expected_tokens / best.expected_cost) / (current.expected_tokens / current.expected_cost)
            if gain < 1 + self.cfg.margin:
                best = current
        return best

    def _governor_probe(self, b: int, ln: _Lanes, behind: np.ndarray | None) -> Decision:
        """The governor's probe while off: everyone at the best k the model sees (n-gram pays per row: the
        smallest k is enough to see whether acceptance came back), a subset of lanes when catch-up is dear."""
        probe_ks = [k for k in self._allowed_ks(b, ln.forced) if k > 0]
        if self.cfg.cost_shape == "rows":
            probe_ks = probe_ks[:1]
        forced_all = [self._evaluate(k, ln.alpha, ln.auto, ln.forced, ln.room, b, ln.threshold, force_all=True)
                      for k in probe_ks]
        forced_all = [d for d in forced_all if d is not None and d.num_draft[ln.auto].any()]
        if not forced_all:
            return self._decision(ln.forced, ln.auto, "off")
        p = max(forced_all, key=lambda d: d.expected_tokens / d.expected_cost)
        lanes = self._probe_lanes(b, ln.auto & (p.num_draft > 0), behind)
        return self._decision(np.where(ln.auto & ~lanes, 0, p.num_draft), ln.auto, "probe", p.expected_tokens,
                              p.expected_cost, probing=lanes)

    def _due(self, accs: list[RequestAcceptance], nd: np.ndarray, ln: _Lanes, speculating: bool,
             px: _Pending) -> np.ndarray:
        """Requests whose per-request probe is due (idle for their interval); none under the latency objective
        within epsilon's spacing of the last probe while nobody speculates."""
        cfg = self.cfg
        probe_max = self._probe_max()
        intervals = [min(max(a.probe_interval, cfg.probe_every), probe_max) for a in accs]
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
        since_probe = 0 if speculating else self._since_probe + 1
        # The latency objective also keeps them to epsilon of the steps while on (each may exceed the budget).
        limited = cfg.objective == "latency" and since_probe < cfg.governor.probe_every
        if not speculating and limited:
            due[:] = False
        return due

    def _probe_max(self) -> int:
        return self.cfg.probe_max or (16 if self.cfg.cost_shape == "rows" else 64)

    def _with_probes(self, accs: list[RequestAcceptance], best: Decision, b: int, ln: _Lanes,
                     behind: np.ndarray | None, px: _Pending) -> Decision:
        """The model's choice plus per-request probes: a request that has not drafted for a while drafts so its
        acceptance estimate can recover; failed probes back off (probe_every doubling to probe_max). Inside a
        speculating step that is a few more verify rows (the draft loop runs anyway). When nobody speculates it
        is a whole speculative step and a catch-up: the governor judges such steps, and once off it rate-limits
        them to epsilon."""
        nd, auto = best.num_draft, ln.auto
        speculating = bool(nd[auto].any())
        due = self._due(accs, nd, ln, speculating, px)
        if due.any() and not speculating:  # a whole probe step: a subset of lanes speaks for the others
            lanes = self._probe_lanes(b, due, behind)
            for i in np.flatnonzero(due & ~lanes):  # covered by this probe: backed off as after a failed one
                # (were it to pay, the acceptance it measures moves theirs too)
                interval = px.acceptance[i][2] if i in px.acceptance else accs[i].probe_interval
                px.acceptance[i] = (accs[i], 0, min(2 * interval, self._probe_max()))
            due = lanes
        probing = np.zeros(b, dtype=bool)
        k1 = self._probe_k(b, ln.forced, due, ln.alpha, auto, ln.room, ln.threshold) if due.any() else 0
        if due.any() and k1:
            px.probe_clock_reset = True
            probing = due
            nd = np.where(due, min(k1, best.k) if speculating else k1, nd)
        nd = np.minimum(nd, np.where(auto, ln.room, nd))
        reason = "probe" if probing.any() and not speculating else "model"
        return self._decision(nd, auto, reason, best.expected_tokens, best.expected_cost, probing)

    def _budget_ok(self, b: int, nd: np.ndarray, refill: bool) -> bool:
        if self.cfg.objective != "latency" or not nd.any():
            return True
        cost = self.costs.predict(b, nd, refill)
        plain = self.costs.plain(b, self._refill(np.zeros(1, np.int64)))
        return cost is None or plain is None or cost <= self.cfg.itl_budget * plain

    def _allowed_ks(self, b: int, forced: np.ndarray) -> list[int]:
        """Candidate k for the auto requests (the latency objective drops those over the ITL budget)."""
        ks = []
        for k in self.cfg.ks:
            nd = np.maximum(forced, k)
            if k == 0 or self._budget_ok(b, nd, self._refill(nd)):
                ks.append(k)
        return ks

    def _probe_k(self, b: int, forced: np.ndarray, due: np.ndarray, alpha: np.ndarray, auto: np.ndarray,
                 room: np.ndarray, threshold: np.ndarray) -> int:
        """The k a probe drafts: the best one for the probed requests if their acceptance were the batch-wide
        estimate (n-gram's first draft row costs most: probing one token at a time would be the dearest)."""
        prior = self.global_acc.alpha(self.cfg.prior_alpha, 2.0)
        trial = np.where(due, prior, alpha)
        best, best_rate = 0, 0.0
        for k in self._allowed_ks(b, forced):
            if k == 0:
                continue
            d = self._evaluate(k, trial, due, forced, room, b, threshold, force_all=True)
            if d is not None and d.expected_tokens / d.expected_cost > best_rate:
                best, best_rate = k, d.expected_tokens / d.expected_cost
        return best

    def _unmeasured(self, b: int, forced: np.ndarray, room: np.ndarray, auto: np.ndarray,
                    px: _Pending) -> int | None:
        """What to measure before trusting the cost model: plain decoding three times in this bucket (one noisy
        sample misled both the model and the governor) (when a fixed-k
        request does not make it impossible), then each runnable k a few times in some bucket (cost ratios
        carry over between buckets). The latency objective stops at the first k over its budget."""
        n = self.cfg.explore_samples
        kf = int(forced.max(initial=0))
        plain_refill = self._refill(np.zeros(1, np.int64))
        # (Tries, not samples, bound it: with overlap the next step is decided before this one ends.)
        n0 = self.cfg.plain_samples
        if kf == 0 and self.costs.samples(b, 0, plain_refill) < n0 and self._explore_tries[-bucket(b)] < n0:
            px.explore_key = -bucket(b)
            return 0
        if not (auto & (room > 0)).any():
            return None  # no auto request can draft: nothing this batch could measure
        for k in self.cfg.ks:
            if k == 0 or k < kf:
                continue
            # A step still in flight (overlap: decided before the last one was read back) counts as measured.
            pending = int(bool(self._unobserved) and self._unobserved[-1] == k)
            if self.costs.total_samples(k, self.cfg.keeps_draft_kv) + pending < n and self._explore_tries[k] < 3 * n:
                px.explore_key = k  # n-gram may draft less than asked: do not insist for ever
                return k
            if not self._budget_ok(b, np.maximum(forced, k), self._refill(np.ones(1, np.int64))):
                break
        return None

    def _stale(self, b: int, forced: np.ndarray, chosen: int, px: _Pending) -> int | None:
        """One step in `remeasure_every` per bucket: the candidate measured longest ago, if not the chosen one."""
        bk = bucket(b)
        now = self.bucket_steps[bk] + 1  # this decision's step counted
        due_at = self._next_remeasure.get(bk)
        if due_at is None:
            due_at = now + self.cfg.remeasure_every
            px.next_remeasure = (bk, due_at)
        if now < due_at:
            return None
        px.next_remeasure = (bk, now + self.cfg.remeasure_every)
        kf = int(forced.max(initial=0))
        keys = [k for k in self._allowed_ks(b, forced) if k != chosen and (k >= kf or k == 0) and not (k == 0 and kf)]
        if not keys:
            return None

        def last(k: int) -> int:
            nd = np.full(1, k)
            return self.costs.last_step(b, k, self._refill(nd))
        k = min(keys, key=last)
        return k if now - last(k) >= self.cfg.remeasure_every else None

    def _evaluate(self, k: int, alpha: np.ndarray, auto: np.ndarray, forced: np.ndarray, room: np.ndarray,
                  b: int, threshold: np.ndarray, force_all: bool = False) -> Decision | None:
        """The best request set drafting k (with the fixed-k requests' drafts), or None if unmeasured."""
        kk = np.minimum(k, room)
        # E_i(j) for every j at once (the chain sums), then each request's entry.
        chain = chain_sums(alpha, max(int(kk.max(initial=0)), int(forced.max(initial=0))))
        rows = np.arange(len(alpha))
        gain = np.where(auto, chain[rows, kk] - 1.0, 0.0)  # extra tokens if request i drafts k
        fixed_gain = float((chain[rows, forced] - 1.0)[~auto].sum())
        want = auto & (kk > 0) & ((gain >= threshold) | force_all)
        if self.cfg.keeps_draft_kv or k == 0:
            # A model proposer's draft loop runs over every lane once anyone drafts: a speculating step costs
            # about t(B, k) however few requests draft. So it is all requests worth a draft at k, or nobody.
            nd = np.where(want, kk, forced) if k > 0 else forced
        else:
            nd = forced.copy()
            base = self.costs.predict(b, nd, False)
            if base is None:
                return None
            tokens = b + fixed_gain
            for i in np.argsort(-gain):
                if not want[i]:
                    continue
                trial = nd.copy()
                trial[i] = kk[i]
                cost = self.costs.predict(b, trial, False)
                if cost is None:
                    return None
                if force_all or (tokens + gain[i]) / cost > tokens / base:  # improves tokens per second
                    nd, base, tokens = trial, cost, tokens + float(gain[i])
        cost = self.costs.predict(b, nd, self._refill(nd))
        if cost is None or cost <= 0:
            return None
        tokens = b + fixed_gain + float(gain[(nd > 0) & auto].sum())
        return Decision(nd, int(nd.max(initial=0)), self._refill(nd), tokens, cost, "model", auto)
