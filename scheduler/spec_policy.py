"""Knowing when to stop betting: choose k per step and per request from measured acceptance and step costs.

For request i with per-position acceptance alpha_i, a chain of k drafts emits in expectation
    E_i(k) = 1 + alpha_i + alpha_i^2 + ... + alpha_i^k        tokens per step (the bonus counted).
A step of batch B with a set S of requests speculating k tokens costs about
    C(B, k, S) = t(B, 0) + |S| / B * (t(B, k) - t(B, 0))        (n-gram: drafting is free, verify rows scale)
    C(B, k, S) = t(B, k) for any non-empty S                     (model proposers: the draft loop runs every lane)
where t(B, k) is the measured device time of a step at B's bucket with k drafts (t(B, 0): plain decode, with the
draft's KV refill when it is kept). The policy maximises expected tokens per second of device time,
    (B + sum_{i in S} (E_i(k) - 1)) / C(B, k, S),
over k among the candidates and S: for a fixed k, the best S is a prefix of the requests sorted by E_i(k).
Requests outside S draft nothing while the rest continue, and are re-probed every `probe_every` steps so a
request whose text became predictable can come back. Hysteresis: the batch's k changes only when the new
choice is expected to beat the current one by `margin`.

The cost that stays when speculation is off: with every request at k = 0 the draft model still refills its KV
(t_refill(B, 0)); the policy compares that with plain decoding without the draft (t_plain(B)) and drops the
refill when nobody is expected to speculate soon, paying a catch-up prefill of the draft when someone does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket(batch: int) -> int:
    return next((b for b in BUCKETS if b >= batch), BUCKETS[-1])


def expected_tokens(alpha: np.ndarray, k: int) -> np.ndarray:
    """1 + a + a^2 + ... + a^k, elementwise."""
    return np.sum(np.power.outer(np.asarray(alpha, dtype=np.float64), np.arange(k + 1)), axis=-1)


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    kind: str = "adaptive"  # adaptive | fixed
    k_max: int = 4
    candidates: tuple[int, ...] | None = None  # k values allowed (e.g. those with captured graphs)
    prior_alpha: float = 0.6
    alpha_decay: float = 0.7  # EMA weight of the past, per step
    cost_decay: float = 0.8
    margin: float = 0.05  # hysteresis on the batch's k
    probe_every: int = 4  # first probe of a request that stopped speculating; doubles after each failed probe
    probe_max: int = 64
    can_drop_refill: bool = False  # proposer supports catching up later (draft model: yes; MTP head: no)
    keeps_draft_kv: bool = True  # model proposers refill a KV cache; n-gram has none
    explore_samples: int = 3  # measurements of each (bucket, k) before the cost model is trusted
    min_gain: float = 0.3  # expected extra tokens per step below which a request is not worth a draft

    @property
    def ks(self) -> tuple[int, ...]:
        if self.candidates is not None:
            return tuple(sorted({0, *self.candidates}))
        return tuple(sorted({0, *range(1, self.k_max + 1)}))


@dataclass(slots=True)
class RequestAcceptance:
    """EMA of per-position acceptance: alpha = accepted / (accepted + rejections), both decayed per step."""

    accepted: float = 0.0
    trials: float = 0.0
    idle_steps: int = 0  # consecutive steps without drafting
    probe_interval: int = 0  # idle steps before the next probe (0: not set yet)

    def update(self, num_draft: int, num_accepted: int, decay: float) -> None:
        if num_draft <= 0:
            self.idle_steps += 1
            return
        if self.idle_steps >= self.probe_interval > 0:  # this was a probe: back off if it failed
            self.probe_interval = self.probe_interval // 2 if num_accepted else self.probe_interval * 2
        self.idle_steps = 0
        self.accepted = decay * self.accepted + num_accepted
        self.trials = decay * self.trials + num_accepted + (1 if num_accepted < num_draft else 0)

    def alpha(self, prior: float, prior_weight: float = 1.0) -> float:
        return (self.accepted + prior * prior_weight) / (self.trials + prior_weight)


@dataclass(slots=True)
class Decision:
    num_draft: np.ndarray  # [B] per request
    k: int  # the batch's k
    refill: bool  # keep the draft's KV current this step
    expected_tokens: float
    expected_cost: float
    explored: bool = False

    def to_log(self) -> dict:
        return {"k": self.k, "refill": self.refill, "speculating": int((self.num_draft > 0).sum()),
                "expected_tokens": round(self.expected_tokens, 3),
                "expected_cost_ms": round(self.expected_cost * 1e3, 3),
                "explored": self.explored}


@dataclass
class StepCosts:
    """Measured device seconds per (batch bucket, k, refill), kept current with an EMA."""

    decay: float
    table: dict[tuple[int, int, bool], float] = field(default_factory=dict)
    counts: dict[tuple[int, int, bool], int] = field(default_factory=dict)

    def observe(self, batch: int, k: int, refill: bool, seconds: float) -> None:
        key = (bucket(batch), k, refill)
        n = self.counts.get(key, 0)
        old = self.table.get(key)
        # Plain mean while few samples exist, then an EMA that follows load changes.
        w = max(self.decay, n / (n + 1)) if old is not None else 0.0
        self.table[key] = seconds if old is None else w * old + (1 - w) * seconds
        self.counts[key] = n + 1

    def samples(self, batch: int, k: int, refill: bool) -> int:
        return self.counts.get((bucket(batch), k, refill), 0)

    def get(self, batch: int, k: int, refill: bool) -> float | None:
        return self.table.get((bucket(batch), k, refill))

    def total_samples(self, k: int, refill: bool) -> int:
        return sum(n for (_, kk, r), n in self.counts.items() if kk == k and r == refill)

    def ratio_near(self, batch: int, k: int, refill: bool) -> float | None:
        """t(k) / t(0) at the measured bucket nearest to `batch` (in log2 distance)."""
        target = bucket(batch).bit_length()
        best = None
        for (b, kk, r), t in self.table.items():
            t0 = self.table.get((b, 0, r))
            if kk == k and r == refill and t0:
                d = abs(b.bit_length() - target)
                if best is None or d < best[0]:
                    best = (d, t / t0)
        return None if best is None else best[1]


class AdaptivePolicy:
    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.costs = StepCosts(cfg.cost_decay)
        self.current_k = cfg.k_max
        self.global_acc = RequestAcceptance()
        self.steps = 0

    # ---- measurements (no extra syncs: the host already read these back) ---------------------------------------
    def observe_request(self, acc: RequestAcceptance, num_draft: int, num_accepted: int) -> None:
        acc.update(num_draft, num_accepted, self.cfg.alpha_decay)
        if num_draft > 0:
            self.global_acc.update(num_draft, num_accepted, 0.98)

    def observe_step(self, batch: int, k: int, refill: bool, seconds: float) -> None:
        self.costs.observe(batch, k, refill, seconds)

    # ---- the decision -------------------------------------------------------------------------------------------
    def choose(self, accs: list[RequestAcceptance], overrides: list[int | None], room: np.ndarray) -> Decision:
        """accs: per-request acceptance; overrides: per-request fixed k (None = auto); room: max drafts each."""
        self.steps += 1
        b = len(accs)
        cfg = self.cfg
        prior = self.global_acc.alpha(cfg.prior_alpha, 2.0)
        alpha = np.array([a.alpha(prior) for a in accs])
        fixed = np.array([o is not None for o in overrides])
        fixed_k = np.array([o or 0 for o in overrides], dtype=np.int64)
        if cfg.kind == "fixed":
            nd = np.where(fixed, fixed_k, cfg.k_max)
            return Decision(np.minimum(nd, room).clip(0), int(nd.max(initial=0)), True, 0.0, 0.0)

        explore = self._unmeasured(b)
        if explore is not None:
            k, refill = explore
            nd = np.minimum(np.where(fixed, fixed_k, k), room).clip(0)
            if (fixed & (nd > 0)).any():  # a fixed-k request drafts whatever is being measured: keep its draft
                refill = refill or cfg.keeps_draft_kv or cfg.can_drop_refill  # current (a stale one can't draft)
            return Decision(nd, int(nd.max(initial=0)), refill, 0.0, 0.0, explored=True)

        # Hysteresis on each request's inclusion too: one that drafted last step stays in at 0.65 of the threshold.
        threshold = np.array([cfg.min_gain * (0.65 if a.idle_steps == 0 and a.trials > 0 else 1.0)
                                    for a in accs])
        best: Decision | None = None
        current: Decision | None = None
        for k in cfg.ks:
            d = self._evaluate(k, alpha, fixed, fixed_k, room, b, threshold)
            if best is None or d.expected_tokens / d.expected_cost > best.expected_tokens / best.expected_cost:
                best = d
            if k == self.current_k:
                current = d
        assert best is not None
        if current is not None and best.k != current.k:
            gain = (best.expected_tokens / best.expected_cost) / (current.expected_tokens / current.expected_cost)
            if gain < 1 + cfg.margin:
                best = current
        self.current_k = best.k
        # Probes: a request that has not drafted for a while drafts one token so its acceptance estimate can
        # recover (one extra verify row: small enough not to show in p99 latency); failed probes back off.
        for a in accs:
            a.probe_interval = min(max(a.probe_interval, cfg.probe_every), cfg.probe_max)
        probe = np.array([a.idle_steps >= a.probe_interval for a in accs]) & ~fixed
        if probe.any():
            k1 = min(k for k in cfg.ks if k > 0) if cfg.ks[-1] > 0 else 0
            if best.k == 0 and k1:
                best = Decision(np.zeros(b, dtype=np.int64), k1, best.refill or cfg.keeps_draft_kv,
                                best.expected_tokens, best.expected_cost)
            best.num_draft = np.where(probe & (best.num_draft == 0), min(k1, best.k), best.num_draft)
        best.num_draft = np.minimum(best.num_draft, room).clip(0)
        return best

    def _unmeasured(self, b: int) -> tuple[int, bool] | None:
        """What to measure before trusting the cost model: each k a few times in some bucket (cost ratios carry
        over between buckets), and plain decoding once in this bucket (the baseline the ratios scale)."""
        r = self.cfg.keeps_draft_kv
        n = self.cfg.explore_samples
        if self.costs.samples(b, 0, r) < 1:
            return 0, r
        for k in self.cfg.ks:
            if self.costs.total_samples(k, r) < n:
                return k, r
        if self.cfg.can_drop_refill and self.costs.samples(b, 0, False) < 1:
            return 0, False
        return None

    def _raw_cost(self, b: int, k: int, r: bool) -> float | None:
        """t(B, k) measured at B's bucket, else t(B, 0) scaled by t(k)/t(0) of the nearest bucket measuring both."""
        measured = self.costs.get(b, k, r)
        if measured is not None or k == 0:
            return measured
        t0 = self.costs.get(b, 0, r)
        ratio = self.costs.ratio_near(b, k, r)
        return None if t0 is None or ratio is None else t0 * ratio

    def _cost(self, b: int, k: int) -> float:
        """t(B, k), made non-decreasing in k (more drafts never cost less; noise must not say otherwise)."""
        r = self.cfg.keeps_draft_kv
        best = self._raw_cost(b, 0, r) or 1e-3
        for kk in self.cfg.ks:
            if kk > k:
                break
            best = max(best, self._raw_cost(b, kk, r) or best)
        return best

    def _evaluate(self, k: int, alpha: np.ndarray, fixed: np.ndarray, fixed_k: np.ndarray, room: np.ndarray,
                  b: int, threshold: np.ndarray | float = 0.0, force_all: bool = False) -> Decision:
        t0, tk = self._cost(b, 0), self._cost(b, k)
        gain = expected_tokens(alpha, k) - 1.0  # extra tokens if request i speculates k
        per_req = (tk - t0) / b
        order = np.argsort(-gain)
        chosen = np.zeros(b, dtype=bool)
        tokens, cost = float(b), t0
        # Fixed overrides always speculate with their own k (their cost is charged like k's).
        for i in np.flatnonzero(fixed & (fixed_k > 0)):
            chosen[i] = True
            tokens += float(expected_tokens(alpha[i:i + 1], int(min(fixed_k[i], room[i])))[0] - 1)
            cost += per_req
        if self.cfg.keeps_draft_kv and k > 0:
            # A model proposer's draft loop runs over every lane once anyone drafts: a speculating step costs
            # about t(B, k) however few requests draft. So it is all requests worth a draft at k, or nobody.
            chosen |= ~fixed & ((gain >= threshold) | force_all)
            tokens += float(gain[chosen & ~fixed].sum())
            cost = tk if chosen.any() else t0
        for i in order:
            if fixed[i] or k == 0 or self.cfg.keeps_draft_kv:
                continue
            if force_all or gain[i] / max(per_req, 1e-9) > tokens / cost:  # improves tokens per second
                chosen[i] = True
                tokens += float(gain[i])
                cost += per_req
        nd = np.where(fixed, fixed_k, np.where(chosen, k, 0)).astype(np.int64)
        if not chosen.any():
            k = 0  # nobody speculates: this is the k = 0 decision, whatever k was tried
        refill = self.cfg.keeps_draft_kv
        if self.cfg.can_drop_refill and not nd.any():
            plain = self.costs.get(b, 0, False)
            if plain is not None and plain < t0:
                refill, cost = False, plain
        return Decision(nd, k, refill, tokens, cost)
