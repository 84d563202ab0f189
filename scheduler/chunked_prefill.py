"""Chunked prefill mixed with decoding (`scheduler/prefill_budget.py`), the part of `EngineCore` that plans and
runs mixed steps: every running request decodes one token and prompt chunks fill the rest of the step's token
budget. A prompt part-way through its chunks is `Status.PREFILLING` in `EngineCore.prefilling`: it holds a
slot and the pages of the chunks run so far.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from specstep.scheduler.request import Request, Status
from specstep.traces import ranges

if TYPE_CHECKING:
    from specstep.scheduler.engine_core import RequestOutput


class ChunkedPrefill:
    """Mixed into `EngineCore` (it reads the core's queues, allocator, policy, pacer, engine and stream)."""

    @property
    def chunked(self) -> bool:
        return self.config.prefill_budget is not None

    def _schedule_chunks(self) -> list[tuple[Request, int]]:
        """Prompt chunks for a mixed step: every running request decodes one token, and what is left of the
        step's budget (`PrefillBudget`: tokens, or a cost `PrefillPacer` keeps true) goes to prompts, those
        part-way through first (oldest first), then new admissions; the step's first chunk gets a floor even when
        the decode rows take the whole budget, so prompts are never starved. Pages are reserved per chunk. A
        prompt is admitted only if all of it fits beside the other unfinished prefills, so prefills never block
        each other; running requests that need pages preempt prefills first (`_reserve`)."""
        if not self._reserve_pages(self.running, np.zeros(len(self.running), np.int64)):
            return []  # decode alone (its own reservation preempts as needed)
        left, floor = self.pacer.plan(len(self.running), self._plain_decode_s())
        chunks: list[tuple[Request, int]] = []
        # A prompt with other prompts behind it (part-way through, or waiting for a slot) takes at most half of
        # what is left: a short prompt arriving behind a long one is done within a few steps, not after all of
        # the long one's chunks (as vLLM's long_prefill_token_threshold).
        admitting = bool(self.waiting) and len(self.running) + len(self.prefilling) < self.config.max_batch_size
        for i, req in enumerate(self.prefilling):
            share = left / 2 if admitting or i + 1 < len(self.prefilling) else left
            # The floor is for a prompt nothing waits behind: with a prompt waiting, a long prompt late in its
            # chunks took the floor's read and tokens past the whole room, so the waiting one got none, stayed
            # waiting, and kept the long one at half shares (a 64-token prompt's TTFT ~35 s beside a 4,000-token
            # prompt, SmolLM2 on CPU). The waiting prompt gets the floor instead; the long one goes on next step.
            left -= self._take_chunk(req, share, None if chunks or admitting else floor, chunks)
        owed = sum(max(0, self.allocator.pages_for(self._chunk_need(r, len(r.token_ids) - r.num_computed))
                       - len(r.page_table)) for r in self.prefilling)
        while self.waiting and len(self.running) + len(self.prefilling) < self.config.max_batch_size:
            req = self.waiting[0]
            q = self.pacer.chunk(left, req.num_computed, len(req.token_ids) - req.num_computed,
                                 None if chunks else floor)
            whole = self.allocator.pages_for(self._chunk_need(req, len(req.token_ids)))
            if q <= 0 or whole - len(req.page_table) + owed > self.allocator.num_free:
                break
            self.waiting.popleft()
            self.allocator.ensure(req.page_table, self._chunk_need(req, q))
            owed += whole - len(req.page_table)
            req.slot = self._free_slots.pop()
            req.status = Status.PREFILLING
            # While speculation is off the proposer skips the prompt (it catches up if speculation resumes).
            req.prefill_with_proposer = self.policy.proposer_current
            self.prefilling.append(req)
            chunks.append((req, q))
            left -= self.pacer.chunk_cost(q, req.num_computed)
        if not chunks and self.prefilling:  # the waiting prompt could not start after all: the oldest goes on
            self._take_chunk(self.prefilling[0], left, floor, chunks)
        return chunks

    def _take_chunk(self, req: Request, share: float, floor: float | None, chunks: list[tuple[Request, int]]) -> float:
        """Append the chunk of a prompt part-way through that fits `share` (or `floor`) and its pages; its cost."""
        q = self.pacer.chunk(share, req.num_computed, len(req.token_ids) - req.num_computed, floor)
        if q <= 0 or not self.allocator.can_fit(req.page_table, self._chunk_need(req, q)):
            return 0.0
        self.allocator.ensure(req.page_table, self._chunk_need(req, q))
        chunks.append((req, q))
        return self.pacer.chunk_cost(q, req.num_computed)

    def _plain_decode_s(self) -> float | None:
        """The running batch's plain decode step as the policy last timed it (None: not yet): what the streams'
        gaps are measured against."""
        b = len(self.running)
        return (self.policy.costs.plain(b, False) or self.policy.costs.plain(b, True)) if b else None

    def _chunk_need(self, req: Request, q: int) -> int:
        """Positions written by a chunk of q tokens: the chunk itself, and after the last one the first decode
        step's (the sampled token and the proposer's look-ahead), as for a whole prefill."""
        end = req.num_computed + q
        return self._step_tokens(end) if end == len(req.token_ids) else end

    def _mixed(self, chunks: list[tuple[Request, int]]) -> list[RequestOutput]:
        """One forward over the running requests' next tokens (plain sampling, refill dropped) and the prompt
        chunks; a prompt whose last chunk ran starts decoding."""
        decode = list(self.running)
        seqs = decode + [r for r, _ in chunks]
        q_lens = [1] * len(decode) + [q for _, q in chunks]
        with_proposer = [False] * len(decode) + [r.prefill_with_proposer for r, _ in chunks]
        shapes = [(q, r.num_computed) for r, q in chunks]
        decode_s = self._plain_decode_s()
        start = self.clock()
        handle = self.stream.submit(ranges.PREFILL,
                                    lambda: self.engine.prefill(seqs, with_proposer, q_lens, len(decode)))
        with self.tracer.range(ranges.WAIT):
            tokens = handle.wait().tolist()
        self.pacer.observe(shapes, self.clock() - start, decode_s)
        now = time.monotonic()
        outputs = []
        with self.tracer.range(ranges.PROCESS_OUTPUT):
            for req, tok in zip(decode, tokens):
                req.stats.record(0, 0)
                req.num_computed = len(req.token_ids)
                outputs.append(self._append(req, [tok]))
            for (req, q), tok in zip(chunks, tokens[len(decode):]):
                req.num_computed += q
                if req.num_computed == len(req.token_ids):
                    self.prefilling.remove(req)
                    outputs.append(self._start_decoding(req, tok, req.prefill_with_proposer, now))
        return outputs
