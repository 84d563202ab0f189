"""The frontend process: asyncio (uvloop) over one ROUTER socket, facing upstream routers.

    router DEALER ──▶ ROUTER ─[router loop: decode, check, register]─▶ one task per request
                                                                        │ validate, tokenize, send to scheduler
    scheduler ──▶ supervisor reader ─[route by request id]─▶ per-request queue ─▶ task: detokenize, stop strings,
                                                                                  Delta/Final back on the ROUTER
A request's task owns everything about it; errors (a rejection, the scheduler dying) reach it through its queue,
and a client's abort or the shutdown deadline cancels it. Outputs that pile up while a task waits are merged
into one Delta. A client that disappears is noticed on the next send (ROUTER_MANDATORY) and its request
aborted. No torch in this process.

The OpenAI-compatible HTTP API (scheduler/server/http/) runs on the same loop and serves its requests through
the same steps (`admit`, `submit`, `outputs`, `forget`), each in its HTTP handler's task.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio

from specstep.engine.tokenizer import Tokenizer
from specstep.scheduler.server.http.chat_template import ChatTemplate
from specstep.scheduler.server.http.server import OpenAIServer
from specstep.scheduler.server.inflight import InflightRequests
from specstep.scheduler.server.metrics import ServerMetrics
from specstep.scheduler.server.protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    Delta,
    EngineAbort,
    Error,
    ErrorCode,
    Final,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    ProtocolError,
    Ready,
    SchedulerProcessConfig,
    StatsReply,
    StatsRequest,
    Wire,
    decode_client,
    encode,
)
from specstep.scheduler.server.query_replies import QueryReplies
from specstep.scheduler.server.request_stream import RequestStream
from specstep.scheduler.server.sockets import ROUTER_HWM, bound_address, make_socket, send_now
from specstep.scheduler.server.supervisor import SchedulerSupervisor
from specstep.scheduler.server.validate import Limits, check_request_id, validate_generate
from specstep.traces.ranges import DETOKENIZE, SEND
from specstep.traces.tracer import Tracer, TraceRecorder

log = logging.getLogger("specstep.frontend")


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    address: str
    engine: dict  # EngineConfig fields, handed to the scheduler process
    model_name: str = ""  # in HEALTH_REPLY
    model_origin: str = ""  # in the ready line: where the model came from
    max_tokens: int | None = None  # cap on a request's max_tokens (default: the model's length)
    max_prompt_len: int | None = None
    trace: str | None = None
    startup_timeout_s: float = 300.0
    max_restarts: int = 5
    restart_window_s: float = 300.0
    drain_timeout_s: float = 60.0
    max_inflight: int = 4096
    metrics_port: int | None = None  # Prometheus /metrics on 127.0.0.1 (0: any free port; None: off)
    http_host: str = "127.0.0.1"  # the OpenAI-compatible HTTP API's address (scheduler/server/http/)
    http_port: int | None = None  # its port (0: any free port; None: off)
    chat_template: ChatTemplate | None = None  # the model's, for /v1/chat/completions (None: it has none)


class Frontend:
    def __init__(self, cfg: FrontendConfig, tokenizer: Tokenizer | None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.recorder = TraceRecorder() if cfg.trace else None
        self.tracer = Tracer(self.recorder)
        self.metrics = ServerMetrics()
        self.requests = InflightRequests(self.metrics)
        self.draining = False
        self._done: asyncio.Event | None = None
        self.queries = QueryReplies(self._reply)
        self.metrics_port: int | None = None
        self.http: OpenAIServer | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    async def serve(self, on_listening=print) -> int:
        self._done = asyncio.Event()
        self.ctx = zmq.asyncio.Context()
        self.router = make_socket(self.ctx, zmq.ROUTER, bind=self.cfg.address, hwm=ROUTER_HWM,
                                  router_mandatory=True)
        self.address = bound_address(self.router)
        self.supervisor = SchedulerSupervisor(self.ctx, self._process_config, self.requests,
                                              self.cfg.startup_timeout_s, self.cfg.max_restarts,
                                              self.cfg.restart_window_s)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.begin_drain)
        loop.add_signal_handler(signal.SIGINT, self._on_sigint)
        router_task = asyncio.create_task(self._router_loop())
        on_listening(f"specstep serve: listening on {self.address}")
        if self.cfg.http_port is not None:
            self.http = OpenAIServer(self, self.cfg.model_name, self.cfg.chat_template)
            try:
                url = await self.http.start(self.cfg.http_host, self.cfg.http_port)
            except OSError as e:
                on_listening(f"specstep serve: error: HTTP on {self.cfg.http_host}:{self.cfg.http_port}: {e} "
                             "(--http-port 0 picks a free port, -1 turns HTTP off)")
                router_task.cancel()
                self.router.close(linger=0)
                self.ctx.destroy(linger=0)
                return 2
            on_listening(f"specstep serve: OpenAI-compatible HTTP listening on {url}")
        if self.cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(self.cfg.metrics_port)
            if self.metrics_port is not None:
                on_listening(f"specstep serve: metrics on http://127.0.0.1:{self.metrics_port}/metrics")
        poll_task = asyncio.create_task(self._poll_engine_stats())
        if not await self.supervisor.start():
            if self.draining and self.supervisor.state in ("stopping", "stopped"):  # SIGTERM during start-up
                on_listening("specstep serve: stopped during start-up")
                await self._done.wait()
                code = 0
            else:
                on_listening("specstep serve: error: the scheduler process did not start (see its log above)")
                code = 1
        else:
            on_listening(_ready_line(self.supervisor.ready, self.cfg.model_origin or self.cfg.model_name,
                                     self.address, self.http.url if self.http is not None else None))
            await self._done.wait()
            code = 0
        router_task.cancel()
        poll_task.cancel()
        if self.http is not None:
            await self.http.stop()
        await self.supervisor.stop(drain=False, timeout_s=5.0)
        self.router.close(linger=0)
        self.ctx.destroy(linger=0)
        if self.recorder is not None and self.cfg.trace:
            _save_trace(self.recorder, Path(self.cfg.trace))
        return code

    def begin_drain(self) -> None:
        """SIGTERM: refuse new requests, let in-flight ones finish (up to the drain timeout), then exit."""
        if not self.draining:
            log.info("draining %d in-flight requests", len(self.requests))
            self.draining = True
            asyncio.get_running_loop().create_task(self._drain())

    def _on_sigint(self) -> None:
        if self.draining:  # a second Ctrl-C: stop now
            self.requests.cancel_all("shutdown")
            self._done.set()
        self.begin_drain()

    async def _drain(self) -> None:
        if self.supervisor.state in ("starting", "restarting"):
            # Nothing can finish before a scheduler is up: stop now; requests waiting for it get SHUTTING_DOWN.
            await self.supervisor.stop(drain=False, timeout_s=5.0)
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.requests.cancel_all("shutdown")
        await asyncio.sleep(0)  # let the cancelled tasks send their errors
        await self.supervisor.stop(drain=True, timeout_s=10.0)
        self._done.set()

    def _process_config(self, input_address: str, output_address: str) -> SchedulerProcessConfig:
        return SchedulerProcessConfig(engine=self.cfg.engine, input_address=input_address,
                                      output_address=output_address, parent_pid=os.getpid(),
                                      max_prompt_len=self.cfg.max_prompt_len, trace=self.cfg.trace)

    # ---- messages from clients -----------------------------------------------------------------------------
    async def _router_loop(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            try:
                self._on_frames(frames[0], frames[1:])
            except Exception as e:  # never let one message take the server down
                log.exception("internal error handling a client message")
                self._reply(frames[0], Error(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"))

    def _on_frames(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            msg = decode_client(frames)
            if isinstance(msg, GenerateRequest):
                self._on_generate(identity, msg)
            elif isinstance(msg, AbortRequest):
                st = self.requests.get(identity, msg.request_id)
                if st is not None:  # aborting an unknown or finished request is a no-op
                    st.cancel("abort")
            elif isinstance(msg, HealthRequest):
                if self.queries.pending(identity):  # replies to one client's queries go out in order
                    self.queries.queue(identity, self._health_async)
                else:
                    self._reply(identity, self.health())
            elif isinstance(msg, StatsRequest):
                self.queries.queue(identity, self._stats_reply)
        except ProtocolError as e:
            self._reply(identity, e.to_wire())

    def _on_generate(self, identity: bytes, msg: GenerateRequest) -> None:
        check_request_id(msg.request_id)
        # Duplicates first: any other error carrying a running request's id would end it for the client.
        if self.requests.get(identity, msg.request_id) is not None:
            raise ProtocolError(ErrorCode.DUPLICATE_REQUEST_ID, f"request_id: {msg.request_id!r} is already in "
                                "flight on this connection; that request continues", msg.request_id)
        st = self.admit(identity, msg)
        st.task = asyncio.get_running_loop().create_task(self._serve_request(st))
        st.task.add_done_callback(lambda _, st=st: self._on_task_done(st))

    # ---- one request, whichever frontend it came through (ZMQ here, HTTP in scheduler/server/http/) --------
    def admit(self, identity: bytes, msg: GenerateRequest) -> RequestStream:
        """Register a request (SHUTTING_DOWN / OVERLOADED as ProtocolError). The caller sets `st.task`, the task
        that serves it (cancelled on abort and shutdown), and calls `forget(st)` when it ends."""
        if self.draining:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the server is shutting down", msg.request_id)
        if len(self.requests) >= self.cfg.max_inflight:
            raise ProtocolError(ErrorCode.OVERLOADED, f"{len(self.requests)} requests in flight; retry later",
                                msg.request_id)
        return self.requests.add(identity, msg, time.monotonic())

    async def limits(self) -> Limits:
        """The limits requests are validated against (waits for a ready scheduler)."""
        return Limits.from_ready(await self.supervisor.wait_ready(), self.cfg.max_tokens)

    async def submit(self, st: RequestStream) -> None:
        """Validate and tokenize the request, then send it to the scheduler (errors as ProtocolError)."""
        limits = await self.limits()
        # Tokenizing a long prompt takes a while: off the event loop, which serves every other client.
        ereq = await asyncio.get_running_loop().run_in_executor(None, validate_generate, st.msg, limits,
                                                                self.tokenizer, st.engine_id)
        st.started(ereq, self.tokenizer, time.monotonic())
        st.incarnation = self.supervisor.send(ereq)
        if st.incarnation == 0:
            raise ProtocolError(ErrorCode.ENGINE_DIED, "the scheduler process died; retry")

    async def outputs(self, st: RequestStream) -> AsyncIterator[Delta | Final]:
        """A submitted request's Deltas (when it streams), then its Final; errors as ProtocolError."""
        while True:
            items = [await st.queue.get()]
            while not st.queue.empty():  # merge whatever piled up into one delta
                items.append(st.queue.get_nowait())
            with self.tracer.range(DETOKENIZE):
                final = st.consume(items, time.monotonic(), self.metrics)
                delta = st.delta() if final is None and st.msg.stream else None
            if final is not None:
                st.counted = True
                self.metrics.observe_final(final)
                yield final
                return
            if delta is not None:
                yield delta

    def observe_abort(self, st: RequestStream) -> Final:
        """A client's abort (an ABORT message, or an HTTP client gone): counted as a request ended "abort" (once:
        a request already counted is not counted again)."""
        final = st.final("abort", time.monotonic())
        if not st.counted:
            st.counted = True
            self.metrics.observe_final(final)
        return final

    def forget(self, st: RequestStream) -> None:
        """The request is over for its client: drop it, and abort it in the scheduler if still running there."""
        self.requests.remove(st)
        if st.incarnation and not st.engine_done and st.incarnation == self.supervisor.incarnation:
            # The scheduler counts an aborted request as finished; so do the metrics, whatever path ended it
            # here (a client gone, an internal error), so that STATS and the counters agree.
            self.observe_abort(st)
            self.supervisor.send(EngineAbort([st.engine_id]))  # frees its KV pages in the scheduler at once

    def health(self) -> HealthReply:
        """Always every field: before the first ready, the scheduler's ("" / 0) are placeholders."""
        ready = self.supervisor.ready
        status = self._status()
        if ready is None:
            return HealthReply(PROTOCOL_VERSION, status, self.cfg.model_name, address=self.address)
        return HealthReply(PROTOCOL_VERSION, status, self.cfg.model_name, ready.spec, ready.max_model_len,
                           ready.max_prompt_len, Limits.from_ready(ready, self.cfg.max_tokens).max_tokens,
                           ready.vocab_size, self.address)

    def _status(self) -> str:
        if self.draining:
            return "draining"
        return "ok" if self.supervisor.state == "ready" else self.supervisor.state

    async def _health_async(self) -> HealthReply:
        return self.health()

    async def _stats_reply(self) -> StatsReply:
        engine = await self.supervisor.stats()
        self.metrics.update_engine(engine)
        return StatsReply(PROTOCOL_VERSION, self._status(), self.supervisor.restarts, len(self.requests), engine,
                          self.metrics.snapshot())

    async def _poll_engine_stats(self, period_s: float = 1.0) -> None:
        """Gauges (running, waiting, pages, k distribution) follow the scheduler's stats."""
        while True:
            await asyncio.sleep(period_s)
            if self.supervisor.state == "ready":
                try:
                    self.metrics.update_engine(await self.supervisor.stats())
                except Exception:  # noqa: BLE001 (a restarting scheduler; the next poll will do)
                    pass

    def _reply(self, identity: bytes, msg: Wire) -> bool:
        if isinstance(msg, Error):  # every error a client gets passes here, whichever path produced it
            self.metrics.observe_error(msg.code)
        with self.tracer.range(SEND):
            return send_now(self.router, [identity, *encode(msg)])

    # ---- one ZMQ request -------------------------------------------------------------------------------------
    async def _serve_request(self, st: RequestStream) -> None:
        try:
            await self.submit(st)
            async for msg in self.outputs(st):
                if not self._reply(st.identity, msg) and isinstance(msg, Delta):
                    log.info("client of request %r is gone; aborting it", st.request_id)
                    return
        except ProtocolError as e:
            e.request_id = st.request_id
            self._reply(st.identity, e.to_wire())
        except asyncio.CancelledError:
            self._reply_cancelled(st)
        except Exception as e:  # a bug must not leave the client waiting forever
            log.exception("internal error serving request %r", st.request_id)
            self._reply(st.identity, Error(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}: {e}",
                                           st.request_id))
        finally:
            self.forget(st)

    def _reply_cancelled(self, st: RequestStream) -> None:
        if st.cancel_reason == "abort":
            self._reply(st.identity, self.observe_abort(st))
        else:
            self._reply(st.identity, Error(ErrorCode.SHUTTING_DOWN, "the server shut down before the request "
                                           "finished", st.request_id))

    def _on_task_done(self, st: RequestStream) -> None:
        """A task cancelled before its first step (an ABORT read right behind its GENERATE) never entered
        `_serve_request`, so its handlers did not run: answer the client and forget the request here."""
        if self.requests.get(st.identity, st.request_id) is st:
            self._reply_cancelled(st)
            self.forget(st)


def _ready_line(ready: Ready, model: str, address: str, http_url: str | None = None) -> str:
    extra = f"; {ready.kv_cache}" if ready.kv_cache else ""
    extra += f"; {ready.graphs}" if ready.graphs else ""
    extra += f"; {ready.prefill}" if ready.prefill else ""
    extra += f"; {ready.kernels}" if ready.kernels else ""
    if ready.tensor_parallel_size > 1:
        extra += f"; tensor-parallel {ready.tensor_parallel_size} ranks"
    on = f"{address} and {http_url}" if http_url else address
    return f"specstep serve: ready ({model}; spec {ready.spec}, {ready.num_pages} KV pages{extra}) on {on}"


def _save_trace(recorder: TraceRecorder, path: Path) -> None:
    """Our ranges go into the scheduler's trace file (one file, one pid per process)."""
    data = json.loads(path.read_text()) if path.is_file() else {"traceEvents": [], "displayTimeUnit": "ms"}
    data["traceEvents"].extend(recorder.to_json()["traceEvents"])
    path.write_text(json.dumps(data))
