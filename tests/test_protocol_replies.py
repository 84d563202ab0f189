"""What docs/protocol.md promises a client, checked on the wire: a real frontend (ROUTER socket, asyncio) in this
process, a raw DEALER client reading bodies as plain msgpack, and a stand-in scheduler process (no torch, starts
in a fraction of a second) that finishes every request at once with one token equal to the top_k it was sent,
except requests for more than 100 tokens, which it keeps running until they are aborted."""

from __future__ import annotations

import asyncio
import re
import sys

import msgspec
import pytest
import zmq
import zmq.asyncio

from specstep.scheduler.server.frontend import Frontend, FrontendConfig
from specstep.scheduler.server.protocol import MAX_FRAME_BYTES, ErrorCode, MsgType
from specstep.scheduler.server.sockets import make_socket

STAND_IN = """
import os, sys, msgspec, zmq
from specstep.scheduler.server.protocol import *
cfg = msgspec.json.decode(sys.argv[-1], type=SchedulerProcessConfig)
ctx = zmq.Context()
pull = ctx.socket(zmq.PULL); pull.connect(cfg.input_address)
push = ctx.socket(zmq.PUSH); push.connect(cfg.output_address)
if os.environ.get("STAND_IN") == "ready":
    push.send_multipart(encode_engine(Ready(1, os.getpid(), 10, 16, 512, 100, 320, 8, "cpu", "float32", "ngram", 3)))
while True:
    msg = decode_to_engine(pull.recv_multipart())
    if isinstance(msg, EngineShutdown):
        break
    if isinstance(msg, EngineStatsQuery):
        push.send_multipart(encode_engine(EngineStats(tag=msg.tag)))
    if isinstance(msg, EngineRequest) and msg.max_tokens <= 100:
        out = EngineOutput(msg.request_id, [msg.top_k], "length")
        push.send_multipart(encode_engine(EngineOutputs([out])))
"""
LONG = 120  # max_tokens of a request the stand-in keeps running
E = msgspec.msgpack.encode


class Server:
    def __init__(self, frontend: Frontend, lines: list[str]) -> None:
        self.frontend = frontend
        self.lines = lines
        self.ctx = zmq.asyncio.Context()
        self.sock = make_socket(self.ctx, zmq.DEALER, connect=frontend.address)

    async def send(self, kind: int, body: bytes) -> None:
        await self.sock.send_multipart([bytes([kind]), body])

    async def recv(self, timeout_s: float = 10.0) -> tuple[int, list]:
        """The next reply as (type byte, the body as plain msgpack)."""
        kind, body = await asyncio.wait_for(self.sock.recv_multipart(), timeout_s)
        return kind[0], msgspec.msgpack.decode(body)

    async def ask(self, kind: int, body: bytes) -> tuple[int, list]:
        await self.send(kind, body)
        return await self.recv()


async def start(monkeypatch, mode: str) -> tuple[Server, asyncio.Task]:
    import specstep.scheduler.server.supervisor as supervisor

    monkeypatch.setenv("STAND_IN", mode)
    monkeypatch.setattr(supervisor, "module_command", lambda _: [sys.executable, "-c", STAND_IN])
    frontend = Frontend(FrontendConfig(address="tcp://127.0.0.1:0", engine={}, model_name="tiny",
                                       startup_timeout_s=60, drain_timeout_s=5.0), tokenizer=None)
    lines: list[str] = []
    task = asyncio.ensure_future(frontend.serve(lines.append))
    for _ in range(500):
        if any(("ready" if mode == "ready" else "listening") in line for line in lines):
            break
        await asyncio.sleep(0.02)
    return Server(frontend, lines), task


@pytest.fixture
async def server(monkeypatch, request):
    srv, task = await start(monkeypatch, getattr(request, "param", "ready"))
    yield srv
    srv.sock.close(linger=0)
    srv.ctx.destroy(linger=0)
    srv.frontend.begin_drain()
    assert await asyncio.wait_for(task, 30) == 0


def generate(rid, *fields) -> bytes:
    return E([rid, None, [1, 2, 3], *fields])


@pytest.mark.parametrize("server", ["silent"], indirect=True)
async def test_before_ready_health_has_every_field_placeholders_and_the_bound_address(server):
    address = re.search(r"listening on (\S+)", server.lines[0]).group(1)
    assert not address.endswith(":0") and server.frontend.supervisor.state == "starting"
    assert await server.ask(MsgType.HEALTH, E([])) == (MsgType.HEALTH_REPLY,
                                                       [1, "starting", "tiny", "", 0, 0, 0, 0, address])
    kind, stats = await server.ask(MsgType.STATS, E([]))
    assert kind == MsgType.STATS_REPLY and stats[:5] == [1, "starting", 0, 0, None] and isinstance(stats[5], dict)


async def test_ready_health_and_ready_line_carry_the_bound_address(server):
    address = server.frontend.address
    assert await server.ask(MsgType.HEALTH, E([])) == (MsgType.HEALTH_REPLY,
                                                       [1, "ok", "tiny", "ngram", 512, 100, 142, 320, address])
    assert any(line.startswith("specstep serve: ready") and line.endswith(f" on {address}") for line in server.lines)


