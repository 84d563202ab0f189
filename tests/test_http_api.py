"""The OpenAI-compatible HTTP API end to end, through the official `openai` client against a real `specstep serve`:
completions and chat, streamed and not, stop strings, token equality with plain greedy decoding and with the ZMQ
path, 16 concurrent streams, typed errors in OpenAI's shape, and clients that go away (their pages freed)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import urllib.request

import openai
import pytest

from specstep.loadgen.client import Client
from specstep.scheduler.server.protocol import GenerateRequest

# ruff: noqa: F811
from tests.http_fixtures import aborted, chat_target, http_server, stats, wait_idle  # noqa: F401
from tests.server_fixtures import LIMIT, MAX_TOKENS, expected, prompts, reference, tokenizer  # noqa: F401
from tests.test_metrics import engine_vs_counters


@pytest.fixture(scope="module")
def client(http_server):
    with openai.OpenAI(base_url=http_server.http_url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def ids_of(obj) -> list[int]:
    return obj.model_extra["token_ids"]


def test_models_health_and_ready_line(http_server, client, chat_target):
    assert [m.id for m in client.models.list().data] == [chat_target.name]
    with urllib.request.urlopen(http_server.http_url + "/health") as r:
        health = json.loads(r.read())
    assert (r.status, health["status"], health["model"], health["address"]) == (200, "ok", chat_target.name,
                                                                                http_server.address)
    ready = next(line for line in http_server.log().splitlines() if line.startswith("specstep serve: ready"))
    assert ready.endswith(f" on {http_server.address} and {http_server.http_url}")


def test_completion_is_plain_greedy_and_the_zmq_paths(http_server, client, prompts, reference, tokenizer,
                                                      chat_target):
    texts, ids = prompts
    r = client.completions.create(model=chat_target.name, prompt=texts[0],
                                  max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True})
    want, reason = expected(reference, 0, MAX_TOKENS)
    choice = r.choices[0]
    assert ids_of(choice) == want and choice.finish_reason == reason
    assert choice.text == tokenizer.decode(want)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids[0]), len(want))
    spec = r.model_extra["specstep"]
    assert spec["drafted_tokens"] >= spec["accepted_tokens"] >= 0 and spec["timings"]["total_s"] > 0

    async def over_zmq():
        c = Client(http_server.address)
        try:
            return await c.complete(GenerateRequest("z", prompt=texts[0], max_tokens=MAX_TOKENS, temperature=0.0), 60)
        finally:
            c.close()

    z = asyncio.run(over_zmq())
    assert z.token_ids == ids_of(choice) and z.text == choice.text


def test_streamed_completion_of_token_ids(client, prompts, reference, tokenizer):
    _, ids = prompts
    chunks = list(client.completions.create(model=None, prompt=ids[6], max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    want, reason = expected(reference, 6, MAX_TOKENS)
    body = [c for c in chunks if c.choices]
    assert [t for c in body for t in ids_of(c.choices[0])] == want
    assert "".join(c.choices[0].text for c in body) == tokenizer.decode(want)
    assert [c.choices[0].finish_reason for c in body] == [None] * (len(body) - 1) + [reason]
    assert "specstep" in body[-1].model_extra and len(body) > 2  # tokens arrive as they are made
    usage = chunks[-1]
    assert usage.choices == [] and (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (len(ids[6]),
                                                                                                  len(want))


async def test_16_concurrent_streams(http_server, prompts, reference, tokenizer):
    texts, ids = prompts
    c = openai.AsyncOpenAI(base_url=http_server.http_url + "/v1", api_key="none", max_retries=0)

    async def one(i: int):
        prompt = texts[i] if i < len(texts) else ids[i]
        stream = await c.completions.create(model=None, prompt=prompt, max_tokens=MAX_TOKENS - i % 3,
                                            temperature=0, stream=True, extra_body={"return_token_ids": True})
        return [chunk async for chunk in stream]

    try:
        results = await asyncio.gather(*[one(i) for i in range(16)])
    finally:
        await c.close()
    for i, chunks in enumerate(results):
        want, reason = expected(reference, i, MAX_TOKENS - i % 3)
        assert [t for ch in chunks for t in ids_of(ch.choices[0])] == want, f"request {i}"
        assert chunks[-1].choices[0].finish_reason == reason
        assert "".join(ch.choices[0].text for ch in chunks) == tokenizer.decode(want)
    await wait_idle(http_server)


def test_stop_strings(client, prompts):
    texts, _ = prompts
    full = client.completions.create(model=None, prompt=texts[1], max_tokens=MAX_TOKENS, temperature=0).choices[0]
    # A stop string from the middle of the greedy text: the reply is cut before its first occurrence.
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    cut = full.text[:full.text.index(stop)]
    r = client.completions.create(model=None, prompt=texts[1], max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    streamed = list(client.completions.create(model=None, prompt=texts[1], max_tokens=MAX_TOKENS, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut and streamed[-1].choices[0].finish_reason == "stop"


def test_chat_renders_the_template_and_streams(client, tokenizer, chat_target):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "You write code."}, {"role": "user", "content": "def fib"}]
    hf = AutoTokenizer.from_pretrained(chat_target)
    hf.eos_token = "<|endoftext|>"  # what the server reads from config.json's eos_token_id
    prompt = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    r = client.chat.completions.create(model=None, messages=messages, max_completion_tokens=12, temperature=0,
                                       extra_body={"return_token_ids": True})
    plain = client.completions.create(model=None, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True})
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert ids_of(r.choices[0]) == ids_of(plain.choices[0])
    assert (r.choices[0].message.role, r.choices[0].message.content) == ("assistant", plain.choices[0].text)
    chunks = list(client.chat.completions.create(model=None, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_errors_in_openais_shape(http_server, client, prompts):
    def refused(kind, **kw):
        with pytest.raises(kind) as e:
            client.completions.create(**{"model": None, "prompt": "x", **kw})
        return e.value

    e = refused(openai.BadRequestError, n=2)
    assert (e.status_code, e.param, e.code) == (400, "n", "invalid_params") and "send 2 requests" in e.message
    e = refused(openai.NotFoundError, model="gpt-4")
    assert (e.status_code, e.param, e.code) == (404, "model", "model_not_found")
    e = refused(openai.BadRequestError, prompt=[1] * 600)
    assert (e.param, e.code) == ("prompt_token_ids", "context_length_exceeded")
    e = refused(openai.BadRequestError, logprobs=2)
    assert e.param == "logprobs"
    e = refused(openai.BadRequestError, max_tokens="many")
    assert (e.param, e.code) == ("max_tokens", "malformed")
    e = refused(openai.BadRequestError, top_p=0.0)
    assert e.param == "top_p" and e.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=None, messages=[{"role": "assistant", "content": "hi"}])
    assert chat.value.param == "messages" and "must not be the assistant" in chat.value.message
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=None, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=LIMIT + 1)
    assert chat.value.param == "max_completion_tokens"

    # The same validation as the ZMQ path: the same message for the same bad value.
    async def over_zmq():
        c = Client(http_server.address)
        try:
            return await c.complete(GenerateRequest("bad", prompt="x", temperature=-1.0), 60)
        finally:
            c.close()

    z = asyncio.run(over_zmq())
    e = refused(openai.BadRequestError, temperature=-1)
    assert e.param == "temperature" and e.body["message"] == z.error.message


# A long request (one token a step: no drafts) that a client leaves: the scheduler must stop it long before its end.
LONG = {"ignore_eos": True, "num_spec_tokens": 0}


async def test_a_client_gone_mid_stream_aborts_its_request(http_server):
    before = await stats(http_server)
    c = openai.AsyncOpenAI(base_url=http_server.http_url + "/v1", api_key="none", max_retries=0)
    try:
        stream = await c.completions.create(model=None, prompt="def f(x):", max_tokens=LIMIT, temperature=0,
                                            stream=True, extra_body=LONG)
        first = await stream.__anext__()
        assert first.choices[0].finish_reason is None
        await stream.close()  # mid-stream: the connection goes
    finally:
        await c.close()
    idle = await wait_idle(http_server)  # every page free, integrity checked
    assert aborted(idle) == aborted(before) + 1
    engine, counters = engine_vs_counters(idle.engine, idle.metrics)
    assert engine == counters  # the scheduler's finished and the counters' requests: one each
    assert idle.engine.num_output_tokens - before.engine.num_output_tokens < LIMIT  # stopped, not run to its end


async def test_a_client_gone_while_waiting_aborts_its_request(http_server):
    """Not streaming: nothing is sent until the end, so only the closed connection tells the server."""
    before = await stats(http_server)
    host, port = http_server.http_url.removeprefix("http://").split(":")
    body = b'{"prompt": "def f(x):", "max_tokens": %d, "ignore_eos": true, "num_spec_tokens": 0}' % LIMIT
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    while (await stats(http_server)).engine.num_running == 0:  # until the scheduler runs it
        await asyncio.sleep(0.01)
    writer.close()
    idle = await wait_idle(http_server)
    assert aborted(idle) == aborted(before) + 1
    engine, counters = engine_vs_counters(idle.engine, idle.metrics)
    assert engine == counters
    assert idle.engine.num_output_tokens - before.engine.num_output_tokens < LIMIT


async def test_sse_framing_on_the_wire(http_server):
    """Raw HTTP/1.0 (no chunked encoding to undo): the headers, then `data: {json}` events each ended by a blank
    line, and `data: [DONE]` last."""
    host, port = http_server.http_url.removeprefix("http://").split(":")
    body = b'{"prompt": "import os", "max_tokens": 6, "temperature": 0, "stream": true, "ignore_eos": true}'
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    raw = await reader.read()  # the server closes an HTTP/1.0 stream at its end
    writer.close()
    head, _, events = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0].startswith("HTTP/1.") and lines[0].split()[1] == "200"
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    assert headers["content-type"].startswith("text/event-stream")
    assert events.endswith(b"\n\ndata: [DONE]\n\n")
    frames = events.split(b"\n\n")
    assert frames[-1] == b"" and frames[-2] == b"data: [DONE]"
    chunks = [json.loads(f.removeprefix(b"data: ")) for f in frames[:-2]]
    assert all(f.startswith(b"data: {") for f in frames[:-2]) and len(chunks) >= 2
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert chunks[-1]["specstep"]["timings"]["total_s"] > 0


def test_loadgen_measures_both_apis_side_by_side(http_server, chat_target, tmp_path):
    before = aborted(asyncio.run(stats(http_server)))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "specstep.scheduler.cli", "loadgen", "--model", str(chat_target),
           "--address", http_server.address, "--url", f"specstep={http_server.http_url}", "--concurrency", "1,3",
           "--num-requests", "4", "--prompt-tokens", "16", "--max-tokens", "8", "--warmup", "1",
           "--output-dir", str(out), "--no-plots", "--quiet"]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "results.json").read_text())
    assert list(data["settings"]) == ["zmq", "specstep"]
    for name, s in data["settings"].items():
        assert [p["label"] for p in s["points"]] == ["c=1", "c=3"]
        for p in s["points"]:
            assert p["num_ok"] == p["num_requests"] == 4 and p["errors"] == {}, (name, p)
            assert p["output_tokens"] == 4 * 8 and p["output_tokens_per_s"] > 0
            assert p["ttft_p50_ms"] > 0 and p["itl_p99_ms"] >= p["itl_p50_ms"] > 0
            assert p["server_queue_p50_ms"] is not None  # the `specstep` field's timings came back over HTTP
    assert data["settings"]["specstep"]["health"]["model"] == chat_target.name
    assert aborted(asyncio.run(stats(http_server))) == before  # every request ran to its end


def test_a_taken_port_is_a_clear_error(tiny_target):
    """Checked before the scheduler starts: the server exits at once and says what to do."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "specstep.scheduler.cli", "serve", "--model", str(tiny_target),
                               "--device", "cpu", "--address", "tcp://127.0.0.1:0", "--metrics-port", "-1",
                               "--http-port", str(port)], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    assert proc.returncode == 2
    assert f"error: HTTP on 127.0.0.1:{port}: " in proc.stdout and "--http-port 0 picks a free port" in proc.stdout
    assert "scheduler" not in proc.stdout + proc.stderr  # nothing was started


