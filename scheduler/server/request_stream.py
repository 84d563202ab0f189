"""One request as the frontend sees it: engine outputs in, client messages out (no sockets here).

Tokens are counted, timed and detokenized (with stop strings) as they arrive; `delta()` takes what is ready to
send, `final()` closes the request with usage, speculation stats and timings; `consume()` applies what the
scheduler queued for it (outputs, a rejection, DIED). Times are time.monotonic().
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from specstep.engine.tokenizer import Tokenizer
from specstep.scheduler.server.detokenize import TextStream
from specstep.scheduler.server.metrics import ServerMetrics
from specstep.scheduler.server.protocol import (
    Delta,
    EngineOutput,
    EngineReject,
    EngineRequest,
    ErrorCode,
    Final,
    GenerateRequest,
    ProtocolError,
    Timings,
    Usage,
)
from specstep.scheduler.spec.counters import SpecCounters

DIED = object()  # queue item: the scheduler incarnation serving this request died


@dataclass(eq=False, slots=True)
class RequestStream:
    identity: bytes  # the client (ROUTER identity)
    msg: GenerateRequest
    engine_id: str  # unique within the frontend: client request ids are only unique per client
    arrival: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # engine outputs, rejections, DIED
    task: asyncio.Task | None = None
    incarnation: int = 0  # the scheduler incarnation it was sent to (0 = not sent)
    engine_done: bool = False  # the scheduler has finished or forgotten it (no abort needed)
    cancel_reason: str = ""  # "abort" | "shutdown" once cancelled
    counted: bool = False  # its Final (or abort) is in the server's metrics
    text: TextStream | None = None
    num_prompt: int = 0
    num_output: int = 0
    unsent: list[int] = field(default_factory=list)
    sent_time: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    max_gap: float = 0.0
    spec: SpecCounters = field(default_factory=SpecCounters)  # summed from the engine's per-step counts
    engine_queue_s: float = 0.0
    num_preemptions: int = 0

    @property
    def request_id(self) -> str:
        return self.msg.request_id

    def started(self, req: EngineRequest, tokenizer: Tokenizer | None, now: float) -> None:
        self.text = TextStream(tokenizer, req.prompt_token_ids, self.msg.stop)
        self.num_prompt = len(req.prompt_token_ids)
        self.sent_time = now

    def cancel(self, reason: str) -> None:
        """Cancel the request's task once, remembering why ("abort" | "shutdown")."""
        if self.task is not None and not self.task.done() and not self.cancel_reason:
            self.cancel_reason = reason
            self.task.cancel()

    def consume(self, items: list, now: float, metrics: ServerMetrics) -> Final | None:
        """Apply queued items; the Final once the request is over. Errors are raised as ProtocolError."""
        for item in items:
            if item is DIED:
                self.engine_done = True
                raise ProtocolError(ErrorCode.ENGINE_DIED, "the scheduler process died while serving the request; "
                                    "retry")
            if isinstance(item, EngineReject):
                self.engine_done = True
                raise ProtocolError(ErrorCode(item.code), item.message)
            metrics.observe_step_output(len(item.token_ids), now - self.last_token if self.last_token else None,
                                        first=self.first_token == 0.0)
            if self.add(item, now):
                return self.final("stop", now)  # a stop string: the frontend then aborts it in the engine
            if item.finish_reason is not None:
                self.engine_done = True
                return self.final(item.finish_reason, now)
        return None

    def add(self, out: EngineOutput, now: float) -> bool:
        """Take one engine output; True when a stop string ended the request (tokens after it are dropped)."""
        self.spec.record(out.num_draft, out.num_accepted)
        self.spec.policy(out.spec_acceptance, out.spec_steps_off, out.spec_steps_probing)
        self.engine_queue_s = out.queue_s or self.engine_queue_s
        self.num_preemptions = out.num_preemptions
        if out.token_ids:
            if self.first_token == 0.0:
                self.first_token = now
            else:
                self.max_gap = max(self.max_gap, now - self.last_token)
            self.last_token = now
        for tok in out.token_ids:
            self.unsent.append(tok)
            self.num_output += 1
            if self.text.add(tok):
                return True
        return False

    def delta(self) -> Delta | None:
        text = self.text.take()
        if not self.unsent and not text:
            return None
        ids, self.unsent = self.unsent, []
        return Delta(self.request_id, ids, text)

    def final(self, reason: str, now: float) -> Final:
        text = self.text.take(final=True) if self.text is not None else ""
        n = self.num_output
        waited = (self.sent_time or now) - self.arrival  # in the frontend, e.g. while a scheduler restarted
        timings = Timings(queue_s=waited + self.engine_queue_s,
                          ttft_s=self.first_token - self.arrival if self.first_token else 0.0,
                          mean_itl_s=(self.last_token - self.first_token) / (n - 1) if n > 1 else 0.0,
                          max_itl_s=self.max_gap, total_s=now - self.arrival)
        ids, self.unsent = self.unsent, []
        return Final(self.request_id, reason, ids, text, Usage(self.num_prompt, n), self.spec.to_wire(), timings,
                     self.num_preemptions)
