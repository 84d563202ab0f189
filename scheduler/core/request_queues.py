"""The scheduler's requests: who waits, who prefills in chunks, who decodes, and what each holds (pages, a slot
of the proposer's carried state). Every move between queues goes through here, so a request's pages and slot
are released exactly once: when it finishes or is preempted, or for a finished request still riding in a step
in flight, once the last such step is done.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from specstep.scheduler.core.page_allocator import PageAllocator
from specstep.scheduler.core.request import FinishReason, Request, Status


class RequestQueues:
    def __init__(self, allocator: PageAllocator, max_batch_size: int) -> None:
        self.allocator = allocator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefilling: list[Request] = []  # chunked prefill: admitted, prompt part-way through (oldest first)
        self.requests: dict[str, Request] = {}  # unfinished, by id
        self.free_slots = list(range(max_batch_size - 1, -1, -1))
        self._inflight_count: dict[int, int] = {}  # id(request) -> launched steps not yet finished that include it
        self._pending_release: list[Request] = []  # finished, but a step in flight still includes them
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def page_tables(self) -> list[list[int]]:
        return [r.page_table for r in (*self.running, *self.prefilling, *self._pending_release)]

    def admit(self, req: Request, status: Status) -> None:
        """A waiting request takes a slot: decoding after a whole-prompt prefill (RUNNING) or PREFILLING."""
        self.waiting.remove(req)
        req.slot = self.free_slots.pop()
        req.status = status
        if status == Status.PREFILLING:
            self.prefilling.append(req)

    def start_decoding(self, req: Request) -> None:
        if req.status == Status.PREFILLING:
            self.prefilling.remove(req)
        req.status = Status.RUNNING
        self.running.append(req)

    def preempt(self, req: Request) -> None:
        """Recompute later: drop its KV, keep its tokens; it is re-prefilled (prompt + output) when readmitted."""
        (self.prefilling if req.status == Status.PREFILLING else self.running).remove(req)
        self._release(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: FinishReason) -> None:
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.PREFILLING:
            self.prefilling.remove(req)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
        if id(req) in self._inflight_count:
            self._pending_release.append(req)  # a step in flight still writes its pages and slot
        else:
            self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)

    def launched(self, reqs: Sequence[Request]) -> None:
        """A step including `reqs` is in flight."""
        for r in reqs:
            self._inflight_count[id(r)] = self._inflight_count.get(id(r), 0) + 1

    def landed(self, req: Request) -> None:
        """A step in flight that included `req` is done."""
        self._inflight_count[id(req)] -= 1
        if self._inflight_count[id(req)] == 0:
            del self._inflight_count[id(req)]

    def release_landed(self) -> None:
        """Finished requests no step in flight includes any more give back their pages and slots."""
        for req in [r for r in self._pending_release if id(r) not in self._inflight_count]:
            self._pending_release.remove(req)
            self._release(req)

    def _release(self, req: Request) -> None:
        self.allocator.free(req.page_table)
        if req.slot >= 0:
            self.free_slots.append(req.slot)
            req.slot = -1
