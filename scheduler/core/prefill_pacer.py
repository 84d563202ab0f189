"""Keeping a calibrated chunked-prefill budget true while serving (`PrefillBudget.multiple`).

A mixed step runs the running batch's decode step (speculative where the policy decides so) and the step's prompt
chunks: in one forward where the engine fuses them (`PrefillBudget.fused`), else a prompt forward after the
decode step. The streams see a gap of both, so the pacer holds what the chunks add to

    room for chunks = (multiple - 1) x decode step - overhead - HEADROOM x the fit's median residual

where the decode step is the batch's step as decided, priced by the speculation policy's live step costs, and
the overhead is what the chunks cost beyond their tokens (a prompt forward's fixed cost; fused, about nothing).
The compute-efficient size (`efficient`, where a token's cost stops falling) is its floor: smaller forwards pay
the fixed cost for few rows and lose throughput, whatever they saved the streams (fused, the decode rows count
towards it). With no stream running there is no gap to protect: prompts are prefilled whole, several sharing a
forward, up to `--max-prefill-tokens` (a longer one in forwards of that size), as whole-prompt prefill does.

The start-up fit times single prompt forwards on an idle engine; serving moves what they really cost (a
neighbour's load; contexts far beyond the probes). So the pacer refits the prompt forward's cost model on what
recent ones really cost, in the start-up model's own terms:

    prompt forward seconds = overhead + sum over chunks of per_token q + per_key q (ctx + q) + per_context ctx

a ridge regression over the last WINDOW forwards pulled towards the start-up model (worth PRIOR_STEPS steps),
robust to a neighbour's burst (one Huber reweighting), every term kept a cost (>= 0). Why not a correction on
top of the start-up model: a scale and an overhead fitted against its modelled cost cannot tell which term is
off. A 1-16 token chunk late in a 4,000-token prompt is almost all context read (per_context x ctx) and an early
one almost all tokens; when the probes misjudged one term the scale swung between 0.5 and 16 from step to step,
chunks between 3 and 100 tokens, and the streams' p99 gap ran to 5-7x their median (SmolLM2, AVX2 host).
`chunk` / `chunk_cost` price chunks with the live model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from specstep.scheduler.core.prefill_budget import PrefillBudget, StepCostModel

MIN_CHUNK_SHARE = 4  # a step's first prompt chunk may take a quarter of an empty step's room, whatever is left
WINDOW = 32  # prompt forwards the live model is fitted over
# What the start-up model weighs in the live fit, in prompt forwards: enough to keep the first steps' fit sane,
# little enough not to bias a full window (1 of 33). The overhead is the start-up fit's least sure term: its pull
# is weaker.
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


@dataclass(frozen=True, slots=True)
class Pacing:
    """Why prompts advance as they do, at the current batch (STATS, gauges): the prompt tokens a step takes at
    context 0 beside the running streams (with none: `--max-prefill-tokens`), the streams' ITL target (a
    mixed step's longest planned gap; 0 with a fixed budget), the compute-efficient prompt forward, and the share
    of steps run so far that were mixed."""

    budget_tokens: int
    itl_target_s: float
    efficient_tokens: int
    mixed_share: float


def features(chunks: Chunks) -> np.ndarray:
    """[1, sum q, sum q (ctx + q), sum ctx]: the live model's terms for one mixed step."""
    q = np.array([c[0] for c in chunks], dtype=np.float64)
    ctx = np.array([c[1] for c in chunks], dtype=np.float64)
    return np.array([1.0, q.sum(), (q * (ctx + q)).sum(), ctx.sum()])


