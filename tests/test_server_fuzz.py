"""Property-based fuzzing of a real `specstep serve` over its socket: raw frames, well-formed messages with bad
values; every reply is a documented one, and afterwards the server still serves correct results with no leaked
pages."""

from __future__ import annotations

import functools
import math

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from specstep.loadgen.client import Client
from specstep.scheduler.server.protocol import (
    CLIENT_TYPES,
    Delta,
    Error,
    ErrorCode,
    Final,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    MsgType,
    StatsReply,
    decode_server,
    encode,
)
from specstep.scheduler.server.sockets import make_socket

# The shared fixtures are imported by name (pytest finds them in the module); tests take them as
# arguments, which ruff reads as redefinitions.
# ruff: noqa: F811
from tests.server_fixtures import LIMIT, MAX_TOKENS, expected, prompts, reference, server, tokenizer  # noqa: F401

FUZZ_TOKENS = 6  # valid fuzzed requests ask for at most this many tokens
# Subnormal floats are off: building the offline reference engine turns on flush-to-zero in this process.
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
floats = functools.partial(st.floats, allow_subnormal=False)


@pytest.fixture(scope="module")
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def exchange(ctx, address: str, frames: list[bytes], wait_final: bool = False, timeout_ms: int = 10_000) -> list:
    """Send `frames` from a fresh DEALER, then a health query; every reply up to the health reply (and, with
    `wait_final`, up to a request's Final or Error). Later replies go to a closed socket: the server must cope."""
    sock = make_socket(ctx, zmq.DEALER, connect=address)
    try:
        sock.send_multipart(frames)
        sock.send_multipart(encode(HealthRequest()))
        replies: list = []
        healthy = False
        while not healthy or (wait_final and not any(isinstance(r, (Final, Error)) for r in replies)):
            assert sock.poll(timeout_ms), f"no reply within {timeout_ms} ms; got {replies}"
            msg = decode_server(sock.recv_multipart())
            if isinstance(msg, HealthReply):
                healthy = True
            else:
                replies.append(msg)
        return replies
    finally:
        sock.close(linger=0)


ALLOWED_CODES = {ErrorCode.MALFORMED, ErrorCode.UNKNOWN_TYPE, ErrorCode.INVALID_PARAMS, ErrorCode.PROMPT_TOO_LONG}
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12)
type_bytes = st.sampled_from([bytes([t]) for t in CLIENT_TYPES] + [b"\x00", b"\x81", b"\xff", b"", b"\x01\x01"])
bodies = st.binary(max_size=40) | msgpack_values.map(msgspec.msgpack.encode)


def check_replies(replies: list) -> None:
    for r in replies:
        assert isinstance(r, (Error, Delta, Final, StatsReply)), r
        if isinstance(r, Error):
            assert r.code in ALLOWED_CODES, r


@FUZZ
@given(frames=st.lists(bodies, min_size=0, max_size=3), kind=type_bytes)
def test_raw_frames(server, ctx, kind, frames):
    replies = exchange(ctx, server.address, [kind, *frames])
    check_replies(replies)
    valid = len(frames) == 1 and len(kind) == 1 and kind[0] in CLIENT_TYPES
    if not valid:  # structurally wrong: exactly one error, and no request id to report
        assert [type(r) for r in replies] == [Error], replies
        assert replies[0].code in (ErrorCode.MALFORMED, ErrorCode.UNKNOWN_TYPE)


# (valid, out of range) values for each GenerateRequest field, in order. A request starts valid; up to two fields
# get an out-of-range value or a value of any type, and the array may be cut short or overlong.
generate_fields = (
    (st.text(min_size=1, max_size=6), st.just("")),  # request_id
    (st.none(), st.sampled_from(["def f(x):", "héllo ✓", ""])),  # prompt (with ids: both given)
    (st.lists(st.integers(0, 319), min_size=1, max_size=20),
     st.lists(st.integers(-2, 330), max_size=70) | st.none()),  # prompt_token_ids
    (st.integers(1, FUZZ_TOKENS), st.integers(-1, 0) | st.just(LIMIT + 1)),  # max_tokens
    (floats(0, 2), floats(-1, -0.01) | st.sampled_from([math.nan, math.inf, 101.0])),  # temperature
    (floats(0.01, 1), floats(1.001, 2) | st.sampled_from([0.0, math.nan])),  # top_p
    (st.integers(-1, 400), st.integers(-3, -2)),  # top_k (-1 = off)
    (st.none() | st.integers(0, 2**32), st.integers(2**63, 2**64 - 1) | st.integers(-(2**63), -1)),  # seed
    (st.lists(st.text(min_size=1, max_size=3), max_size=3), st.just(["x"] * 20) | st.just([""])),  # stop
    (st.lists(st.integers(0, 319), max_size=3), st.lists(st.integers(320, 400), min_size=1, max_size=3)),
    (st.booleans(), st.nothing()),  # ignore_eos
    (st.booleans(), st.nothing()),  # stream
    (st.none() | st.integers(0, 16), st.integers(17, 99) | st.just(-1)),  # num_spec_tokens
)


@st.composite
def generate_arrays(draw) -> list:
    array = [draw(valid) for valid, _ in generate_fields]
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2]))):
        k = draw(st.integers(0, len(array) - 1))
        bad = generate_fields[k][1]
        array[k] = draw(msgpack_values if bad.is_empty or draw(st.booleans()) else bad)
    n = draw(st.sampled_from([len(array)] * 6 + [0, 1, 3, 8, len(array) + 1]))
    return array[:n] + [7] * (n - len(array))


@FUZZ
@given(array=generate_arrays())
def test_generate_with_bad_values(server, ctx, array):
    replies = exchange(ctx, server.address, [bytes([MsgType.GENERATE]), msgspec.msgpack.encode(array)],
                       wait_final=True)
    check_replies(replies)
    assert len([r for r in replies if isinstance(r, (Error, Final))]) == 1, replies
    rid = array[0] if array and isinstance(array[0], str) and array[0] else None
    event(f"Error {ErrorCode(replies[-1].code).name}" if isinstance(replies[-1], Error) else "Final")
    if isinstance(replies[-1], Error):
        assert replies[-1].request_id == rid
    else:
        assert isinstance(replies[-1], Final) and replies[-1].request_id == rid
        assert 1 <= replies[-1].usage.completion_tokens <= max(FUZZ_TOKENS, 16)  # 16: the default max_tokens


@FUZZ
@given(kind=st.sampled_from([MsgType.ABORT, MsgType.STATS, MsgType.HEALTH]), body=msgpack_values)
def test_other_messages_with_bad_values(server, ctx, kind, body):
    replies = exchange(ctx, server.address, [bytes([kind]), msgspec.msgpack.encode(body)])
    check_replies(replies)  # an abort of an unknown id, like a valid stats query, gets its documented reply


async def test_still_correct_after_fuzzing(server, ctx, prompts, reference):
    _, ids = prompts
    replies = exchange(ctx, server.address, encode(GenerateRequest("ok", prompt_token_ids=ids[9], max_tokens=MAX_TOKENS,
                                                                   temperature=0.0)), wait_final=True)
    assert [t for r in replies for t in r.token_ids] == expected(reference, 9, MAX_TOKENS)[0]
    assert isinstance(replies[-1], Final)
    c = Client(server.address)
    try:
        stats = await c.wait_idle(10)  # integrity checked, every page free, nothing in flight
        assert stats.restarts == 0
    finally:
        c.close()
