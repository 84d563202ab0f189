"""Pricing a speculative step the policy takes to learn (an exploration of a new k, a probe) by the host's own costs.

A step drafting k pays back when the drafts it gets accepted cover its overhead over plain decoding: each drafting
lane must average at least the break-even b(k) extra tokens (`ThroughputModel.break_even`: t(B, k) / t(B, 0) - 1
for lanes, its share of its own verify rows for rows). Where verify grows steeply with rows (an AVX-512 CPU at
batch 6: a k = 4 verify step 3.1x a plain one) b(k) is large, and a step at that k is worth taking only if the
acceptance the evidence still allows could reach it:

    E(k, a_hi) - 1 >= b(k)        a_hi: the upper confidence bound of the acceptance (Wilson, one-sided z)

A k whose cost is not measured yet is priced from the widest measured k' below it, its overhead scaled by k / k'
(each draft adds a forward and a verify row), so a k = 1 step that did not pay keeps the policy from trying
k = 4 at the same acceptance; and no k is tried before every narrower one was measured. The evidence ages
while a request (or the batch) does not draft, halving every `half_life` steps: the workload may have changed, so
probes resume by themselves, sooner where the host's verify is cheap (a low b(k) needs little doubt) and much later
where it is dear. The cheapest k that can pay is the one to try: it is also the most informative per second.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from specstep.scheduler.spec.throughput import expected_tokens

if TYPE_CHECKING:
    from specstep.scheduler.spec.decision import RequestAcceptance
    from specstep.scheduler.spec.throughput import ThroughputModel

Z = 1.64  # one-sided 95%: as the governor's bound for switching off


def acceptance_upper(accepted: float, trials: float, z: float = Z) -> float:
    """Wilson upper bound of a per-position acceptance seen `accepted` times in `trials` (1.0 with no trials)."""
    if trials <= 0:
        return 1.0
    p = min(max(accepted / trials, 0.0), 1.0)
    z2 = z * z
    centre = p + z2 / (2 * trials)
    spread = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials))
    return min(1.0, (centre + spread) / (1 + z2 / trials))


def aged_upper(acc: RequestAcceptance, idle: int, half_life: float) -> float:
    """`acc`'s upper bound with its evidence halved every `half_life` steps of `idle`."""
    weight = 0.5 ** (idle / half_life) if half_life > 0 else 1.0
    return acceptance_upper(acc.accepted * weight, acc.trials * weight)


class Payback:
    """Whether, and at which k, a step taken to learn can pay back at the acceptance the evidence allows."""

    def __init__(self, model: ThroughputModel) -> None:
        self.model = model

    def break_even(self, b: int, k: int) -> tuple[float, bool]:
        """Accepted drafts per drafting lane a step at k needs, and whether k's own cost is measured (else the
        widest measured k' < k prices it, its overhead scaled by k / k': drafts and verify rows grow with k; 0.0
        where nothing is measured: unknown costs are what exploration is for)."""
        refill = self.model.refill(np.ones(1, np.int64))
        for kk in range(k, 0, -1):
            be = self.model.break_even(b, kk, refill)
            if be is not None:
                return be * k / kk, kk == k
        return 0.0, False

    def can_pay(self, b: int, k: int, alpha_hi: np.ndarray | float) -> bool:
        """The drafting lanes' mean extra tokens at their upper-bound acceptance reach the break-even at k."""
        gain = expected_tokens(np.atleast_1d(np.asarray(alpha_hi, dtype=np.float64)), k) - 1.0
        return float(gain.mean()) >= self.break_even(b, k)[0]

    def payable(self, b: int, ks: list[int], alpha_hi: np.ndarray | float) -> list[int]:
        """The k > 0 in `ks` that can pay, cheapest first, up to the first whose cost is not measured: a wider k
        priced only by a narrower one's cost is never tried before the narrower one could pay."""
        out = []
        for k in sorted(k for k in ks if k > 0):
            be, measured = self.break_even(b, k)
            gain = expected_tokens(np.atleast_1d(np.asarray(alpha_hi, dtype=np.float64)), k) - 1.0
            if float(gain.mean()) >= be:
                out.append(k)
            if not measured:
                break
        return out

    def cheapest(self, b: int, ks: list[int], alpha_hi: np.ndarray | float) -> int | None:
        """The smallest k > 0 in `ks` that can pay; None if none can."""
        return min(self.payable(b, ks, alpha_hi), default=None)
