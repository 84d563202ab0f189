"""Adaptive speculation end to end on the embedded default models: in one batch, a predictable request (held-out
style code, greedy) keeps speculating while an unpredictable one (random tokens sampled at temperature 1)
stops; the greedy request's output stays token-identical to plain decoding."""

from __future__ import annotations

import random

import pytest

from engine.engine_config import DEFAULT_TARGET, EngineConfig
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from scheduler.build import build_engine
from scheduler.request import Request

pytestmark = pytest.mark.skipif(not (DEFAULT_TARGET / "model.safetensors").is_file(),
                                reason="embedded default models not present")

CODE = 'import os\n\ndef read_config(path):\n    """Read a config file and return a dict."""\n'


def run(spec: str, policy: str):
    tok = Tokenizer.from_folder(DEFAULT_TARGET)
    rng = random.Random(0)
    core, _, _ = build_engine(EngineConfig(spec=spec, num_spec_tokens=4, spec_policy=policy, device="cpu",
                                           kv_cache_tokens=4096))
    reqs = [Request("code", tok.encode(CODE), SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True),
                    seed=1),
            Request("random", [rng.randrange(1, 4096) for _ in range(24)],
                    SamplingParams(temperature=1.0, max_tokens=160, ignore_eos=True), seed=2)]
    for r in reqs:
        core.add_request(r)
    decisions = []
    while core.has_unfinished():
        core.step()
        core.check_integrity()
        if core.last_decision is not None and len(core.running) == 2:
            decisions.append(core.last_decision.num_draft.tolist())
    core.stream.close()
    return reqs, decisions


def test_mixed_batch_speculates_only_where_it_pays():
    (code, rand), decisions = run("ngram", "adaptive")
    (plain_code, _), _ = run("none", "fixed")
    assert code.output_token_ids == plain_code.output_token_ids
    assert len(rand.output_token_ids) == 160
    late = decisions[2 * len(decisions) // 3:]  # once the code settled into its (predictable) pattern
    assert sum(d[0] > 0 for d in late) > 0.7 * len(late), "the predictable request stopped speculating"
    # The unpredictable request drafts only when probed (every `probe_every` steps) once its acceptance collapsed.
    assert sum(d[1] > 0 for d in late) < 0.25 * len(late), "the unpredictable request kept speculating"
    assert code.stats.acceptance_rate > 0.6 > rand.stats.acceptance_rate