def test_loadgen_starts_a_server_and_measures_it_over_both_apis(tiny_target, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "specstep.scheduler.cli", "loadgen", "--model", str(tiny_target), "--setting", "off",
           "--api", "both", "--server-args", "--device cpu --kv-cache-tokens 4096 --metrics-port -1",
           "--concurrency", "2", "--num-requests", "2", "--prompt-tokens", "16", "--max-tokens", "4", "--warmup", "0",
           "--output-dir", str(out), "--no-plots", "--quiet"]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "results.json").read_text())
    assert list(data["settings"]) == ["off/zmq", "off/openai"]
    for s in data["settings"].values():
        assert s["health"]["spec"] == "none" and s["serve_args"][-2:] == ["--spec", "none"]
        (p,) = s["points"]
        assert (p["num_ok"], p["output_tokens"], p["errors"]) == (2, 8, {})


def test_loadgen_over_http_to_a_server_without_it_says_so_and_stops_it(tiny_target, tmp_path):
    cmd = [sys.executable, "-m", "specstep.scheduler.cli", "loadgen", "--model", str(tiny_target), "--setting",
           "nohttp=--spec none --http-port -1", "--api", "openai", "--server-args", "--device cpu --metrics-port -1",
           "--concurrency", "1", "--num-requests", "1", "--output-dir", str(tmp_path), "--no-plots", "--quiet"]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "nohttp: the server serves no HTTP API" in proc.stdout + proc.stderr
    scheduler = int(re.search(r"scheduler process 1 ready \(pid (\d+)\)", (tmp_path / "server-nohttp.log")
                              .read_text())[1])
    with pytest.raises(ProcessLookupError):  # stopped, not left running
        os.kill(scheduler, 0)
