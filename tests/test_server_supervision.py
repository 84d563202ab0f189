"""Supervision through real processes: a killed scheduler process fails its in-flight requests promptly with a
typed error and is restarted while the frontend stays up; SIGTERM drains; restarts are bounded (checked with a
stand-in scheduler process that starts in a fraction of a second)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest
import zmq.asyncio

from specstep.loadgen.client import Client
from specstep.loadgen.server import ServerProcess
from specstep.scheduler.server.protocol import (
    Delta,
    Error,
    ErrorCode,
    Final,
    GenerateRequest,
    ProtocolError,
    SchedulerProcessConfig,
)
from specstep.scheduler.server.sockets import pid_alive
from specstep.scheduler.server.supervisor import SchedulerSupervisor

LONG = 400  # tokens: still running when the test acts


def long_request(rid: str) -> GenerateRequest:
    return GenerateRequest(rid, prompt_token_ids=[3, 1, 4, 1, 5], max_tokens=LONG, temperature=0.0, ignore_eos=True)


async def started(client: Client, req: GenerateRequest):
    """Send `req` and wait for its first delta; returns the rest of its stream."""
    stream = client.generate(req)
    first = await asyncio.wait_for(stream.__anext__(), 30)
    assert isinstance(first, Delta), first
    return stream


async def end_of(stream) -> Final | Error:
    async for msg in stream:
        if not isinstance(msg, Delta):
            return msg
    raise AssertionError("stream ended without a final message")


@pytest.fixture(scope="module")
def server(tiny_target):
    srv = ServerProcess(["--model", str(tiny_target), "--spec", "none", "--device", "cpu", "--kv-cache-tokens", "4096"])
    srv.start()
    yield srv
    srv.stop()


async def test_killed_scheduler_errors_in_flight_and_restarts(server):
    c = Client(server.address)
    try:
        short = GenerateRequest("before", prompt_token_ids=[2, 7, 1, 8], max_tokens=12, temperature=0.0)
        before = await c.complete(short, 30)
        pid = (await c.stats()).engine.pid
        streams = [await started(c, long_request(f"x{i}")) for i in range(3)]
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        ends = await asyncio.wait_for(asyncio.gather(*[end_of(s) for s in streams]), 10)
        assert time.monotonic() - t0 < 5.0
        assert all(isinstance(e, Error) and e.code == ErrorCode.ENGINE_DIED for e in ends), ends
        assert [e.request_id for e in ends] == ["x0", "x1", "x2"]
        # The frontend stays up and restarts the scheduler; a request sent meanwhile waits for it.
        after = await c.complete(GenerateRequest("after", prompt_token_ids=[2, 7, 1, 8], max_tokens=12,
                                                 temperature=0.0), 120)
        assert after.token_ids == before.token_ids and after.final.finish_reason == "length"
        stats = await c.wait_idle(10)
        assert stats.restarts == 1 and stats.engine.pid != pid and not pid_alive(pid)
        assert server.proc.poll() is None
    finally:
        c.close()


async def test_sigterm_drains_in_flight_requests_then_exits(server):
    c, late = Client(server.address), Client(server.address)
    try:
        pid = (await c.stats()).engine.pid
        stream = await started(c, long_request("drained"))
        server.signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        refused = await late.complete(GenerateRequest("new", prompt_token_ids=[1, 2], max_tokens=4), 10)
        assert refused.error is not None and refused.error.code == ErrorCode.SHUTTING_DOWN
        end = await asyncio.wait_for(end_of(stream), 60)
        assert isinstance(end, Final) and end.finish_reason == "length" and end.usage.completion_tokens == LONG
        assert await asyncio.get_running_loop().run_in_executor(None, server.wait, 30) == 0
        for _ in range(100):
            if not pid_alive(pid):
                break
            await asyncio.sleep(0.05)
        assert not pid_alive(pid)
    finally:
        c.close()
        late.close()


# A stand-in scheduler: connects, announces itself, then reads and ignores everything (no torch, starts fast).
FAKE_SCHEDULER = """
import os, sys, msgspec, zmq
from specstep.scheduler.server.protocol import Ready, SchedulerProcessConfig, encode_engine
cfg = msgspec.json.decode(sys.argv[-1], type=SchedulerProcessConfig)
ctx = zmq.Context()
pull = ctx.socket(zmq.PULL); pull.connect(cfg.input_address)
push = ctx.socket(zmq.PUSH); push.connect(cfg.output_address)
if os.environ.get("FAKE_MODE") != "silent":
    push.send_multipart(encode_engine(Ready(1, os.getpid(), 10, 16, 512, 100, 320, 8, "cpu", "float32", "none", 0)))
while True:
    pull.recv_multipart()
