"""The engine core: admission, continuous batching, preemption by recompute, stop conditions.

One `step()` runs one batch: a prefill of newly admitted requests if any can be admitted, else one decode
(possibly speculative) step of every running request. The offline `generate` and the scheduler process both
drive this class; it owns no sockets.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.errors import InvalidRequestError
from engine.step_engine import StepEngine, StepOutput
from scheduler.page_allocator import PageAllocator
from scheduler.request import FinishReason, Request, Status


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_size: int = 64
    max_prefill_tokens: int = 4096
    num_spec_tokens: int = 0  # k for every request unless overridden (0 = speculation off)
    max_model_len: int = 2048


@dataclass(slots=True)
class RequestOutput:
    request: Request
    new_token_ids: list[int]
    finished: bool


# (requests, default k) -> num_draft per request, before the engine's length caps
SpecPolicyFn = Callable[[list[Request], int], np.ndarray]


def fixed_policy(reqs: list[Request], k: int) -> np.ndarray:
    return np.array([k if r.num_spec_tokens is None else r.num_spec_tokens for r in reqs], dtype=np.int64)


class EngineCore:
    def __init__(self, step_engine: StepEngine, allocator: PageAllocator, config: SchedulerConfig,
                 eos_token_ids: tuple[int, ...] = (), policy: SpecPolicyFn = fixed_policy) -> None:
        self.engine = step_engine
        self.allocator = allocator
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._free_slots = list(range(config.max_batch_size - 1, -1, -1))
        self.lookahead = step_engine.proposer.kv_lookahead if step_engine.proposer else 0
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {req.request_id!r}")
        n = len(req.prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt is empty")
        vocab = self.engine.vocab_size
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if n + 1 > self.config.max_model_len:
            raise InvalidRequestError(f"prompt has {n} tokens; the model allows at most {self.config.max_model_len - 1}")
        if self.allocator.pages_for(n + 2 + self.lookahead) > self.allocator.num_usable:
            raise InvalidRequestError(f"prompt of {n} tokens does not fit the KV cache")
        req.params.validate(vocab)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        if req.status == Status.WAITING:
            self.waiting.remove(req)
        self._finish(req, FinishReason.ABORT)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def page_tables(self) -> list[list[int]]:
        return [r.page_table for r in self.running]

    def check_integrity(self) -> None:
        self.allocator.check_integrity(self.page_tables())

    # ---- one step --------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        admitted = self._admit()
        if admitted:
            return self._prefill(admitted)
        if self.running:
            return self._decode()
        return []

    def _admit(self) -> list[Request]:
        batch: list[Request] = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.config.max_batch_size:
            req = self.waiting[0]
            n = len(req.token_ids)
            if batch and tokens + n > self.config.max_prefill_tokens:
                break
            if not self.allocator.can_fit(req.page_table, n + 1 + self.lookahead):
                break
            self.waiting.popleft()
            self.allocator.ensure(req.page_table, n + 1 + self.lookahead)
            req.slot = self._free_slots.pop()
            req.status = Status.RUNNING
            batch.append(req)
            tokens += n
        return batch

    def _prefill(self, batch: list[Request]) -> list[RequestOutput]:
        tokens = self.engine.prefill(batch).tolist()  # host sync: the new tokens decide what happens next
        now = time.monotonic()
        outputs = []
        for req, tok in zip(batch, tokens):
            req.num_computed = len(req.token_ids)
            self.running.append(req)
            if req.first_token_time is None:
                req.first_token_time = now
            outputs.append(self._append(req, [tok]))
        return outputs

    def _num_draft(self, reqs: list[Request]) -> np.ndarray:
        if self.engine.proposer is None:
            return np.zeros(len(reqs), dtype=np.int64)
        k = self.policy(reqs, self.config.num_spec_tokens)
        # Never draft past max_tokens or the model's length (the last emitted token is always the bonus).
        room = np.array([min(r.params.max_tokens - r.num_output_tokens,
                             self.config.max_model_len - len(r.token_ids) - self.lookahead) - 1 for r in reqs])
        return np.clip(np.minimum(k, room), 0, None).astype(np.int64)

    def _reserve(self) -> np.ndarray:
        """Pages for every running request's look-ahead; preempt the newest requests while they do not fit."""
        while True:
            num_draft = self._num_draft(self.running)
            need = [len(r.token_ids) + int(k) + 1 + self.lookahead for r, k in zip(self.running, num_draft)]
            short = sum(max(0, self.allocator.pages_for(n) - len(r.page_table)) for r, n in zip(self.running, need))
            if short <= self.allocator.num_free or len(self.running) == 1:
                for r, n in zip(self.running, need):
                    self.allocator.ensure(r.page_table, n)
                return num_draft
            self._preempt(self.running[-1])

    def _preempt(self, req: Request) -> None:
        """Recompute later: drop its KV, keep its tokens; it is re-prefilled (prompt + output) when readmitted."""
        self.running.remove(req)
        self.allocator.free(req.page_table)
        self._free_slots.append(req.slot)
        req.slot = -1
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _decode(self) -> list[RequestOutput]:
        num_draft = self._reserve()
        batch = list(self.running)
        out = self.engine.decode(batch, num_draft)
        return self.finish_decode(batch, out)

    def finish_decode(self, batch: list[Request], out: StepOutput) -> list[RequestOutput]:
        accepted = out.num_accepted.tolist()  # the step's one host sync
        tokens = out.out_tokens.tolist()
        outputs = []
        for req, a, row, nd in zip(batch, accepted, tokens, out.num_draft.tolist()):
            if req.finished:  # aborted while the step ran
                continue
            req.stats.record(nd, a)
            req.num_computed = len(req.token_ids) + a  # target KV now holds last + a accepted drafts
            outputs.append(self._append(req, row[: a + 1]))
        return outputs

    # ---- stopping --------------------------------------------------------------------------------------------
    def _append(self, req: Request, new: list[int]) -> RequestOutput:
        kept: list[int] = []
        reason = None
        for tok in new:
            req.token_ids.append(tok)
            kept.append(tok)
            if (tok in self.eos_token_ids and not req.params.ignore_eos) or tok in req.params.stop_token_ids:
                reason = FinishReason.STOP
            elif req.num_output_tokens >= req.params.max_tokens or len(req.token_ids) >= self.config.max_model_len:
                reason = FinishReason.LENGTH
            if reason:
                break
        if reason:
            self._finish(req, reason)
        return RequestOutput(req, kept, req.finished)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status == Status.RUNNING:
            self.running.remove(req)
            self._free_slots.append(req.slot)
            req.slot = -1
        self.allocator.free(req.page_table)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)
