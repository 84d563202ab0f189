"""Chunked prefill mixed with decoding (`scheduler/core/prefill_budget.py`): which prompt chunks share a step with
the running requests, which run their decode step in it (speculative where the policy decides so). A prompt
part-way through its chunks is `Status.PREFILLING` in the scheduler's `prefilling` list: it holds a slot and the
pages of the chunks run so far.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from specstep.scheduler.core.page_allocator import PageAllocator
from specstep.scheduler.core.prefill_pacer import PrefillPacer
from specstep.scheduler.core.request import Request

Chunk = tuple[Request, int]  # (request, prompt tokens in this step)


class ChunkPlanner:
    """Plans a mixed step's prompt chunks; the scheduler owns the queues and admits through `admit`."""

    def __init__(self, allocator: PageAllocator, pacer: PrefillPacer, max_batch_size: int,
                 step_tokens: Callable[[int], int]) -> None:
        self.allocator = allocator
        self.pacer = pacer
        self.max_batch_size = max_batch_size
        self.step_tokens = step_tokens  # positions a decode step over n known tokens writes (the allocator's rule)

    def plan(self, num_decode: int, decode_tokens: int, prefilling: list[Request], waiting: deque[Request],
             decode_s: float | None, admit: Callable[[Request], None],
             steady_s: float | None = None) -> list[Chunk]:
        """What is left of the step's budget after its `num_decode` decode rows, which verify `decode_tokens`
        tokens (their drafts and the token after them; `PrefillBudget`: tokens, or a cost `PrefillPacer` keeps
        true against `decode_s`, the batch's decode step as decided, or `steady_s`, the steady batch's, where
        longer: `PrefillPacer.itl_target`) goes to prompts,
        those part-way through first (oldest first), then new admissions (`admit` moves a waiting prompt into
        `prefilling`). The step's first chunk gets a floor even when the decode rows take the whole budget, so
        prompts are never starved. Pages are reserved per chunk. A prompt is admitted only if all of it fits
        beside the other unfinished prefills, so prefills never block each other."""
        left, floor = self.pacer.plan(decode_tokens, decode_s, steady_s)
        chunks: list[Chunk] = []
        # A prompt with other prompts behind it (part-way through, or waiting for a slot) takes at most half of
        # what is left: a short prompt arriving behind a long one is done within a few steps, not after all of
        # the long one's chunks (as vLLM's long_prefill_token_threshold).
        admitting = bool(waiting) and num_decode + len(prefilling) < self.max_batch_size
        for i, req in enumerate(prefilling):
            share = left / 2 if admitting or i + 1 < len(prefilling) else left
            # The floor is for a prompt nothing waits behind: with a prompt waiting, a long prompt late in its
            # chunks took the floor's read and tokens past the whole room, so the waiting one got none, stayed
            # waiting, and kept the long one at half shares (a 64-token prompt's TTFT ~35 s beside a 4,000-token
            # prompt, SmolLM2 on CPU). The waiting prompt gets the floor instead; the long one goes on next step.
            left -= self._take(req, share, None if chunks or admitting else floor, chunks)
        owed = sum(max(0, self.allocator.pages_for(self._need(r, len(r.token_ids) - r.num_computed))
                       - len(r.page_table)) for r in prefilling)
        while waiting and num_decode + len(prefilling) < self.max_batch_size:
            req = waiting[0]
            q = self.pacer.chunk(left, req.num_computed, len(req.token_ids) - req.num_computed,
                                 None if chunks else floor)
            whole = self.allocator.pages_for(self._need(req, len(req.token_ids)))
            if q <= 0 or whole - len(req.page_table) + owed > self.allocator.num_free:
                break
            admit(req)
            self.allocator.ensure(req.page_table, self._need(req, q))
            owed += whole - len(req.page_table)
            chunks.append((req, q))
            left -= self.pacer.chunk_cost(q, req.num_computed)
        if not chunks and prefilling:  # the waiting prompt could not start after all: the oldest goes on
            self._take(prefilling[0], left, floor, chunks)
        return chunks

    def _take(self, req: Request, share: float, floor: float | None, chunks: list[Chunk]) -> float:
        """Append the chunk of a prompt part-way through that fits `share` (or `floor`) and its pages; its cost."""
        q = self.pacer.chunk(share, req.num_computed, len(req.token_ids) - req.num_computed, floor)
        if q <= 0 or not self.allocator.can_fit(req.page_table, self._need(req, q)):
            return 0.0
        self.allocator.ensure(req.page_table, self._need(req, q))
        chunks.append((req, q))
        return self.pacer.chunk_cost(q, req.num_computed)

    def _need(self, req: Request, q: int) -> int:
        """Positions written by a chunk of q tokens: the chunk itself, and after the last one the first decode
        step's (the sampled token and the proposer's look-ahead), as for a whole prefill."""
        end = req.num_computed + q
        return self.step_tokens(end) if end == len(req.token_ids) else end
