"""The floor under the bet: a governor on realised throughput, relative to plain decoding.

Every speculative step in which policy-chosen (auto) requests drafted by the policy's choice or as a probe
(not exploration or re-measurement, which run k values on purpose) reports what it produced, T tokens (the
accepted drafts plus one per lane), and what plain decoding would have produced in the same device time,
P = B * seconds / t_plain(B) (the step's catch-up of a stale draft included in its seconds). Over a window of
such steps the realised ratio is R = sum(T) / sum(P), with the delta-method standard error
    se(R) = sqrt(var(T_i - R * P_i) / n) / mean(P).

    on   -> off   when R + z * se(R) < 1 - delta   (confident that speculating loses more than delta)
    off  -> on    when R - z' * se(R) > 1          over the latest probes (likely that it wins again; z' < z
                                                   since a wrong "on" costs at most min_samples steps)

While off, every step is plain except probes, at most one in every ceil(1 / epsilon) steps. So the loss
against plain decoding is bounded by about
    delta                                   while on (beyond the window it takes to become confident), plus
    epsilon * (probe cost / plain cost - 1) while off, where a probe that accepts nothing costs its full price.
With the defaults (delta = 0.02, epsilon = 0.02, a probe below 1.5x plain) that is about 3%.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GovernorConfig:
    delta: float = 0.02  # tolerated loss while speculating, as a fraction of plain throughput
    epsilon: float = 0.02  # the largest fraction of steps that are probes while off
    window: int = 128  # speculative steps (on) or probes (off) the confidence bound looks at
    min_samples: int = 8  # no verdict to switch off on fewer steps
    resume_samples: int = 3  # probes before a verdict to switch back on (probes are rare: do not wait for many)
    resume_window: int = 3  # while off, only the latest probes count (the workload may have changed since)
    z: float = 1.64  # one-sided 95% bound for switching off
    z_resume: float = 1.0  # one-sided 84% for switching back on: a wrong "on" costs min_samples steps at most
    enabled: bool = True

    def validate(self) -> None:
        if not 0.0 <= self.delta < 1.0:
            raise ValueError(f"governor delta must be in [0, 1), got {self.delta}")
        if not 0.0 < self.epsilon <= 1.0:
            raise ValueError(f"governor epsilon must be in (0, 1], got {self.epsilon}")

    @property
    def probe_every(self) -> int:
        return math.ceil(1.0 / self.epsilon)


class Governor:
    def __init__(self, cfg: GovernorConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.on = True
        self._samples: deque[tuple[float, float]] = deque(maxlen=cfg.window)
        self._since_probe = 0
        self.switches = 0  # on <-> off transitions
        self.probes = 0  # probe steps taken while off
        self.off_steps = 0  # steps taken while off (probes included)

    @staticmethod
    def bounds(samples, z: float) -> tuple[float, float, float] | None:
        """(ratio, lower, upper) of sum(T) / sum(P) over (T, P) samples."""
        n = len(samples)
        if n == 0:
            return None
        t = sum(s[0] for s in samples)
        p = sum(s[1] for s in samples)
        if p <= 0:
            return None
        r = t / p
        resid = [ti - r * pi for ti, pi in samples]
        mean = sum(resid) / n
        var = sum((x - mean) ** 2 for x in resid) / max(n - 1, 1)
        se = math.sqrt(var / n) / (p / n)
        return r, r - z * se, r + z * se

    def state(self) -> tuple[float, float, float] | None:
        return self.bounds(self._samples, self.cfg.z)

    def tick(self) -> bool:
        """Called once per decode decision; True if this step should be a probe (off, and one is due)."""
        if self.on or not self.cfg.enabled:
            return False
        self.off_steps += 1
        self._since_probe += 1
        if self._since_probe >= self.cfg.probe_every:
            self._since_probe = 0
            self.probes += 1
            return True
        return False

    def observe(self, tokens: float, plain_tokens: float) -> None:
        """A speculative step with auto requests drafting: tokens it emitted, tokens plain would have."""
        if not self.cfg.enabled or plain_tokens <= 0:
            return
        self._samples.append((tokens, plain_tokens))
        if len(self._samples) < (self.cfg.min_samples if self.on else self.cfg.resume_samples):
            return
        if self.on:
            r, lo, hi = self.bounds(self._samples, self.cfg.z)
            if hi < 1.0 - self.cfg.delta:
                self._switch(False)
        else:
            r, lo, hi = self.bounds(self._samples, self.cfg.z_resume)
            if lo > 1.0:
                self._switch(True)

    def _switch(self, on: bool) -> None:
        self.on = on
        self.switches += 1
        self._since_probe = 0
        # A fresh verdict in the new state: the old one was about the other regime.
        self._samples = deque(maxlen=self.cfg.window if on else self.cfg.resume_window)