"""


class Recorder:
    def __init__(self) -> None:
        self.died: list[int] = []

    def on_outputs(self, msg) -> None: ...
    def on_reject(self, msg) -> None: ...

    def on_engine_died(self, incarnation: int) -> None:
        self.died.append(incarnation)


def supervisor(ctx, handler, command, **kw) -> SchedulerSupervisor:
    make = lambda i, o: SchedulerProcessConfig(engine={}, input_address=i, output_address=o, parent_pid=os.getpid())
    return SchedulerSupervisor(ctx, make, handler, command=command, **kw)


async def wait_for_state(sup: SchedulerSupervisor, *states: str) -> None:
    for _ in range(400):
        if sup.state in states:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"state {sup.state}, wanted {states}")


async def test_restarts_are_bounded_then_unavailable():
    ctx, rec = zmq.asyncio.Context(), Recorder()
    sup = supervisor(ctx, rec, [sys.executable, "-c", FAKE_SCHEDULER], startup_timeout_s=30, max_restarts=2,
                     restart_window_s=60)
    try:
        assert await sup.start()
        pids = [sup.ready.pid]
        for _ in range(2):
            os.kill(pids[-1], signal.SIGKILL)
            await wait_for_state(sup, "restarting")
            await wait_for_state(sup, "ready")
            assert sup.ready.pid != pids[-1]
            pids.append(sup.ready.pid)
        assert rec.died == [1, 2] and sup.restarts == 2
        os.kill(pids[-1], signal.SIGKILL)
        await wait_for_state(sup, "failed")
        with pytest.raises(ProtocolError) as e:
            await sup.wait_ready()
        assert e.value.code == ErrorCode.UNAVAILABLE and rec.died == [1, 2, 3]
    finally:
        await sup.stop(timeout_s=2)
        ctx.destroy(linger=0)
    assert not any(pid_alive(p) for p in pids)


@pytest.mark.parametrize("mode", ["crash", "silent"])
async def test_failed_start_is_reported_and_leaves_no_process(mode, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", mode)
    command = [sys.executable, "-c", "import sys; sys.exit(3)"] if mode == "crash" else [
        sys.executable, "-c", FAKE_SCHEDULER]
    ctx = zmq.asyncio.Context()
    sup = supervisor(ctx, Recorder(), command, startup_timeout_s=2.0)
    try:
        assert not await sup.start() and sup.state == "failed" and sup.ready is None
    finally:
        await sup.stop(timeout_s=2)
        ctx.destroy(linger=0)


async def test_stop_during_start_cancels_the_start(monkeypatch):
    """SIGTERM while the model loads: stop() cancels the start and reaps the process, start() returns False,
    and nothing becomes ready afterwards."""
    monkeypatch.setenv("FAKE_MODE", "silent")  # the fake never reports ready: a start that would take forever
    ctx = zmq.asyncio.Context()
    sup = supervisor(ctx, Recorder(), [sys.executable, "-c", FAKE_SCHEDULER], startup_timeout_s=60)
    try:
        start = asyncio.ensure_future(sup.start())
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        await sup.stop(timeout_s=2)
        assert time.monotonic() - t0 < 5 and sup.state == "stopped"
        assert await asyncio.wait_for(start, 5) is False
        await asyncio.sleep(0.2)
        assert sup.state == "stopped" and sup.ready is None and sup._current is None
    finally:
        await sup.stop(timeout_s=2)
        ctx.destroy(linger=0)


@pytest.mark.parametrize("failure", ["bind", "spawn"])
async def test_restarts_that_cannot_start_end_failed_not_stuck(failure, monkeypatch):
    """The scheduler dies and its successors cannot even be started (ipc bind fails, or the command cannot be
    spawned): the supervisor ends `failed` (waiting requests get UNAVAILABLE) and leaves no socket open."""
    import specstep.scheduler.server.supervisor as sup_mod

    ctx, rec = zmq.asyncio.Context(), Recorder()
    sup = supervisor(ctx, rec, [sys.executable, "-c", FAKE_SCHEDULER], startup_timeout_s=30, max_restarts=2,
                     restart_window_s=60)
    made: list = []
    real_make_socket = sup_mod.make_socket

    def make_socket(*args, **kw):
        if failure == "bind":
            raise zmq.ZMQError(zmq.EADDRINUSE)
        made.append(real_make_socket(*args, **kw))
        return made[-1]
    try:
        assert await sup.start()
        monkeypatch.setattr(sup_mod, "make_socket", make_socket)
        if failure == "spawn":
            sup.command = ["/nonexistent/specstep-scheduler"]
        os.kill(sup.ready.pid, signal.SIGKILL)
        await wait_for_state(sup, "failed")
        with pytest.raises(ProtocolError) as e:
            await sup.wait_ready()
        assert e.value.code == ErrorCode.UNAVAILABLE
        assert all(s.closed for s in made)
    finally:
        await sup.stop(timeout_s=2)
        ctx.destroy(linger=0)
