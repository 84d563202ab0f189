"""Supervision through real processes: a killed scheduler process fails its in-flight requests promptly with a
typed error and is restarted (a bounded number of times) while the frontend stays up; SIGTERM drains."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from loadgen.client import Client
from loadgen.server import ServerProcess
from scheduler.protocol import Delta, Error, ErrorCode, Final, GenerateRequest

LONG = 400  # tokens: still running when the test acts


def server_args(model) -> list[str]:
    return ["--model", str(model), "--spec", "none", "--device", "cpu", "--kv-cache-tokens", "4096"]


def long_request(rid: str, stream: bool = True) -> GenerateRequest:
    return GenerateRequest(rid, prompt_token_ids=[3, 1, 4, 1, 5], max_tokens=LONG, temperature=0.0, ignore_eos=True,
                           stream=stream)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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
    srv = ServerProcess([*server_args(tiny_target), "--max-restarts", "1"])
    srv.start()
    yield srv
    srv.stop()


async def test_killed_scheduler_errors_in_flight_restarts_then_gives_up(server):
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
        stats = await c.stats()
        assert stats.restarts == 1 and stats.engine.pid != pid and stats.engine.integrity_ok
        assert not alive(pid)

        # Past --max-restarts the frontend reports `failed` and answers UNAVAILABLE, but keeps serving health.
        os.kill(stats.engine.pid, signal.SIGKILL)
        for _ in range(200):
            if (await c.health()).status == "failed":
                break
            await asyncio.sleep(0.05)
        assert (await c.health()).status == "failed"
        res = await c.complete(GenerateRequest("late", prompt_token_ids=[1, 2], max_tokens=4), 10)
        assert res.error is not None and res.error.code == ErrorCode.UNAVAILABLE
        assert server.proc.poll() is None
    finally:
        c.close()


async def test_sigterm_drains_in_flight_requests_then_exits(tiny_target):
    srv = ServerProcess(server_args(tiny_target))
    srv.start()
    c, late = Client(srv.address), Client(srv.address)
    try:
        pid = (await c.stats()).engine.pid
        stream = await started(c, long_request("drained"))
        srv.signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        refused = await late.complete(GenerateRequest("new", prompt_token_ids=[1, 2], max_tokens=4), 10)
        assert refused.error is not None and refused.error.code == ErrorCode.SHUTTING_DOWN
        end = await asyncio.wait_for(end_of(stream), 60)
        assert isinstance(end, Final) and end.finish_reason == "length"
        assert end.usage.completion_tokens == LONG
        assert await asyncio.get_running_loop().run_in_executor(None, srv.wait, 30) == 0
        for _ in range(100):
            if not alive(pid):
                break
            await asyncio.sleep(0.05)
        assert not alive(pid)
    finally:
        c.close()
        late.close()
        srv.stop()
