"""One `specstep serve` with its HTTP API on a free port per test module (n-gram speculation on the tiny target,
given a chat template), its clients, and the ZMQ STATS helpers that check what the scheduler holds."""

from __future__ import annotations

import json
import shutil

import pytest

from specstep.loadgen.client import Client
from specstep.loadgen.server import ServerProcess
from tests.server_fixtures import LIMIT

# The tiny tokenizer has one special token, <|endoftext|> (id 0, the model's eos): the template reaches it
# through `eos_token`, which comes from config.json's eos_token_id since tokenizer_config.json names none.
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('the first message must not be the "
    "assistant') }}{% endif %}"
    "{% for m in messages %}{{ '### ' + m['role'] + ':\n' + m['content'] + eos_token + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant:\n' }}{% endif %}")


@pytest.fixture(scope="module")
def chat_target(tiny_target, tmp_path_factory):
    """The tiny target (same weights, so the same reference) with a chat template in tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(tiny_target, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def http_server(chat_target):
    srv = ServerProcess(["--model", str(chat_target), "--spec", "ngram", "--num-spec-tokens", "3", "--device", "cpu",
                         "--kv-cache-tokens", "4096", "--max-tokens-limit", str(LIMIT), "--metrics-port", "-1"],
                        http=True)
    srv.start()
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


async def stats(server):
    c = Client(server.address)
    try:
        return await c.stats()
    finally:
        c.close()


async def wait_idle(server):
    """Until the scheduler holds no request and every KV page is free (raises on an integrity failure)."""
    c = Client(server.address)
    try:
        return await c.wait_idle(60)
    finally:
        c.close()


def aborted(stats_reply) -> float:
    return stats_reply.metrics.get('specstep_requests_total{finish_reason="abort"}', 0.0)
