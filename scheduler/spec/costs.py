"""Measured step costs per (batch bucket, k, refill), kept current so the policy's comparisons stay true.

Every decode step is recorded under the k it actually drafted (the widest lane of its layout), not the k a
decision asked for: fixed-k requests, probes and n-gram matches shorter than asked all change what ran.

Two shapes of cost, chosen by how the step runs:

    lanes   t(B, k) per step: every lane pays for k drafts once anyone drafts k (model proposers run the
            draft loop over every lane; captured graphs pad every lane to k + 1 verify rows)
    rows    t(B, 0) + m(B, k) * R: ragged eager verify of a host proposer (n-gram) costs a marginal m per
            draft row R actually verified; m is an average per (bucket, k) of each step's (cost - t0) / R,
            weighted by R so a step with one draft row barely moves it. Where no plain step ever ran in a
            bucket (a fixed-k request is always there), t0 and m come from a least-squares line instead.

Each value is a bias-corrected exponential average (weights decay^age, normalised by their sum): the first
sample counts fully, and after 1 / (1 - decay) samples it follows load and context length with that memory.

A prior from an earlier run on the same host (`cost_store`) holds ratios to the bucket's plain step: where a
bucket has no live sample of a k yet, its cost is the prior ratio times the live plain step, and the prior's
samples count toward exploration (up to `PRIOR_SAMPLES`), so a fresh process does not pay to re-learn them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PRIOR_SAMPLES = 2  # what a stored cost counts for toward exploration (PolicyConfig.explore_samples: 2): enough


def bucket(batch: int) -> int:
    """The smallest of BUCKETS (the powers of two to 256) holding `batch`."""
    return BUCKETS[-1] if batch > BUCKETS[-1] else 1 << max(int(batch) - 1, 0).bit_length()


@dataclass(slots=True)
class Ema:
    """Weighted exponential average: value = sum(w_i d^age_i x_i) / sum(w_i d^age_i)."""

    decay: float
    num: float = 0.0
    den: float = 0.0
    count: int = 0
    last_step: int = -1  # the policy step of the latest sample (for re-measurement)

    def add(self, x: float, weight: float = 1.0, step: int = -1) -> None:
        self.num = self.decay * self.num + weight * x
        self.den = self.decay * self.den + weight
        self.count += 1
        self.last_step = step

    @property
    def value(self) -> float | None:
        return self.num / self.den if self.den > 0 else None


Key = tuple[int, int, bool]  # (bucket, k, refill)


@dataclass(slots=True)
class Seen:
    count: int = 0
    last_step: int = -1  # the bucket's step counter at the latest sample (for re-measurement)


@dataclass(slots=True)
class LineFit:
    """t = a + m * R by exponentially weighted least squares (rows shape, one per bucket and refill)."""

    decay: float
    s: list[float] = field(default_factory=lambda: [0.0] * 5)  # sums of 1, R, R^2, t, t * R (decayed)

    def add(self, rows: float, seconds: float) -> None:
        d = self.decay
        for i, x in enumerate((1.0, rows, rows * rows, seconds, seconds * rows)):
            self.s[i] = d * self.s[i] + x

    def solve(self) -> tuple[float, float] | None:
        """(a, m), or None while R has too little spread to separate them."""
        n, sr, srr, st, str_ = self.s
        if n <= 0:
            return None
        var = srr / n - (sr / n) ** 2
        if var < 0.25:
            return None
        m = max((str_ / n - (sr / n) * (st / n)) / var, 0.0)
        return st / n - m * sr / n, m


@dataclass
class StepCosts:
    decay: float = 0.9
    shape: str = "lanes"  # lanes | rows (see the module docstring)
    lanes: dict[Key, Ema] = field(default_factory=dict)
    marginal: dict[Key, Ema] = field(default_factory=dict)  # rows: seconds per draft row at (bucket, k)
    rows: dict[tuple[int, bool], LineFit] = field(default_factory=dict)  # rows: t0 when no plain step ran
    seen: dict[Key, Seen] = field(default_factory=dict)
    totals: dict[tuple[int, bool], int] = field(default_factory=dict)  # (k, refill) -> samples over all buckets
    prior: dict[Key, tuple[float, int]] = field(default_factory=dict)  # stored t(b, k) / t(b, 0), samples behind it
    prior_rows: dict[Key, tuple[float, int]] = field(default_factory=dict)  # stored m(b, k) / t(b, 0), rows shape

    def load_prior(self, ratios: dict[Key, tuple[float, int]], rows: dict[Key, tuple[float, int]]) -> None:
        """Stored ratios from an earlier run (`cost_store`): plain steps are measured live (they are free)."""
        self.prior = {key: v for key, v in ratios.items() if key[1] > 0 or key[2]}
        self.prior_rows = {key: v for key, v in rows.items() if key[1] > 0}
        for _, k, r in self.prior | self.prior_rows:
            self.totals[k, r] = max(self.totals.get((k, r), 0), PRIOR_SAMPLES)

    def prior_state(self) -> tuple[dict[Key, tuple[float, int]], dict[Key, tuple[float, int]]]:
        """What to store: the live ratios over the prior's (their samples added up)."""
        ratios, rows = dict(self.prior), dict(self.prior_rows)
        for table, out, base_of in ((self.lanes, ratios, self._base), (self.marginal, rows, self.plain)):
            for (b, k, r), e in table.items():
                base = base_of(b, r)
                if e.value is None or not base or (k == 0 and not r) or not e.value > 0:
                    continue
                out[b, k, r] = (e.value / base, min(e.count + out.get((b, k, r), (0.0, 0))[1], 10**6))
        return ratios, rows

    def observe(self, batch: int, num_draft: np.ndarray, refill: bool, seconds: float, step: int = -1) -> None:
        """One step's device seconds, under the k its widest lane drafted."""
        b, k = bucket(batch), int(num_draft.max(initial=0))
        key = (b, k, refill)
        seen = self.seen.get(key) or self.seen.setdefault(key, Seen())
        seen.count += 1
        seen.last_step = step
        self.totals[k, refill] = self.totals.get((k, refill), 0) + 1
        if self.shape == "lanes" or k == 0:
            (self.lanes.get(key) or self.lanes.setdefault(key, Ema(self.decay))).add(seconds)
        if self.shape == "rows":
            rows = float(num_draft.sum())
            fit = self.rows.get((b, refill)) or self.rows.setdefault((b, refill), LineFit(self.decay))
            fit.add(rows, seconds)
            t0 = self.plain(batch, refill)
            if k > 0 and t0 is not None:
                ema = self.marginal.get(key) or self.marginal.setdefault(key, Ema(self.decay))
                ema.add((seconds - t0) / rows, weight=rows)

    def samples(self, batch: int, k: int, refill: bool) -> int:
        seen = self.seen.get((bucket(batch), k, refill))
        return 0 if seen is None else seen.count

    def last_step(self, batch: int, k: int, refill: bool) -> int:
        seen = self.seen.get((bucket(batch), k, refill))
        return -1 if seen is None else seen.last_step

    def total_samples(self, k: int, refill: bool) -> int:
        return self.totals.get((k, refill), 0)

    def _nearest(self, batch: int, values: dict[int, float]) -> float | None:
        if not values:
            return None
        target = bucket(batch).bit_length()
        return values[min(values, key=lambda b: abs(b.bit_length() - target))]

    def plain(self, batch: int, refill: bool) -> float | None:
        """t(B, 0): a step in which nobody drafts. Rows shape, where no such step ran in this bucket (a fixed-k
        request always drafts): the intercept of the line through the steps' (R, seconds)."""
        ema = self.lanes.get((bucket(batch), 0, refill))
        if ema is not None:
            return ema.value
        fit = self.rows.get((bucket(batch), refill))
        line = None if fit is None else fit.solve()
        return None if line is None else line[0]

    def _marginal(self, batch: int, k: int, refill: bool) -> float | None:
        ema = self.marginal.get((bucket(batch), k, refill))
        if ema is not None:
            return ema.value
        fit = self.rows.get((bucket(batch), refill))
        line = None if fit is None else fit.solve()
        return None if line is None else line[1]

    def _base(self, b: int, refill: bool) -> float | None:
        """The plain cost that ratios are taken against: without refill where measured (what "off" costs)."""
        for r in (False, refill, True):
            ema = self.lanes.get((b, 0, r))
            if ema is not None and ema.value:
                return ema.value
        return None

    def _relative(self, batch: int, k: int, refill: bool, table: dict[Key, Ema]) -> float | None:
        """table[(b, k)] / t(b, 0) at the nearest bucket measuring both: ratios carry over between buckets."""
        ratios = {}
        for (b, kk, r), e in table.items():
            base = self._base(b, r)
            if kk == k and r == refill and base:
                ratios[b] = e.value / base
        return self._nearest(batch, ratios)

    def row_cost(self, batch: int, k: int, refill: bool, t0: float) -> float | None:
        """Rows shape: seconds per verified draft row in a step whose widest lane drafts k (never negative), given
        its plain cost t0 (a ratio measured in another bucket scales by it); None until measured."""
        m = self._marginal(batch, k, refill)
        if m is None:
            stored = self.prior_rows.get((bucket(batch), k, refill))
            rel = stored[0] if stored else self._relative(batch, k, refill, self.marginal)
            m = None if rel is None else rel * t0
        return None if m is None else max(m, 0.0)

    def predict(self, batch: int, num_draft: np.ndarray, refill: bool) -> float | None:
        """Expected seconds of a step whose lanes draft `num_draft`; None until enough is measured."""
        k = int(num_draft.max(initial=0))
        if k == 0:
            return self.plain(batch, refill)
        if self.shape == "rows":
            t0 = self.plain(batch, refill)
            m = None if t0 is None else self.row_cost(batch, k, refill, t0)
            return None if m is None else t0 + m * float(num_draft.sum())
        ema = self.lanes.get((bucket(batch), k, refill))
        value = None if ema is None else ema.value
        t0 = self._base(bucket(batch), refill)
        if value is None and t0 is not None:
            stored = self.prior.get((bucket(batch), k, refill))
            rel = stored[0] if stored else self._relative(batch, k, refill, self.lanes)
            value = None if rel is None else rel * t0
        if value is None:
            return None
        # More drafts never cost less: noise must not say otherwise.
        for kk in range(1, k):
            lower = self.lanes.get((bucket(batch), kk, refill))
            if lower is not None:
                value = max(value, lower.value)
        return value

    def to_dict(self) -> dict[str, float]:
        """"bucket/k/refill" -> ms (rows shape, k > 0: ms per draft row)."""
        out = {f"{b}/{k}/{int(r)}": round(e.value * 1e3, 4) for (b, k, r), e in sorted(self.lanes.items())}
        out |= {f"{b}/{k}/{int(r)}": round(e.value * 1e3, 4) for (b, k, r), e in sorted(self.marginal.items())}
        return out
