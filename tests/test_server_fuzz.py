"""Property-based fuzzing of a live server: raw frames and well-formed messages with bad values. Every message
gets a typed error or its documented reply, the server stays responsive, and afterwards still serves correct
results with no leaked pages."""

from __future__ import annotations

import math

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sampling_params import SamplingParams
from loadgen.server import ServerProcess
from scheduler.protocol import (
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
    StatsRequest,
    decode_server,
    encode,
)
from scheduler.sockets import make_socket
from tests.helpers import make_core, run_to_completion

LIMIT = 8  # --max-tokens-limit: valid fuzzed requests finish quickly
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server(tiny_target):
    srv = ServerProcess(["--model", str(tiny_target), "--spec", "ngram", "--num-spec-tokens", "2", "--device", "cpu",
                         "--kv-cache-tokens", "2048", "--max-tokens-limit", str(LIMIT), "--max-prompt-len", "64"])
    srv.start()
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


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
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
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


def field_values(valid, *invalid):
    return st.one_of(valid, *invalid)


generate_arrays = st.tuples(
    field_values(st.text(min_size=1, max_size=6), st.just(""), st.integers(), st.none()),  # request_id
    field_values(st.none(), st.text(max_size=12), st.integers()),  # prompt
    field_values(st.none(), st.lists(st.integers(-2, 330), max_size=70), st.text(max_size=3)),  # prompt_token_ids
    field_values(st.integers(-1, LIMIT + 1), st.floats(), st.none()),  # max_tokens
    field_values(st.floats(-1, 3), st.just(math.nan), st.just(math.inf), st.text(max_size=2)),  # temperature
    field_values(st.floats(-0.5, 1.5), st.just(math.nan)),  # top_p
    field_values(st.integers(-2, 400)),  # top_k
    field_values(st.none(), st.integers(-(2**63), 2**64 - 1)),  # seed
    field_values(st.lists(st.text(max_size=3), max_size=3), st.just(["x"] * 20), st.text(max_size=2)),  # stop
    field_values(st.lists(st.integers(-1, 400), max_size=3)),  # stop_token_ids
    field_values(st.booleans(), st.integers(0, 2)),  # ignore_eos
    field_values(st.booleans(), st.none()),  # stream
    field_values(st.none(), st.integers(-1, 18), st.floats(0, 3)),  # num_spec_tokens
).flatmap(lambda t: st.integers(0, len(t) + 1).map(lambda n: list(t[:n]) + ([7] if n > len(t) else [])))


@FUZZ
@given(array=generate_arrays)
def test_generate_with_bad_values(server, ctx, array):
    replies = exchange(ctx, server.address, [bytes([MsgType.GENERATE]), msgspec.msgpack.encode(array)],
                       wait_final=True)
    check_replies(replies)
    assert len([r for r in replies if isinstance(r, (Error, Final))]) == 1, replies
    rid = array[0] if array and isinstance(array[0], str) and array[0] else None
    if isinstance(replies[-1], Error):
        assert replies[-1].request_id == rid
    else:
        assert isinstance(replies[-1], Final) and replies[-1].request_id == rid
        assert 1 <= replies[-1].usage.completion_tokens <= LIMIT


@FUZZ
@given(kind=st.sampled_from([MsgType.ABORT, MsgType.STATS, MsgType.HEALTH]), body=msgpack_values)
def test_other_messages_with_bad_values(server, ctx, kind, body):
    replies = exchange(ctx, server.address, [bytes([kind]), msgspec.msgpack.encode(body)])
    check_replies(replies)  # an abort of an unknown id, like a valid stats query, gets its documented reply


def test_still_correct_after_fuzzing(server, ctx, tiny_target):
    prompt = [11, 22, 33, 44, 55]
    want = run_to_completion(make_core(tiny_target, kv_cache_tokens=2048), [prompt],
                             SamplingParams(temperature=0.0, max_tokens=LIMIT))[0].output_token_ids
    replies = exchange(ctx, server.address, encode(GenerateRequest("ok", prompt_token_ids=prompt, max_tokens=LIMIT,
                                                                   temperature=0.0)), wait_final=True)
    assert [t for r in replies for t in r.token_ids] == want and isinstance(replies[-1], Final)
    sock = make_socket(ctx, zmq.DEALER, connect=server.address)
    try:
        for _ in range(100):  # pages of the last aborted/finished requests are released within a step or two
            sock.send_multipart(encode(StatsRequest()))
            assert sock.poll(10_000)
            stats = decode_server(sock.recv_multipart())
            assert stats.engine.integrity_ok and stats.restarts == 0
            if stats.engine.num_free_pages == stats.engine.num_usable_pages and stats.num_inflight == 0:
                break
        assert stats.engine.num_free_pages == stats.engine.num_usable_pages and stats.engine.num_running == 0
    finally:
        sock.close(linger=0)
