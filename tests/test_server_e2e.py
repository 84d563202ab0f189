"""End to end through real sockets and real processes: `specstep serve` (frontend + scheduler process) with
n-gram speculation, many concurrent clients, streamed outputs compared with offline plain greedy decoding;
aborts, vanished clients, typed errors; then property-based fuzzing of raw frames and bad values, after which
the server must still serve correct results with no leaked pages. One server for the whole module."""

from __future__ import annotations

import asyncio
import functools
import math
import random

import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from specstep.engine.sampling_params import SamplingParams
from specstep.engine.tokenizer import Tokenizer
from specstep.loadgen.client import Client
from specstep.loadgen.server import ServerProcess
from specstep.scheduler.protocol import (
    CLIENT_TYPES,
    AbortRequest,
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
from specstep.scheduler.sockets import make_socket
from tests.helpers import make_core, run_to_completion

MAX_TOKENS = 24
LIMIT = 400  # --max-tokens-limit; long requests use all of it
REF_TOKENS = 96  # offline reference length


@pytest.fixture(scope="module")
def server(tiny_target):
    srv = ServerProcess(["--model", str(tiny_target), "--spec", "ngram", "--num-spec-tokens", "3", "--device", "cpu",
                         "--kv-cache-tokens", "4096", "--max-tokens-limit", str(LIMIT)])
    srv.start()
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    return Tokenizer.from_folder(tiny_target)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    rng = random.Random(0)
    texts = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self", "# sum\nx = ["]
    ids = [tokenizer.encode(t) for t in texts]
    ids += [[rng.randrange(1, 320) for _ in range(rng.randrange(3, 40))] for _ in range(12)]
    return texts, ids


@pytest.fixture(scope="module")
def reference(tiny_target, prompts):
    """Offline plain greedy decoding (no speculation) of every prompt: what the server must stream."""
    core = make_core(tiny_target, kv_cache_tokens=4096)
    reqs = run_to_completion(core, prompts[1], SamplingParams(temperature=0.0, max_tokens=REF_TOKENS))
    return [(r.output_token_ids, r.finish_reason.value) for r in reqs]


def expected(reference, i: int, max_tokens: int) -> tuple[list[int], str]:
    ids, reason = reference[i]
    return (ids[:max_tokens], "length") if len(ids) >= max_tokens else (ids, reason)


async def test_health(server):
    c = Client(server.address)
    try:
        h = await c.health()
        assert (h.protocol_version, h.status, h.spec, h.vocab_size, h.max_tokens) == (1, "ok", "ngram", 320, LIMIT)
        assert h.max_prompt_len == h.max_model_len - 1 == 511
        assert h.address == server.address and not h.address.endswith(":0")  # started on port 0
        ready = next(line for line in server.log().splitlines() if line.startswith("specstep serve: ready"))
        assert ready.endswith(f" on {server.address}")
    finally:
        c.close()


async def test_concurrent_clients_match_offline_greedy(server, prompts, reference, tokenizer):
    texts, ids = prompts
    clients = [Client(server.address) for _ in range(8)]

    def request(i: int) -> GenerateRequest:
        as_text = i < len(texts)
        return GenerateRequest(f"r{i}", prompt=texts[i] if as_text else None,
                               prompt_token_ids=None if as_text else ids[i], max_tokens=MAX_TOKENS - i % 3,
                               temperature=0.0, stream=i % 4 != 3, num_spec_tokens=[None, 0, 2, 3][i % 4])

    try:
        reqs = [request(i) for i in range(len(ids))]
        results = await asyncio.gather(*[clients[i % 8].complete(r, 60) for i, r in enumerate(reqs)])
    finally:
        for c in clients:
            c.close()
    for i, (req, res) in enumerate(zip(reqs, results)):
        want, reason = expected(reference, i, req.max_tokens)
        assert res.error is None, res.error
        assert res.token_ids == want, f"request {i}"
        assert res.final.finish_reason == reason
        assert res.text == tokenizer.decode(want)
        assert res.final.usage.prompt_tokens == len(ids[i]) and res.final.usage.completion_tokens == len(want)
        assert (res.num_deltas > 0) == req.stream
        if req.num_spec_tokens == 0:
            assert res.final.spec.drafted_tokens == 0
        t = res.final.timings
        assert 0 < t.ttft_s <= t.total_s and t.queue_s <= t.ttft_s and 0 <= t.mean_itl_s <= t.max_itl_s + 1e-9
    spec = [r.final.spec for r in results]
    assert sum(s.drafted_tokens for s in spec) > 0  # n-gram speculation ran
    assert all(s.accepted_tokens <= s.drafted_tokens for s in spec)


async def test_stop_strings_and_stop_tokens(server, prompts, reference, tokenizer):
    texts, ids = prompts
    want, _ = expected(reference, 4, REF_TOKENS)
    full = tokenizer.decode(want)
    # A stop string taken from the second half of the expected text: the text ends right before its first match.
    stop = next(full[k:k + 3] for k in range(len(full) // 2, len(full) - 3) if "\ufffd" not in full[k:k + 3])
    cut = full.index(stop)
    c = Client(server.address)
    try:
        res = await c.complete(GenerateRequest("s1", prompt_token_ids=ids[4], max_tokens=REF_TOKENS, temperature=0.0,
                                               stop=[stop, "never-appears"]), 30)
        assert res.final.finish_reason == "stop" and res.text == full[:cut]
        assert want[:len(res.token_ids)] == res.token_ids and stop in tokenizer.decode(res.token_ids)
        # Cut by the frontend, not the engine: its speculation stats still come from the engine's steps.
        whole = await c.complete(GenerateRequest("s0", prompt_token_ids=ids[4], max_tokens=len(res.token_ids),
                                                 temperature=0.0), 30)
        assert whole.final.spec.spec_steps > 0 and res.final.spec.spec_steps > 0
        assert res.final.spec.drafted_tokens == sum(res.final.spec.drafted_per_position)
        # A stop token id: the output ends with it.
        tok = want[5]
        res = await c.complete(GenerateRequest("s2", prompt_token_ids=ids[4], max_tokens=REF_TOKENS, temperature=0.0,
                                               stop_token_ids=[tok], stream=False), 30)
        assert res.final.finish_reason == "stop" and res.token_ids == want[: want.index(tok) + 1]
    finally:
        c.close()


async def test_abort_mid_stream_frees_pages_and_spares_others(server, prompts, reference):
    _, ids = prompts
    a, b = Client(server.address), Client(server.address)
    try:
        other = asyncio.ensure_future(b.complete(GenerateRequest("o", prompt_token_ids=ids[6],
                                                                 max_tokens=MAX_TOKENS, temperature=0.0), 60))
        got: list[int] = []
        final = None
        async for msg in a.generate(GenerateRequest("x", prompt_token_ids=ids[5], max_tokens=LIMIT,
                                                    temperature=0.0, ignore_eos=True)):
            if isinstance(msg, Final):
                final = msg
                got += msg.token_ids
                break
            got += msg.token_ids
            if len(got) >= 3:
                a.abort("x")
        assert final is not None and final.finish_reason == "abort", final
        assert 3 <= len(got) < LIMIT and final.usage.completion_tokens == len(got)
        assert got == reference[5][0][: len(got)]
        res = await other
        assert res.token_ids == expected(reference, 6, MAX_TOKENS)[0]
        await b.wait_idle(10)
        a.abort("x")  # aborting a finished request is a no-op (no reply)
        await a.wait_idle(10)
        assert not a.stray
    finally:
        a.close()
        b.close()


async def test_abort_right_behind_its_generate(server, prompts):
    """GENERATE and ABORT back to back reach the frontend together: the request's task is cancelled before it
    ever runs, and the client must still get its abort Final, with nothing left in flight."""
    _, ids = prompts
    ctx = zmq.asyncio.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=server.address)
    c = Client(server.address)
    try:
        for rid in ("r1", "r1", "r2"):  # the id is free again afterwards
            await sock.send_multipart(encode(GenerateRequest(rid, prompt_token_ids=ids[1], max_tokens=LIMIT,
                                                             temperature=0.0, ignore_eos=True)))
            await sock.send_multipart(encode(AbortRequest(rid)))
            reply = decode_server(await asyncio.wait_for(sock.recv_multipart(), 10))
            assert isinstance(reply, Final) and reply.finish_reason == "abort" and reply.request_id == rid, reply
        stats = await c.wait_idle(10)
        assert stats.metrics.get('specstep_requests_total{finish_reason="abort"}', 0) >= 3, stats.metrics
    finally:
        c.close()
        sock.close(0)
        ctx.destroy(0)


async def test_query_replies_keep_their_order(server):
    """STATS waits for the scheduler and HEALTH does not: one client's replies still come back in order."""
    ctx = zmq.asyncio.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=server.address)
    try:
        for body in (StatsRequest(), HealthRequest(), StatsRequest(), StatsRequest(), HealthRequest()):
            await sock.send_multipart(encode(body))
        kinds = [type(decode_server(await asyncio.wait_for(sock.recv_multipart(), 10))).__name__ for _ in range(5)]
        assert kinds == ["StatsReply", "HealthReply", "StatsReply", "StatsReply", "HealthReply"]
    finally:
        sock.close(0)
        ctx.destroy(0)


async def test_client_that_disappears_leaks_nothing(server, prompts):
    _, ids = prompts
    gone = Client(server.address)
    stream = gone.generate(GenerateRequest("g", prompt_token_ids=ids[7], max_tokens=LIMIT, temperature=0.0,
                                           ignore_eos=True))
    await stream.__anext__()  # it is running
    gone.close()
    c = Client(server.address)
    try:
        await c.wait_idle(10)
        assert "client of request 'g' is gone" in server.log()
    finally:
        await stream.aclose()
        c.close()


async def test_typed_errors_for_bad_requests(server, prompts):
    _, ids = prompts
    ok = dict(prompt_token_ids=ids[0], temperature=0.0, max_tokens=4)
    cases = [  # (fields, code, the field the message starts with)
        (dict(ok, prompt_token_ids=[1] * 600), ErrorCode.PROMPT_TOO_LONG, "prompt_token_ids"),
        (dict(ok, prompt="x"), ErrorCode.INVALID_PARAMS, "prompt"),  # both prompt forms
        (dict(ok, prompt_token_ids=None), ErrorCode.INVALID_PARAMS, "prompt"),  # neither
        (dict(ok, prompt_token_ids=[]), ErrorCode.INVALID_PARAMS, "prompt_token_ids"),
        (dict(ok, prompt_token_ids=[320]), ErrorCode.INVALID_PARAMS, "prompt_token_ids"),
        (dict(ok, max_tokens=0), ErrorCode.INVALID_PARAMS, "max_tokens"),
        (dict(ok, max_tokens=LIMIT + 1), ErrorCode.INVALID_PARAMS, "max_tokens"),
        (dict(ok, temperature=-0.5), ErrorCode.INVALID_PARAMS, "temperature"),
        (dict(ok, temperature=float("nan")), ErrorCode.INVALID_PARAMS, "temperature"),
        (dict(ok, top_p=0.0), ErrorCode.INVALID_PARAMS, "top_p"),
        (dict(ok, top_k=-2), ErrorCode.INVALID_PARAMS, "top_k"),  # -1 is off, as in vLLM
        (dict(ok, seed=-1), ErrorCode.INVALID_PARAMS, "seed"),
        (dict(ok, stop=[""]), ErrorCode.INVALID_PARAMS, "stop"),
        (dict(ok, stop_token_ids=[999]), ErrorCode.INVALID_PARAMS, "stop_token_ids"),
        (dict(ok, num_spec_tokens=17), ErrorCode.INVALID_PARAMS, "num_spec_tokens"),
    ]
    c = Client(server.address)
    try:
        for i, (fields, code, field) in enumerate(cases):
            res = await c.complete(GenerateRequest(f"bad{i}", **fields), 10)
            assert res.error is not None and res.error.code == code, (fields, res)
            assert res.error.request_id == f"bad{i}" and res.error.message.startswith(f"{field}: "), res.error
            assert not res.error.request_continues
        # An empty request id cannot be routed back by id: the error comes without one.
        c.send(GenerateRequest("", **ok))
        for _ in range(100):
            if c.stray:
                break
            await asyncio.sleep(0.02)
        assert isinstance(c.stray[0], Error) and c.stray[0].code == ErrorCode.INVALID_PARAMS
    finally:
        c.close()


async def test_duplicate_request_id(server, prompts, reference):
    _, ids = prompts
    ctx = zmq.asyncio.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=server.address)
    b = Client(server.address)
    try:
        req = GenerateRequest("dup", prompt_token_ids=ids[8], max_tokens=MAX_TOKENS, temperature=0.0)
        await sock.send_multipart(encode(req))
        await sock.send_multipart(encode(req))  # same client, same id, while the first is in flight
        replies = []
        while not replies or not isinstance(replies[-1], Final):
            replies.append(decode_server(await asyncio.wait_for(sock.recv_multipart(), 30)))
        errors = [m for m in replies if isinstance(m, Error)]
        assert [e.code for e in errors] == [ErrorCode.DUPLICATE_REQUEST_ID] and errors[0].request_id == "dup"
        assert errors[0].request_continues  # the request with that id goes on: its tokens follow
        tokens = [t for m in replies if not isinstance(m, Error) for t in m.token_ids]
        assert tokens == expected(reference, 8, MAX_TOKENS)[0]
        elsewhere = await b.complete(req, 30)  # another client may use the same id
        assert elsewhere.token_ids == tokens
    finally:
        sock.close(linger=0)
        ctx.destroy(linger=0)
        b.close()


# ---- fuzzing: raw frames and well-formed messages with bad values -------------------------------------------
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
