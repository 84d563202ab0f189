"""End to end through real sockets and real processes: `specstep serve` (frontend + scheduler process) with
n-gram speculation, many concurrent clients, streamed outputs compared with offline plain greedy decoding."""

from __future__ import annotations

import asyncio
import random

import pytest
import zmq
import zmq.asyncio

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from loadgen.client import Client
from loadgen.server import ServerProcess
from scheduler.protocol import Error, ErrorCode, Final, GenerateRequest, decode_server, encode
from scheduler.sockets import make_socket
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
    cases = [
        (dict(ok, prompt_token_ids=[1] * 600), ErrorCode.PROMPT_TOO_LONG),
        (dict(ok, prompt="x"), ErrorCode.INVALID_PARAMS),  # both prompt forms
        (dict(ok, prompt_token_ids=None), ErrorCode.INVALID_PARAMS),  # neither
        (dict(ok, prompt_token_ids=[]), ErrorCode.INVALID_PARAMS),
        (dict(ok, prompt_token_ids=[320]), ErrorCode.INVALID_PARAMS),
        (dict(ok, max_tokens=0), ErrorCode.INVALID_PARAMS),
        (dict(ok, max_tokens=LIMIT + 1), ErrorCode.INVALID_PARAMS),
        (dict(ok, temperature=-0.5), ErrorCode.INVALID_PARAMS),
        (dict(ok, temperature=float("nan")), ErrorCode.INVALID_PARAMS),
        (dict(ok, top_p=0.0), ErrorCode.INVALID_PARAMS),
        (dict(ok, top_k=-1), ErrorCode.INVALID_PARAMS),
        (dict(ok, seed=-1), ErrorCode.INVALID_PARAMS),
        (dict(ok, stop=[""]), ErrorCode.INVALID_PARAMS),
        (dict(ok, stop_token_ids=[999]), ErrorCode.INVALID_PARAMS),
        (dict(ok, num_spec_tokens=17), ErrorCode.INVALID_PARAMS),
    ]
    c = Client(server.address)
    try:
        for i, (fields, code) in enumerate(cases):
            res = await c.complete(GenerateRequest(f"bad{i}", **fields), 10)
            assert res.error is not None and res.error.code == code, (fields, res)
            assert res.error.request_id == f"bad{i}"
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
        tokens = [t for m in replies if not isinstance(m, Error) for t in m.token_ids]
        assert tokens == expected(reference, 8, MAX_TOKENS)[0]
        elsewhere = await b.complete(req, 30)  # another client may use the same id
        assert elsewhere.token_ids == tokens
    finally:
        sock.close(linger=0)
        ctx.destroy(linger=0)
        b.close()
