"""Keeping a calibrated chunked-prefill budget true while serving (`PrefillBudget.multiple`).

The start-up fit times single prompt chunks on an idle engine at contexts up to ~1,000; serving moves what a
mixed step really costs (a neighbour's load; a mixed step's decode rows and attention parts; contexts far
beyond the probes). So the pacer bounds a mixed step by the running batch's own plain decode step (the
speculation policy's live step costs: the gap the streams see) and refits the chunk cost model on what recent
mixed steps really cost beyond that decode step, in the start-up model's own terms:

    step seconds - decode step = overhead + sum over chunks of per_token q + per_key q (ctx + q) + per_context ctx

a ridge regression over the last WINDOW mixed steps pulled towards the start-up model (worth PRIOR_STEPS
steps), robust to a neighbour's burst (one Huber reweighting), every term kept a cost (>= 0). Why not a
correction on top of the start-up model: a scale and an overhead fitted against its modelled cost (the pacer
before this one) cannot tell which term is off. A 1-16 token chunk late in a 4,000-token prompt is almost all
context read (per_context x ctx) and an early one almost all tokens; when the probes misjudged one term the
scale swung between 0.5 and 16 from step to step, chunks between 3 and 100 tokens, and the streams' p99 gap
ran to 5-7x their median (SmolLM2, AVX2 host).

The room the scheduler fills is then

    room for chunks = (multiple - 1) x decode step - overhead - HEADROOM x the fit's median residual

and `chunk` / `chunk_cost` price chunks with the live model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import numpy as np

from specstep.scheduler.core.prefill_budget import MIN_BUDGET, PrefillBudget, StepCostModel

MIN_CHUNK_SHARE = 4  # a step's first prompt chunk may take a quarter of an empty step's room, whatever is left
WINDOW = 32  # mixed steps the live model is fitted over
# What the start-up model weighs in the live fit, in mixed steps: enough to keep the first steps' fit sane, little
# enough not to bias a full window (1 of 33). Nothing is known of the overhead at start-up: its pull is weaker.
PRIOR_STEPS = np.array([0.25, 1.0, 1.0, 1.0])
# The bound is on the streams' slow gaps: a step planned to the bound runs past it half the time (p99 ~1.1x the
# bound, measured). So the room keeps HEADROOM median residuals free, once the fit has seen a few steps.
HEADROOM = 2.0
MIN_SPREAD_STEPS = 8
HUBER = 2.5  # residuals beyond this many MADs are down-weighted (a neighbour's burst)
IRLS_ROUNDS = 6  # one reweighting left a 10 s burst among 32 steps moving the context term by 80%
# The features' typical sizes (a 32-token chunk at context 2,048), so the prior weighs each term alike.
TYPICAL_Q, TYPICAL_CTX = 32.0, 2048.0

Chunks = list[tuple[int, int]]  # (tokens, context) of a mixed step's prompt chunks


def features(chunks: Chunks) -> np.ndarray:
    """[1, sum q, sum q (ctx + q), sum ctx]: the live model's terms for one mixed step."""
    q = np.array([c[0] for c in chunks], dtype=np.float64)
    ctx = np.array([c[1] for c in chunks], dtype=np.float64)
    return np.array([1.0, q.sum(), (q * (ctx + q)).sum(), ctx.sum()])


class PrefillPacer:
    def __init__(self, budget: PrefillBudget) -> None:
        self.budget = budget
        self._steps: deque[tuple[np.ndarray, float]] = deque(maxlen=WINDOW)  # (features, extra seconds)
        m = budget.model
        self._prior = np.array([0.0, m.per_token, m.per_key, m.per_context])
        self._overhead = 0.0
        self._spread = 0.0  # median absolute residual of the live fit, seconds
        self._live = budget  # the budget priced with the live model

    @property
    def model(self) -> StepCostModel:
        """The live chunk cost model (the start-up one until mixed steps were seen)."""
        return self._live.model

    @property
    def overhead(self) -> float:
        """Seconds a mixed step costs beyond its decode step and its chunks (its decode rows take the prompt
        path)."""
        return self._overhead

    def _refit(self) -> None:
        # Each term in units of a typical step's (the coefficients: seconds of it), so the prior's pull and the
        # least squares weigh the four terms alike.
        s = np.array([1.0, TYPICAL_Q, TYPICAL_Q * (TYPICAL_CTX + TYPICAL_Q), TYPICAL_CTX])
        x = np.stack([f for f, _ in self._steps]) / s
        y = np.array([e for _, e in self._steps])
        prior = self._prior * s
        w = np.ones(len(y))
        for _ in range(IRLS_ROUNDS):  # least squares, then reweighted: a burst's weight cut (Huber)
            sw = np.sqrt(w)[:, None]
            a = np.concatenate([x * sw, np.diag(np.sqrt(PRIOR_STEPS))])
            b = np.concatenate([y * sw[:, 0], np.sqrt(PRIOR_STEPS) * prior])
            theta, *_ = np.linalg.lstsq(a, b, rcond=None)
            r = np.abs(y - x @ theta)
            mad = float(np.median(r)) or 1e-12
            # A burst is a residual beyond HUBER MADs and beyond a tenth of a typical step's extra (an exact fit's
            # MAD is ~0: it would cut every step)
            cut = max(HUBER * mad, 0.1 * float(np.median(np.abs(y))))
            w = np.minimum(1.0, cut / np.maximum(r, 1e-12))
        theta = np.maximum(theta, 0.0) / s
        self._overhead = float(theta[0])
        self._spread = mad if len(y) >= MIN_SPREAD_STEPS else 0.0
        model = StepCostModel(self.budget.model.fixed, *theta[1:].tolist())
        self._live = replace(self.budget, model=model)

    def room(self, num_decode: int, decode_s: float | None) -> float:
        """The cost prompt chunks may add to a step beside `num_decode` decode rows. Fixed: the tokens the rows
        leave. Calibrated: (multiple - 1) x the batch's plain decode step (`decode_s`; None before one was timed:
        start-up's, at batch 1) less the live overhead, and never less than MIN_BUDGET tokens' cost at
        context 0."""
        b = self.budget
        if b.multiple is None:
            return b.tokens - num_decode
        room = (b.multiple - 1.0) * (decode_s or b.decode_s) - self._overhead - HEADROOM * self._spread
        return max(room, self.chunk_cost(min(MIN_BUDGET, b.max_tokens), 0))

    def plan(self, num_decode: int, decode_s: float | None) -> tuple[float, float]:
        """(the room for prompt chunks, the floor of the step's first chunk: a quarter of an empty step's room,
        so prompts advance whatever the decode rows take)."""
        return self.room(num_decode, decode_s), self.room(0, decode_s) / MIN_CHUNK_SHARE

    def chunk(self, left: float, ctx: int, remaining: int, floor: float | None = None) -> int:
        return self._live.chunk(left, ctx, remaining, floor)

    def chunk_cost(self, q: int, ctx: int) -> float:
        return self._live.chunk_cost(q, ctx)

    def observe(self, chunks: Chunks, seconds: float, decode_s: float | None) -> None:
        """A mixed step with these prompt chunks took `seconds`; its batch's decode step was `decode_s` (as
        passed to `plan`)."""
        b = self.budget
        if b.multiple is not None and chunks:
            self._steps.append((features(chunks), seconds - (decode_s or b.decode_s)))
            self._refit()
