"""One `specstep serve` per test module (n-gram speculation on the tiny target), its prompts, and the offline plain
greedy reference it must stream (tests/test_server_e2e.py, tests/test_server_fuzz.py)."""

from __future__ import annotations

import random

import pytest

from specstep.engine.sampling_params import SamplingParams
from specstep.engine.tokenizer import Tokenizer
from specstep.loadgen.server import ServerProcess
from tests.helpers import make_core, run_to_completion

MAX_TOKENS = 24
LIMIT = 400  # --max-tokens-limit; long requests use all of it
REF_TOKENS = 96  # offline reference length


@pytest.fixture(scope="module")
def server(tiny_target):
    # A fixed k: the adaptive policy prices k by wall-clock step costs and need not draft at all on a loaded host,
    # and these tests check that speculation ran through the server.
    srv = ServerProcess(["--model", str(tiny_target), "--spec", "ngram", "--num-spec-tokens", "3", "--device", "cpu",
                         "--spec-policy", "fixed", "--kv-cache-tokens", "4096", "--max-tokens-limit", str(LIMIT)])
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
