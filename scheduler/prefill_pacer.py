"""Keeping a calibrated chunked-prefill budget true while serving (`PrefillBudget.multiple`).

The start-up fit times single prompt chunks on an idle engine; serving moves what a mixed step really costs
(on a shared host a neighbour's load moves every step; a mixed step's lanes and the attention backend's
padding add what a single chunk did not show: measured ~2x on SmolLM2 on CPU). So the pacer bounds a mixed
step by the running batch's own plain decode step (the speculation policy's live step costs: the gap the
streams see), takes a mixed step to cost that decode step plus its chunks, and scales the chunks' modelled cost
by what recent mixed steps really cost beyond the decode step.

    room for chunks = (multiple - 1) x decode step / scale       (in the fit's seconds)
    scale           = the second largest, over the last WINDOW mixed steps, of
                      (step seconds - decode step) / modelled chunk cost

The bound is on the streams' tail (their p99 gap while a prompt is prefilled), so the pacer paces on the tail of
what mixed steps cost, not their median: paced on the median, half the mixed steps ran past the multiple and the
streams' p99 gap was 3.9x their median at --max-step-latency 3 (4,000-token prompts beside four streams,
SmolLM2, AVX2 host). The second largest of sixteen (about their 90th percentile) ignores one neighbour's burst.
"""

from __future__ import annotations

from collections import deque

from specstep.scheduler.prefill_budget import MIN_BUDGET, PrefillBudget

MIN_CHUNK_SHARE = 4  # a step's first prompt chunk may take a quarter of an empty step's room, whatever is left
WINDOW = 16  # mixed steps the scale is taken over
TAIL = 2  # the scale is the TAIL-th largest ratio of the window: one slow step (a neighbour's burst) is ignored
MIN_SCALE = 0.1  # a step measured faster than its decode step alone (noise) must not make chunks unbounded


class PrefillPacer:
    def __init__(self, budget: PrefillBudget) -> None:
        self.budget = budget
        self._ratios: deque[float] = deque(maxlen=WINDOW)

    @property
    def scale(self) -> float:
        if not self._ratios:
            return 1.0
        ranked = sorted(self._ratios, reverse=True)
        return max(ranked[min(TAIL, len(ranked)) - 1], MIN_SCALE)

    def room(self, num_decode: int, decode_s: float | None) -> float:
        """The cost prompt chunks may add to a step beside `num_decode` decode rows. Fixed: the tokens the rows
        leave. Calibrated: (multiple - 1) x the batch's plain decode step (`decode_s`; None before one was timed:
        start-up's, at batch 1) over the scale, and never less than MIN_BUDGET tokens' modelled cost."""
        b = self.budget
        if b.multiple is None:
            return b.tokens - num_decode
        room = (b.multiple - 1.0) * (decode_s or b.decode_s) / self.scale
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
            self._ratios.append((seconds - (decode_s or b.decode_s)) / chunks_cost)
