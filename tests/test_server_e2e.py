"""End to end through real sockets and real processes: `specstep serve` (frontend + scheduler process) with
n-gram speculation, many concurrent clients, streamed outputs compared with offline plain greedy decoding;
aborts, vanished clients, typed errors. One server for the whole module (tests/server_fixtures.py); the fuzzing
of raw frames and bad values is in tests/test_server_fuzz.py."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from specstep.loadgen.client import Client
from specstep.scheduler.server.protocol import (
    AbortRequest,
    Error,
    ErrorCode,
    Final,
    GenerateRequest,
    HealthRequest,
    StatsRequest,
    decode_server,
    encode,
)
from specstep.scheduler.server.sockets import make_socket

# The shared fixtures are imported by name (pytest finds them in the module); tests take them as
# arguments, which ruff reads as redefinitions.
# ruff: noqa: F811
from tests.server_fixtures import (  # noqa: F401
    LIMIT,
    MAX_TOKENS,
    REF_TOKENS,
    expected,
    prompts,
    reference,
    server,
    tokenizer,
)


async def test_health(server):
    c = Client(server.address)
    try:
        h = await c.health()
        assert (h.protocol_version, h.status, h.spec, h.vocab_size, h.max_tokens) == (1, "ok", "ngram", 320, LIMIT)
        assert h.max_prompt_len == h.max_model_len - 1 == 511
        assert h.address == server.address and not h.address.endswith(":0")  # started on port 0
        ready = next(line for line in server.log().splitlines() if line.startswith("specstep serve: ready"))
        assert ready.endswith(f" on {server.address}")
        assert "; chunked prefill " in ready and "calibrated" in ready  # serve's default: a budget timed at start
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
        # A stream's outputs that pile up before the frontend reads them merge into one message: a request whose
        # tokens all arrive at once gets its Final alone, so only "no deltas without streaming" is certain.
        assert req.stream or res.num_deltas == 0
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
        # (the adaptive governor may have turned speculation off by now: its off steps count too)
        assert all(s.spec_steps + s.steps_off > 0 for s in (whole.final.spec, res.final.spec))
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
