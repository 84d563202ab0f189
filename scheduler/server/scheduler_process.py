"""The scheduler process: one EngineCore driven by a loop that blocks only when idle.

    frontend PUSH ──▶ PULL ─[recv thread: decode]─▶ inbox ─▶ loop: handle messages, core.step() ─▶ outbox
    frontend PULL ◀── PUSH ◀─[send thread: encode]─────────────────────────────────────────────────┘

Socket I/O and (de)serialisation live in two threads, so the loop only moves Python objects through queues.
Started by the supervisor as `python -m specstep.scheduler.server.scheduler_process CONFIG_JSON`; it connects both
sockets, builds the engine, and announces itself with a Ready message carrying the values learned at start-up.
SIGTERM (or a SHUTDOWN message) drains: new requests are rejected, running ones finish, then it exits.
SIGINT is ignored: the frontend coordinates shutdown. If the frontend dies, it exits at once.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning OpenMP threads starve the other core

import dataclasses  # noqa: E402
import logging  # noqa: E402
import queue  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402

from specstep.cuda_graphs.runner import describe_capture  # noqa: E402
from specstep.engine.engine_config import EngineConfig  # noqa: E402
from specstep.engine.errors import InvalidRequestError  # noqa: E402
from specstep.engine.sampling_params import SamplingParams  # noqa: E402
from specstep.scheduler.build import build_engine  # noqa: E402
from specstep.scheduler.core.engine_core import EngineCore, RequestOutput  # noqa: E402
from specstep.scheduler.core.request import Request  # noqa: E402
from specstep.scheduler.server.protocol import (  # noqa: E402
    PROTOCOL_VERSION,
    EngineAbort,
    EngineOutput,
    EngineOutputs,
    EngineReject,
    EngineRequest,
    EngineShutdown,
    EngineStats,
    EngineStatsQuery,
    ErrorCode,
    ProtocolError,
    Ready,
    SchedulerProcessConfig,
    decode_to_engine,
    encode_engine,
)
from specstep.scheduler.server.sockets import make_socket, remove_ipc  # noqa: E402
from specstep.traces.ranges import SEND  # noqa: E402
from specstep.traces.tracer import NULL_TRACER, Tracer, TraceRecorder  # noqa: E402

log = logging.getLogger("specstep.scheduler")
IDLE_POLL_S = 0.5  # how often the receive thread checks that the frontend is still alive
IDLE_CHECK_S = 10.0  # while idle, how often to re-check page integrity (also checked on becoming idle)


class SocketIO:
    """The two socket threads. Each socket is used by exactly one thread (ZMQ sockets are not thread-safe)."""

    def __init__(self, ctx: zmq.Context, cfg: SchedulerProcessConfig) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._parent_pid = cfg.parent_pid
        self.orphaned = False  # the frontend died without stopping us (kill -9): we remove its ipc sockets
        self._closing = threading.Event()
        self._pull = make_socket(ctx, zmq.PULL, connect=cfg.input_address)
        self._push = make_socket(ctx, zmq.PUSH, connect=cfg.output_address)
        self._recv = threading.Thread(target=self._recv_loop, name="recv", daemon=True)
        self._send = threading.Thread(target=self._send_loop, name="send", daemon=True)
        self._recv.start()
        self._send.start()

    def _recv_loop(self) -> None:
        while not self._closing.is_set():
            if not self._pull.poll(int(IDLE_POLL_S * 1000)):
                if os.getppid() != self._parent_pid:
                    log.warning("the frontend is gone; exiting")
                    self.orphaned = True
                    self.inbox.put(EngineShutdown(drain=False))
                    return
                continue
            frames = self._pull.recv_multipart()
            try:
                self.inbox.put(decode_to_engine(frames))
            except ProtocolError as e:  # only our own frontend talks to us: a bug, but not worth dying for
                log.error("dropped a malformed message from the frontend: %s", e.message)

    def _send_loop(self) -> None:
        while (msg := self.outbox.get()) is not None:
            self._push.send_multipart(encode_engine(msg), copy=False)

    def close(self) -> None:
        self.outbox.put(None)
        self._send.join(timeout=5)
        self._closing.set()
        self._recv.join(timeout=2 * IDLE_POLL_S + 1)
        self._pull.close(linger=0)
        self._push.close(linger=2000)  # let the last outputs reach the frontend


class SchedulerLoop:
    def __init__(self, core: EngineCore, inbox: queue.SimpleQueue, outbox: queue.SimpleQueue,
                 tracer: Tracer = NULL_TRACER) -> None:
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.tracer = tracer
        self.draining = False
        self.exit_now = False
        self._started: set[str] = set()  # requests that have had an output (their queue time was sent)
        self.num_steps = self.num_finished = self.num_output_tokens = self.drafted = self.accepted = 0

    def run(self) -> None:
        core = self.core
        was_busy = False
        while not self.exit_now:
            busy = core.has_unfinished()
            if not busy:
                if self.draining:
                    return
                if was_busy:
                    core.check_integrity()  # every page free or owned once; a failure is a bug: crash loudly
            self._handle_inbox(block=not busy)
            if core.has_unfinished():
                self._step()
            was_busy = busy

    # ---- messages from the frontend ------------------------------------------------------------------------
    def _handle_inbox(self, block: bool) -> None:
        try:
            msg = self.inbox.get(timeout=IDLE_CHECK_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            if block:
                self.core.check_integrity()
            return
        while True:
            self._handle(msg)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg) -> None:
        if isinstance(msg, EngineRequest):
            self._add(msg)
        elif isinstance(msg, EngineAbort):
            for rid in msg.request_ids:
                if self.core.abort(rid) is not None:  # frees its pages now
                    self.num_finished += 1  # ended here: the frontend has sent (or sends) its FINAL
                self._started.discard(rid)
        elif isinstance(msg, EngineStatsQuery):
            self.outbox.put(self.stats(msg.tag))
        elif isinstance(msg, EngineShutdown):
            self.drain()
            if not msg.drain:
                for req in [*self.core.running, *self.core.prefilling, *self.core.waiting]:
                    self.core.abort(req.request_id)
                self.exit_now = True

    def _add(self, m: EngineRequest) -> None:
        if self.draining:
            self.outbox.put(EngineReject(m.request_id, ErrorCode.SHUTTING_DOWN, "the server is shutting down"))
            return
        params = SamplingParams(temperature=m.temperature, top_p=m.top_p, top_k=m.top_k, max_tokens=m.max_tokens,
                                seed=m.client_seed, stop_token_ids=tuple(m.stop_token_ids), ignore_eos=m.ignore_eos)
        req = Request(m.request_id, list(m.prompt_token_ids), params, seed=m.seed, num_spec_tokens=m.num_spec_tokens)
        try:
            self.core.add_request(req)
        except InvalidRequestError as e:
            self.outbox.put(EngineReject(m.request_id, ErrorCode.INVALID_PARAMS, str(e)))

    def drain(self) -> None:
        if not self.draining:
            log.info("draining: %d running, %d waiting", len(self.core.running) + len(self.core.prefilling),
                     len(self.core.waiting))
        self.draining = True

    # ---- one step ------------------------------------------------------------------------------------------
    def _step(self) -> None:
        start = time.monotonic()
        outputs = self.core.step()
        self.num_steps += 1
        if outputs:
            with self.tracer.range(SEND):
                self.outbox.put(EngineOutputs([self._to_wire(o, start) for o in outputs]))

    def _to_wire(self, out: RequestOutput, step_start: float) -> EngineOutput:
        req = out.request
        rid = req.request_id
        first = rid not in self._started
        if first:
            self._started.add(rid)
        # Counted per output, as sent, so the frontend's counters (fed by the same outputs as they arrive) agree
        # with these whenever nothing is in flight, also for requests a stop string or an abort cut short.
        self.num_output_tokens += len(out.new_token_ids)
        if out.num_draft > 0:
            self.drafted += out.num_draft
            self.accepted += out.num_accepted
        acc = req.acceptance
        msg = EngineOutput(rid, list(out.new_token_ids), num_draft=out.num_draft, num_accepted=out.num_accepted,
                           queue_s=step_start - req.arrival_time if first else 0.0,
                           num_preemptions=req.num_preemptions,
                           spec_acceptance=round(self.core.policy.acceptance_estimate(acc), 4),
                           spec_steps_off=acc.steps_off, spec_steps_probing=acc.steps_probing)
        if out.finished:
            self._started.discard(rid)
            self.num_finished += 1
            msg.finish_reason = req.finish_reason.value
        return msg

    def stats(self, tag: int = 0) -> EngineStats:
        core = self.core
        try:
            core.check_integrity()
            ok, err = True, ""
        except Exception as e:  # reported, not raised: the stats query is how tests look for leaks
            ok, err = False, f"{type(e).__name__}: {e}"
        alloc = core.allocator
        return EngineStats(num_running=len(core.running) + len(core.prefilling), num_waiting=len(core.waiting),
                           num_free_pages=alloc.num_free, num_usable_pages=alloc.num_usable,
                           num_pages=alloc.num_pages, page_size=alloc.page_size, integrity_ok=ok,
                           integrity_error=err, num_preemptions=core.num_preemptions, num_steps=self.num_steps,
                           num_finished=self.num_finished, num_output_tokens=self.num_output_tokens,
                           drafted_tokens=self.drafted, accepted_tokens=self.accepted, pid=os.getpid(), tag=tag,
                           spec_policy=core.policy.cfg.kind, k_distribution=_k_distribution(core),
                           step_costs_ms=core.policy.costs.to_dict(), **_policy_stats(core), **_pacing_stats(core))


def _pacing_stats(core: EngineCore) -> dict:
    p = core.pacing()
    if p is None:
        return {}
    return dict(prefill_budget_tokens=p.budget_tokens, prefill_itl_target_ms=round(p.itl_target_s * 1e3, 3),
                prefill_efficient_tokens=p.efficient_tokens, mixed_step_share=round(p.mixed_share, 4))


def _policy_stats(core: EngineCore) -> dict:
    pol, d = core.policy, core.last_decision
    state = pol.governor.state()
    off = 0
    if d is not None and d.auto is not None and len(d.auto) == len(d.num_draft):
        off = int((d.auto & (d.num_draft == 0)).sum())
    return dict(spec_governor=pol.governor_state, spec_governor_ratio=round(state[0], 4) if state else 0.0,
                spec_governor_switches=pol.governor.switches, spec_probes=pol.reasons["probe"],
                spec_decisions=dict(pol.reasons), spec_requests_off=off,
                tensor_parallel_size=core.tensor_parallel_size)


def _k_distribution(core: EngineCore) -> dict[int, int]:
    d = core.last_decision
    if d is None:
        return {}
    ks, counts = np.unique(d.num_draft, return_counts=True)
    return {int(k): int(c) for k, c in zip(ks, counts)}


def ready_message(core: EngineCore, info, max_prompt_len: int | None) -> Ready:
    alloc = core.allocator
    # add_request admits a prompt of n tokens when pages_for(n + 2 + look-ahead) <= usable pages.
    kv_limit = alloc.max_prompt_tokens(core.lookahead)
    limit = min(info.max_model_len - 1, kv_limit, max_prompt_len or kv_limit)
    return Ready(protocol_version=PROTOCOL_VERSION, pid=os.getpid(), num_pages=alloc.num_pages,
                 page_size=alloc.page_size, max_model_len=info.max_model_len, max_prompt_len=limit,
                 vocab_size=info.vocab_size, max_batch_size=core.config.max_batch_size, device=info.device,
                 dtype=info.dtype, spec=info.spec, num_spec_tokens=core.config.num_spec_tokens,
                 eos_token_ids=list(info.eos_token_ids),
                 kv_cache=info.memory.describe() if info.memory is not None else "",
                 graphs=describe_capture(info.graphs),
                 tensor_parallel_size=info.tensor_parallel_size, prefill=info.prefill, kernels=info.kernels)


def engine_config(cfg: SchedulerProcessConfig) -> EngineConfig:
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in cfg.engine.items() if k in fields})


def run(cfg: SchedulerProcessConfig) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    recorder = TraceRecorder() if cfg.trace else None
    tracer = Tracer(recorder)
    core, _, info = build_engine(engine_config(cfg), tracer)
    ctx = zmq.Context()
    io = SocketIO(ctx, cfg)
    loop = SchedulerLoop(core, io.inbox, io.outbox, tracer)
    # SimpleQueue.put is reentrant (safe in a signal handler) and wakes the loop if it is blocked while idle.
    signal.signal(signal.SIGTERM, lambda *_: io.inbox.put(EngineShutdown(drain=True)))
    io.outbox.put(ready_message(core, info, cfg.max_prompt_len))
    log.info("ready: %s, %d KV pages of %d tokens; %s; %s", info.spec, core.allocator.num_pages,
             core.allocator.page_size, info.memory.describe() if info.memory is not None else "", info.prefill)
    failed = True
    try:
        loop.run()
        failed = False
    finally:
        core.close(failed)  # with tensor parallelism: releases the follower ranks (killed after a failure)
        io.close()
        ctx.term()
        if io.orphaned:  # nobody else will: the frontend bound them and was killed
            for address in (cfg.input_address, cfg.output_address):
                remove_ipc(address)
        if recorder is not None:
            recorder.save(cfg.trace)
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(level=os.environ.get("SPECSTEP_LOG_LEVEL", "INFO"),
                        format=f"specstep scheduler[{os.getpid()}] %(levelname)s: %(message)s")
    if len(argv) != 2:
        print("usage: python -m specstep.scheduler.server.scheduler_process CONFIG_JSON (started by `specstep serve`)",
              file=sys.stderr)
        return 2
    return run(msgspec.json.decode(argv[1], type=SchedulerProcessConfig))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
