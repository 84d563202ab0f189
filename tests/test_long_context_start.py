"""A long-context checkpoint starts with default flags, at the length its config gives, on `generate` and
`serve`; where one sequence of that length cannot fit, the engine starts at the longest that does and says so
in one warning, and an explicit --max-model-len that cannot fit is a typed error naming the length that would.

The checkpoint: random weights, 128k positions, grouped-query attention (4 query heads over 2 KV heads). Before
the torch backend attended within a workspace, the plan counted a whole-prompt prefill's [128k x 128k] mask
(about 80 GiB) and a decode step's gather over 64 lanes x 128k keys, and refused to start.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from specstep.engine.engine_config import EngineConfig
from specstep.engine.errors import ConfigError
from specstep.loadgen.client import Client
from specstep.loadgen.server import ServerProcess
from specstep.scheduler import build
from specstep.scheduler.build import build_engine
from specstep.scheduler.server.protocol import GenerateRequest
from tests.helpers import make_checkpoint

LONG = 131072


@pytest.fixture(scope="module")
def long_target(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("long") / "t", tokenizer=True, hidden_size=256,
                           num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                           max_position_embeddings=LONG)


def test_generate_starts_with_default_flags_at_the_checkpoint_length(long_target):
    out = subprocess.run([sys.executable, "-m", "specstep.scheduler.cli", "generate", "--model", str(long_target),
                          "--device", "cpu", "--prompt", "abc", "--max-tokens", "4", "--ignore-eos"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "does not fit" not in out.stderr, out.stderr[-3000:]  # no fallback: the checkpoint's whole length


async def test_serve_starts_with_default_flags_and_answers(long_target):
    srv = ServerProcess(["--model", str(long_target), "--device", "cpu"])
    srv.start()
    try:
        c = Client(srv.address)
        final = await c.complete(GenerateRequest("r", prompt_token_ids=[3, 1, 4, 1, 5], max_tokens=6,
                                                 temperature=0.0, ignore_eos=True), 120)
        assert len(final.token_ids) == 6
        assert (await c.health()).max_model_len == LONG
        c.close()
    finally:
        srv.stop()


def test_a_length_that_cannot_fit_starts_at_the_longest_that_does(long_target, caplog, monkeypatch):
    """A host with 2 GiB available (1 GiB planned): a whole-prompt prefill of 128k tokens alone needs more, so the
    checkpoint's length is cut to what fits, with one warning."""
    monkeypatch.setattr(build, "host_ram_available", lambda: 2 << 30)
    small = dict(model=str(long_target), device="cpu")
    with caplog.at_level(logging.WARNING, logger="specstep.build"):
        core, _, info = build_engine(EngineConfig(**small))
    assert info.max_model_len < LONG
    assert info.memory.kv_tokens >= info.max_model_len  # one longest sequence fits
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"{LONG:,}" in warnings[0] and f"{info.max_model_len:,}" in warnings[0]
    assert "--max-model-len" in warnings[0]
    with pytest.raises(ConfigError, match=f"{info.max_model_len:,} would"):
        build_engine(EngineConfig(**small, max_model_len=LONG))