@pytest.mark.parametrize("kind, body, message, rid", [
    (MsgType.GENERATE, generate("a", "x"), "max_tokens: expected int, got str", "a"),
    (MsgType.GENERATE, generate("a", 4, 0.0, 1.0, 0, None, ["s", 3]), "stop[1]: expected str, got int", "a"),
    (MsgType.GENERATE, E(["a", None, [1, "x"]]), "prompt_token_ids[1]: expected int, got str", "a"),
    (MsgType.GENERATE, E([]), "request_id: required field missing", None),
    (MsgType.GENERATE, E([7, "hi"]), "request_id: expected str, got int", None),
    (MsgType.GENERATE, b"\x92\xa1a\xa2\xff\xfe", "prompt: a string is not valid UTF-8", "a"),
    (MsgType.GENERATE, E(["a", "hi"]) + b"\x00", "the body is not a single msgpack value", "a"),
    (MsgType.GENERATE, E({"request_id": "a"}), "the body must be a msgpack array", None),
    (MsgType.ABORT, E([]), "request_id: required field missing", None),
    (MsgType.ABORT, E([5]), "request_id: expected str, got int", None),
    (MsgType.ABORT, E(["a", 1]), "too many elements: AbortRequest has 1 (request_id), got 2", None),
    (MsgType.HEALTH, E([1]), "too many elements: HealthRequest has 0 (no fields), got 1", None),
    (MsgType.STATS, E(["x"]), "too many elements: StatsRequest has 0 (no fields), got 1", None),
])
async def test_malformed_messages_name_the_field(server, kind, body, message, rid):
    reply, error = await server.ask(kind, body)
    assert reply == MsgType.ERROR and error[0] == ErrorCode.MALFORMED and error[1].startswith(message), error
    assert error[2:] == [rid, False]


@pytest.mark.parametrize("fields, field", [
    ((0,), "max_tokens"), ((4, -1.0), "temperature"), ((4, 1.0, 0.0), "top_p"), ((4, 1.0, 1.0, -2), "top_k"),
    ((4, 1.0, 1.0, 0, -1), "seed"), ((4, 1.0, 1.0, 0, None, [""]), "stop"),
    ((4, 1.0, 1.0, 0, None, [], [320]), "stop_token_ids"),
    ((4, 1.0, 1.0, 0, None, [], [], False, True, 17), "num_spec_tokens"),
])
async def test_invalid_values_name_the_field(server, fields, field):
    kind, error = await server.ask(MsgType.GENERATE, generate("v", *fields))
    assert kind == MsgType.ERROR and error[0] == ErrorCode.INVALID_PARAMS and error[2] == "v", error
    assert error[1].startswith(f"{field}: "), error
    for body, field in ((E(["v"]), "prompt"), (E(["v", None, []]), "prompt_token_ids"),
                        (E(["v", None, [320]]), "prompt_token_ids"), (E(["x" * 257, None, [1]]), "request_id")):
        kind, error = await server.ask(MsgType.GENERATE, body)
        assert kind == MsgType.ERROR and error[1].startswith(f"{field}: "), error
    assert error[2] is None  # an id the server refused is not echoed (a shortened one could match another)


async def test_top_k_minus_one_and_above_the_vocabulary_mean_off(server):
    """As in vLLM and SGLang: -1 is off (sent to the scheduler as 0); a top_k >= vocab_size keeps every token."""
    for top_k, sent in ((-1, 0), (0, 0), (5, 5), (100_000, 100_000)):
        kind, final = await server.ask(MsgType.GENERATE, generate(f"k{top_k}", 4, 1.0, 1.0, top_k))
        assert (kind, final[0], final[1], final[2]) == (MsgType.FINAL, f"k{top_k}", "length", [sent]), final


async def test_a_duplicate_id_error_says_the_running_request_continues(server):
    await server.send(MsgType.GENERATE, generate("dup", LONG))
    kind, error = await server.ask(MsgType.GENERATE, generate("dup", 4))
    assert kind == MsgType.ERROR and error[0] == ErrorCode.DUPLICATE_REQUEST_ID and error[2:] == ["dup", True]
    # ... even while the server drains, where a new id gets SHUTTING_DOWN (which ends that request)
    server.frontend.begin_drain()
    kind, error = await server.ask(MsgType.GENERATE, generate("dup", 4))
    assert error[0] == ErrorCode.DUPLICATE_REQUEST_ID and error[2:] == ["dup", True], error
    kind, error = await server.ask(MsgType.GENERATE, generate("new", 4))
    assert error[0] == ErrorCode.SHUTTING_DOWN and error[2:] == ["new", False], error
    kind, final = await server.ask(MsgType.ABORT, E(["dup"]))  # the first request was running all along
    assert (kind, final[0], final[1]) == (MsgType.FINAL, "dup", "abort")


async def test_a_body_over_the_limit_gets_too_large_with_its_request_id(server):
    body = generate("big", 4, 1.0, 1.0, 0, None, ["x" * 200] * (MAX_FRAME_BYTES // 200 + 1))
    assert len(body) > MAX_FRAME_BYTES
    kind, error = await server.ask(MsgType.GENERATE, body)
    assert (kind, error[0], error[2], error[3]) == (MsgType.ERROR, ErrorCode.TOO_LARGE, "big", False), error[:1]


async def test_every_error_is_counted_by_code(server):
    await server.ask(MsgType.GENERATE, E([]))
    await server.ask(MsgType.GENERATE, generate("e", 0))
    kind, stats = await server.ask(MsgType.STATS, E([]))
    assert kind == MsgType.STATS_REPLY and stats[4] is not None
    metrics = stats[5]
    assert metrics['specstep_errors_total{code="MALFORMED"}'] == 1, metrics
    assert metrics['specstep_errors_total{code="INVALID_PARAMS"}'] == 1
