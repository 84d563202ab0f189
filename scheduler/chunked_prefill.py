"""Chunked prefill mixed with decoding (`max_num_batched_tokens`), the part of `EngineCore` that plans and
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
    """Mixed into `EngineCore` (it reads the core's queues, allocator, policy, engine and stream)."""

    def _schedule_chunks(self) -> list[tuple[Request, int]]:
        """Prompt chunks for a mixed step: every running request decodes one token, and what is left of the
        token budget goes to prompts, those part-way through first (oldest first), then new admissions. Pages are
        reserved per chunk. A prompt is admitted only if all of it fits beside the other unfinished prefills, so
        prefills never block each other; running requests that need pages preempt prefills first (`_reserve`)."""
        budget = self.config.max_num_batched_tokens - len(self.running)
        if budget <= 0 or not self._reserve_pages(self.running, np.zeros(len(self.running), np.int64)):
            return []  # decode alone (its own reservation preempts as needed)
        chunks: list[tuple[Request, int]] = []
        for req in self.prefilling:
            q = min(len(req.token_ids) - req.num_computed, budget)
            if q <= 0 or not self.allocator.can_fit(req.page_table, self._chunk_need(req, q)):
                continue
            self.allocator.ensure(req.page_table, self._chunk_need(req, q))
            chunks.append((req, q))
            budget -= q
        owed = sum(max(0, self.allocator.pages_for(self._chunk_need(r, len(r.token_ids) - r.num_computed))
                       - len(r.page_table)) for r in self.prefilling)
        while budget > 0 and self.waiting and len(self.running) + len(self.prefilling) < self.config.max_batch_size:
            req = self.waiting[0]
            whole = self.allocator.pages_for(self._chunk_need(req, len(req.token_ids)))
            if whole - len(req.page_table) + owed > self.allocator.num_free:
                break
            q = min(len(req.token_ids), budget)
            self.waiting.popleft()
            self.allocator.ensure(req.page_table, self._chunk_need(req, q))
            owed += whole - len(req.page_table)
            req.slot = self._free_slots.pop()
            req.status = Status.PREFILLING
            # While speculation is off the proposer skips the prompt (it catches up if speculation resumes).
            req.prefill_with_proposer = self.policy.proposer_current
            self.prefilling.append(req)
            chunks.append((req, q))
            budget -= q
        return chunks

    def _chunk_need(self, req: Request, q: int) -> int:
        """Positions written by a chunk of q tokens: the chunk itself, and after the last one the first decode
        step's (the sampled token and the proposer's look-ahead), as for a whole prefill."""
        end = req.num_computed + q
        return end + 1 + self.lookahead if end == len(req.token_ids) else end

    def _mixed(self, chunks: list[tuple[Request, int]]) -> list[RequestOutput]:
        """One forward over the running requests' next tokens (plain sampling, refill dropped) and the prompt
        chunks; a prompt whose last chunk ran starts decoding."""
        decode = list(self.running)
        seqs = decode + [r for r, _ in chunks]
        q_lens = [1] * len(decode) + [q for _, q in chunks]
        with_proposer = [False] * len(decode) + [r.prefill_with_proposer for r, _ in chunks]
        handle = self.stream.submit(ranges.PREFILL,
                                    lambda: self.engine.prefill(seqs, with_proposer, q_lens, len(decode)))
        with self.tracer.range(ranges.WAIT):
            tokens = handle.wait().tolist()
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
