"""The floor under the bet: a governor on realised throughput, relative to plain decoding.

Every speculative step in which policy-chosen (auto) requests drafted by the policy's choice or as a probe
(not exploration or re-measurement, which run k values on purpose) reports what it produced, T tokens (the
accepted drafts plus one per lane), and what plain decoding would have produced in the same device time,
P = B * seconds / t_plain(B). t_plain is the governor's own baseline, the median of its latest `plain_window`
plain steps in the batch bucket (the policy measures plain three times per bucket first, then re-measures it on
a schedule), not the cost model's estimate: one noisy plain step used to mislead both together. While on, the
step's catch-up of a stale draft is in its seconds; a probe's is not (it asks what speculating gives from now
on; its catch-up is the price of asking, paid by the probe budget below). Over a window of such steps the
realised ratio is R = sum(T) / sum(P), with the delta-method standard error
    se(R) = sqrt(var(T_i - R * P_i) / n) / mean(P).

    on   -> off   when R + z * se(R) < 1 - delta   (confident that speculating loses more than delta)
    off  -> on    when R - z' * se(R) > 1          over the latest probes (likely that it wins again; z' < z
                                                   since a wrong "on" costs at most min_samples steps)

While on, samples older than `max_age` steps run (judged or not) drop out. While off, every step is plain
except probes: at most one in every ceil(1 / epsilon) steps, and never before epsilon of the off device time
since the last probe has paid for that probe's overhead (its catch-up plus its time beyond the plain time of the
tokens it emitted: a probe that paid owes nothing). A probe is spent only when its step runs (`peek` decides,
`commit_tick` spends): one decided for a chained step that is re-planned stays due, so it is not lost.

The bound. The loss against plain decoding is about
    delta      while on, beyond the one-off exploration and the min_samples..window steps it takes to be confident,
    epsilon    while off (probe overhead, catch-up included, is at most epsilon of the off device time),
plus the overhead of the first probe after each switch off (it is paid before the budget can defer the next).
With the defaults (delta = epsilon = 0.02) that is about 2-4%. It assumes:
  - plain cost stationary over the governor's last few plain steps per bucket (they are re-measured one step in
    `remeasure_every` while speculating; a load change between them biases P until the next ones);
  - acceptance stationary over the window while on, and over the latest `resume_window` probes while off (after
    a fall in acceptance the on window still holds the earlier wins: speculation goes off through the policy's
    own acceptance estimate first, and the governor follows once the old samples age out, `max_age` steps run);
  - a probe's catch-up small against epsilon x the off time before it. The policy makes it so: a probe from plain
    decoding catches up only the lanes it drafts with (those cheapest to catch up, as many as
    `probes.PROBE_CATCH_UP` of a plain step buys, at least one), so its catch-up no longer grows with
    batch x steps off; such a subset probe is judged for the whole batch (B x (1 + accepted per probed lane)
    tokens), which assumes the probed lanes' acceptance stands for the others';
  - on the overlap path, the probe clock given back whenever a chained decision is dropped (above).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import median


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
    plain_window: int = 3  # its own plain baseline: the median of the latest plain steps per batch bucket
    max_age: int = 1024  # while on, samples older than this many steps run (judged or not) no longer count
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
        self._plain: dict[int, deque[float]] = {}  # batch bucket -> seconds of its latest plain steps
        self._debt = 0.0  # probe overhead (catch-up, excess over a plain step) not yet amortised by off time
        self._ran = 0  # steps run: the on window's samples age by these, not only by judged steps

    @staticmethod
    def bounds(samples, z: float) -> tuple[float, float, float] | None:
        """(ratio, lower, upper) of sum(T) / sum(P) over (T, P) samples."""
        n = len(samples)
        if n == 0:
            return None
        ts = [s[0] for s in samples]  # lists, summed and zipped below: cheaper than generators over the deque
        ps = [s[1] for s in samples]
        t = sum(ts)
        p = sum(ps)
        if p <= 0:
            return None
        r = t / p
        resid = [a - r * b for a, b in zip(ts, ps)]
        mean = sum(resid) / n
        var = sum([(x - mean) ** 2 for x in resid]) / max(n - 1, 1)
        se = math.sqrt(var / n) / (p / n)
        return r, r - z * se, r + z * se

    def state(self) -> tuple[float, float, float] | None:
        return self.bounds(self._samples, self.cfg.z)

    def peek(self) -> tuple[bool, bool]:
        """What `tick` would do, with no side effect: (counted as an off step, a probe is due)."""
        if self.on or not self.cfg.enabled:
            return False, False
        return True, self._since_probe + 1 >= self.cfg.probe_every and self._debt <= 0.0

    def steps_to_probe(self) -> int:
        """Off steps before a probe comes due by the clock (<= 0: due, or waiting only for the debt)."""
        return self.cfg.probe_every - (self._since_probe + 1)

    def commit_tick(self, counted: bool, probe: bool) -> None:
        """Apply a `peek` once its step runs: the off step counted, the probe spent."""
        if not counted:
            return
        self.off_steps += 1
        self._since_probe = 0 if probe else self._since_probe + 1
        self.probes += int(probe)

    def tick(self) -> bool:
        """Called once per decode decision; True if this step should be a probe (off, and one is due)."""
        counted, probe = self.peek()
        self.commit_tick(counted, probe)
        return probe

    def observe_plain(self, bucket: int, seconds: float) -> None:
        """A step in which nobody drafted: the governor's own plain baseline, apart from the cost model's."""
        self._plain.setdefault(bucket, deque(maxlen=self.cfg.plain_window)).append(seconds)

    def plain(self, bucket: int) -> float | None:
        """Median of the latest plain steps in the bucket: one noisy step does not move it."""
        xs = self._plain.get(bucket)
        return float(median(xs)) if xs else None

    def ran(self, seconds: float) -> None:
        """Every step that ran, judged or not: while off, its time amortises the probes' overhead (a fraction
        epsilon of it may go to probing); while on, it ages the window."""
        self._ran += 1
        if not self.on:
            self._debt = max(0.0, self._debt - self.cfg.epsilon * seconds)

    def owe(self, seconds: float) -> None:
        """A probe's overhead over the plain step it replaced (its catch-up included): the next probe waits
        until epsilon of the off time since has paid for it, so probing costs at most epsilon in time."""
        self._debt += max(0.0, seconds)

    def observe(self, tokens: float, plain_tokens: float) -> None:
        """A speculative step with auto requests drafting: tokens it emitted, tokens plain would have."""
        if not self.cfg.enabled or plain_tokens <= 0:
            return
        if self.on:  # a verdict about now, even when few steps are judged: drop samples too old in steps run
            while self._samples and self._samples[0][2] <= self._ran - self.cfg.max_age:
                self._samples.popleft()
        self._samples.append((tokens, plain_tokens, self._ran))
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
        self._debt = 0.0
        # A fresh verdict in the new state: the old one was about the other regime.
        self._samples = deque(maxlen=self.cfg.window if on else self.cfg.resume_window)