class PrefillPacer:
    def __init__(self, budget: PrefillBudget) -> None:
        self.budget = budget
        self._steps: deque[tuple[np.ndarray, float]] = deque(maxlen=WINDOW)  # (features, seconds)
        m = budget.model
        # A fused mixed step's chunks pay no forward's fixed cost of their own: none is assumed before one is seen
        overhead = m.fixed if budget.multiple is not None and not budget.fused else 0.0
        self._prior = np.array([overhead, m.per_token, m.per_key, m.per_context])
        self._overhead = overhead
        self._spread = 0.0  # median absolute residual of the live fit, seconds
        self._live = budget  # the budget priced with the live model

    @property
    def model(self) -> StepCostModel:
        """The live chunk cost model (the start-up one until prompt forwards were seen)."""
        return self._live.model

    @property
    def overhead(self) -> float:
        """Seconds a prompt forward costs beyond its chunks' `chunk_cost` (the weights' pass, launches)."""
        return self._overhead

    @property
    def efficient(self) -> int:
        """The compute-efficient prompt forward in tokens at context 0, from start-up's measured curve (0 for a
        fixed budget). Not refitted: a window of like-sized forwards cannot tell the fixed cost from the tokens'
        (the fit moves along that line), and the size follows from their ratio; the live model prices it."""
        return self.budget.efficient

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
            # A burst is a residual beyond HUBER MADs and beyond a tenth of a typical forward's cost (an exact
            # fit's MAD is ~0: it would cut every step)
            cut = max(HUBER * mad, 0.1 * float(np.median(np.abs(y))))
            w = np.minimum(1.0, cut / np.maximum(r, 1e-12))
        theta = np.maximum(theta, 0.0) / s
        self._overhead = float(theta[0])
        self._spread = mad if len(y) >= MIN_SPREAD_STEPS else 0.0
        model = StepCostModel(self.budget.model.fixed, *theta[1:].tolist())
        self._live = replace(self.budget, model=model)

    def forward_s(self, rows: int) -> float:
        """A forward of `rows` rows at a short context as start-up priced prompt rows (its fixed cost, and
        per_token a row): an estimate of a decode step no step has timed yet."""
        m = self.budget.model
        return m.fixed + m.per_token * rows

    def itl_target(self, decode_s: float | None, steady_s: float | None = None) -> float | None:
        """The longest gap a mixed step may give the running streams: `multiple` x their decode step (`decode_s`;
        None before one was timed: start-up's, at batch 1), or x the steady batch's (`steady_s`: the running,
        prefilling and waiting requests together, at most the batch size) where that is longer: once the waiting
        prompts decode, the streams see that step anyway, and holding prompts back to protect a shorter gap only
        kept the batch small (at 64 clients the streams' gap halved and throughput fell to 0.74x whole-prompt
        prefill's). None for a fixed budget."""
        b = self.budget
        return None if b.multiple is None else b.multiple * max(decode_s or b.decode_s, steady_s or 0.0)

    def room(self, num_decode: int, decode_s: float | None, steady_s: float | None = None) -> float:
        """The cost prompt chunks may add to a step beside `num_decode` decode rows. Fixed: the tokens the rows
        leave. Calibrated, with streams running: their ITL target less their decode step and the prompt
        forward's live overhead, and never less than the compute-efficient size's cost at context 0 (fused: what
        the decode rows leave of it); with none, a whole-prompt step's (`max_tokens` at context 0: a prompt late in
        its chunks when the streams ended must not go on in chunks sized for them)."""
        b = self.budget
        if b.multiple is None:
            return b.tokens - num_decode
        if num_decode == 0:
            return self.chunk_cost(b.max_tokens, 0)
        # Below the compute-efficient size each chunk pays the forward's fixed cost for few tokens: where the ITL
        # target leaves less (a small batch; the fixed cost itself past the target), prefill keeps that size, and
        # the streams' gap is what one efficient forward adds to their step. Fused, the decode rows share the
        # forward: they count towards the size.
        floor = max(self.efficient - num_decode, 0) if b.fused else self.efficient
        return max(self._stream_room(decode_s, steady_s), self.chunk_cost(floor, 0))

    def _stream_room(self, decode_s: float | None, steady_s: float | None) -> float:
        d = decode_s or self.budget.decode_s
        return self.itl_target(d, steady_s) - d - self._overhead - HEADROOM * self._spread

    def plan(self, num_decode: int, decode_s: float | None, steady_s: float | None = None) -> tuple[float, float]:
        """(the room for prompt chunks, the floor of the step's first chunk: a quarter of the streams' room, so
        prompts advance whatever the decode rows take)."""
        room = self.room(num_decode, decode_s, steady_s)
        if self.budget.multiple is None:
            return room, self.room(0, decode_s) / MIN_CHUNK_SHARE
        return room, max(self._stream_room(decode_s, steady_s), 0.0) / MIN_CHUNK_SHARE

    def budget_tokens(self, num_decode: int, decode_s: float | None, steady_s: float | None = None) -> int:
        """The prompt tokens a step takes at context 0 beside `num_decode` streams (the figure users see)."""
        b = self.budget
        if b.multiple is None:
            return max(0, b.tokens - num_decode)
        return min(max(self.model.tokens_within(self.room(num_decode, decode_s, steady_s), 0), 1), b.max_tokens)

    def chunk(self, left: float, ctx: int, remaining: int, floor: float | None = None) -> int:
        return self._live.chunk(left, ctx, remaining, floor)

    def chunk_cost(self, q: int, ctx: int) -> float:
        return self._live.chunk_cost(q, ctx)

    def observe(self, chunks: Chunks, seconds: float, beside_decode: bool = True) -> None:
        """These chunks added `seconds` to a step (`beside_decode`: a mixed step's, with streams decoding; else a
        prompt forward of its own). Fused, a forward of its own pays the fixed cost a mixed step's chunks share
        with the decode rows: it is not what the pacer paces, and it is not learned."""
        if self.budget.fused and not beside_decode:
            return
        if self.budget.multiple is not None and chunks:
            self._steps.append((features(chunks), seconds))
            self._refit()
