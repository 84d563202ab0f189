"""Keeping a calibrated chunked-prefill budget true while serving (`PrefillBudget.multiple`).

The start-up fit times single prompt chunks on an idle engine; serving moves what a mixed step really costs
(on a shared host a neighbour's load moves every step; a mixed step's lanes and the attention backend's
padding add what a single chunk did not show: measured ~2x on SmolLM2 on CPU). So the pacer bounds a mixed
step by the running batch's own plain decode step (the speculation policy's live step costs: the gap the
streams see), and fits what recent mixed steps really cost beyond that decode step as an overhead plus a
scale of the chunks' modelled cost:

    step seconds - decode step = overhead + scale x modelled chunk cost     (over the last WINDOW mixed steps)
    room for chunks            = ((multiple - 1) x decode step - overhead) / scale

Theil-Sen (the median of pairwise slopes, then the median intercept): one slow step (a neighbour's burst)
moves neither. The overhead matters: a mixed step's decode rows cost more than the plain decode step (its
batch is padded and takes the prompt path); taken as a ratio alone, that fixed extra made small chunks look
dear, the ratio grew as chunks shrank, and chunks shrank to the floor (a 4,000-token prompt's TTFT 3-4x a
whole-prompt prefill's, SmolLM2 on the AVX2 host).
"""

from __future__ import annotations

import statistics
from collections import deque
from itertools import combinations

from specstep.scheduler.prefill_budget import MIN_BUDGET, PrefillBudget

MIN_CHUNK_SHARE = 4  # a step's first prompt chunk may take a quarter of an empty step's room, whatever is left
WINDOW = 16  # mixed steps the fit is made over
MIN_SCALE = 0.1  # a step measured faster than its decode step alone (noise) must not make chunks unbounded


class PrefillPacer:
    def __init__(self, budget: PrefillBudget) -> None:
        self.budget = budget
        self._steps: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (modelled chunk cost, extra seconds)
        self._fit = (0.0, 1.0)  # refitted once per observed step, read twice per planned step

    def fit(self) -> tuple[float, float]:
        """(overhead seconds, scale) of recent mixed steps' cost beyond their decode step."""
        return self._fit

    def _refit(self) -> tuple[float, float]:
        if not self._steps:
            return 0.0, 1.0
        slopes = [(y1 - y0) / (x1 - x0) for (x0, y0), (x1, y1) in combinations(self._steps, 2)
                  if abs(x1 - x0) > 0.05 * max(x0, x1)]
        if len(slopes) < max(1, len(self._steps) - 1):  # chunks alike: the overhead cannot be told from the scale
            return 0.0, max(statistics.median(y / x for x, y in self._steps), MIN_SCALE)
        scale = max(statistics.median(slopes), MIN_SCALE)
        return max(statistics.median(y - scale * x for x, y in self._steps), 0.0), scale

    @property
    def scale(self) -> float:
        return self.fit()[1]

    def room(self, num_decode: int, decode_s: float | None) -> float:
        """The cost prompt chunks may add to a step beside `num_decode` decode rows. Fixed: the tokens the rows
        leave. Calibrated: (multiple - 1) x the batch's plain decode step (`decode_s`; None before one was timed:
        start-up's, at batch 1) less the overhead, over the scale (`fit`), and never less than MIN_BUDGET tokens'
        modelled cost."""
        b = self.budget
        if b.multiple is None:
            return b.tokens - num_decode
        overhead, scale = self.fit()
        room = ((b.multiple - 1.0) * (decode_s or b.decode_s) - overhead) / scale
        return max(room, b.chunk_cost(min(MIN_BUDGET, b.max_tokens), 0))

    def plan(self, num_decode: int, decode_s: float | None) -> tuple[float, float]:
        """(the room for prompt chunks, the floor of the step's first chunk: a quarter of an empty step's room,
        so prompts advance whatever the decode rows take)."""
        return self.room(num_decode, decode_s), self.room(0, decode_s) / MIN_CHUNK_SHARE

    def observe(self, chunks_cost: float, seconds: float, decode_s: float | None) -> None:
        """A mixed step took `seconds`; its chunks' modelled cost was `chunks_cost`, its batch's decode step
        `decode_s` (as passed to `plan`)."""
        b = self.budget
        if b.multiple is not None and chunks_cost > 0:
            self._steps.append((chunks_cost, seconds - (decode_s or b.decode_s)))
            self._fit = self._refit()
