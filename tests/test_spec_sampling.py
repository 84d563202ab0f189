"""Speculative sampling is lossless, end to end: on a 12-token vocabulary, the generated tokens 2-4 (the ones
speculative steps produce) follow exactly the target's distribution, computed by enumerating every continuation
with transformers' implementation of the target. N requests with different seeds run in one batch; the counts
of the 12^3 outcomes are chi-square tested at level ALPHA (pooling cells with expected count < 5), and outcomes
of probability zero under top-k / top-p must never occur."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from specstep.engine.proposers.draft_vocab import write_draft_vocab
from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler import build
from tests.fixtures_models import hf_model, make_mtp_head, make_perturbed_copy
from tests.fixtures_stats import assert_distribution, chi2_gof, reference_probs
from tests.helpers import ScriptedPolicy, make_checkpoint, make_core, run_to_completion

ALPHA = 1e-4  # false-failure rate of each test below
V = 12
N = 4000
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
NEW = 4  # tokens per request; with k = 3 the first speculative step drafts 2 (capped by max_tokens), then fewer
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             initializer_range=0.2, eos_token_id=None, bos_token_id=None)  # a wide init: peaked distributions


def with_draft_vocab(folder, size: int, seed: int):
    """The drafter folder with a reduced draft vocabulary of `size` of the V tokens (drawn at random)."""
    counts = torch.randperm(V, generator=torch.Generator().manual_seed(seed)).float()
    write_draft_vocab(folder, counts, size)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("v12")
    target = make_checkpoint(tmp / "target", seed=0, **SMALL)
    return {
        # Reduced draft vocabularies (5 of 12 tokens): q is zero outside them, and the output must not notice.
        "perturbed-reduced": ("draft_model", with_draft_vocab(
            make_perturbed_copy(tmp / "perturbed-reduced", target, 0.05), 5, seed=1)),
        "mtp-reduced": ("mtp", with_draft_vocab(make_mtp_head(tmp / "head-reduced", target, std=0.3), 5, seed=2)),
        "target": target,
        "self": ("draft_model", target),
        "perturbed": ("draft_model", make_perturbed_copy(tmp / "perturbed", target, 0.05)),
        "bad": ("draft_model", make_checkpoint(tmp / "bad", seed=5, **{**SMALL, "num_hidden_layers": 1})),
        "ngram": ("ngram", None),
        "mtp": ("mtp", make_mtp_head(tmp / "head", target, std=0.3)),
        "plain": ("none", None),
    }


@torch.inference_mode()
def exact_distribution(folder, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """P(t1, t2, t3, t4 | PROMPT) [V, V, V, V] under the processed distribution, by enumeration."""
    hf = hf_model(folder)
    cont = torch.tensor(list(itertools.product(range(V), repeat=3)))  # [V^3, 3], row = (a * V + b) * V + c
    ids = torch.cat([torch.tensor(PROMPT).expand(len(cont), -1), cont], dim=1)
    logits = hf(ids).logits[:, len(PROMPT) - 1:].double().numpy()  # [V^3, 4, V]
    p = [reference_probs(logits[:, j], temperature, top_k, top_p) for j in range(4)]
    p1 = p[0][0]  # [V]
    p2 = p[1][:: V * V]  # [V(a), V]
    p3 = p[2][::V].reshape(V, V, V)  # [a, b, V]
    p4 = p[3].reshape(V, V, V, V)
    return p1[:, None, None, None] * p2[:, :, None, None] * p3[:, :, :, None] * p4


def generate(models, proposer: str, params: list[SamplingParams], k: int = 3, spec_policy: str = "fixed",
             policy=None, max_num_batched_tokens: int | None = None, tensor_parallel_size: int = 1) -> np.ndarray:
    spec, draft = models[proposer]
    # A scripted policy runs inline: with overlap a chained step's decision may be re-made after a drain.
    core = make_core(models["target"], spec=spec, draft=None if draft is None else str(draft), num_spec_tokens=k,
                     page_size=16, max_batch_size=len(params), kv_cache_tokens=32 * len(params) + 64,
                     spec_policy=spec_policy, overlap=policy is None,
                     max_num_batched_tokens=max_num_batched_tokens, tensor_parallel_size=tensor_parallel_size)
    if policy is not None:
        core.policy = policy
    reqs = run_to_completion(core, [PROMPT] * len(params), params, seeds=list(range(len(params))),
                             check_every_step=False)
    core.close()
    if proposer not in ("plain", "ngram"):
        assert sum(r.stats.drafted for r in reqs) > 0
    return np.array([r.output_token_ids for r in reqs])


SETTINGS = {  # name: (proposer, temperature, top_k, top_p)
    "plain-T1": ("plain", 1.0, 0, 1.0),
    "self-T1": ("self", 1.0, 0, 1.0),
    "perturbed-T1": ("perturbed", 1.0, 0, 1.0),
    "bad-T1": ("bad", 1.0, 0, 1.0),
    "ngram-T1": ("ngram", 1.0, 0, 1.0),
    "mtp-T1": ("mtp", 1.0, 0, 1.0),
    "perturbed-topk": ("perturbed", 0.8, 4, 1.0),
    "bad-topk": ("bad", 0.8, 4, 1.0),
    "bad-topp": ("bad", 1.0, 0, 0.8),
    "mtp-topp": ("mtp", 1.2, 0, 0.8),
    "ngram-topk-topp": ("ngram", 1.0, 6, 0.9),
    "perturbed-reduced-T1": ("perturbed-reduced", 1.0, 0, 1.0),
    "mtp-reduced-T1": ("mtp-reduced", 1.0, 0, 1.0),
    "mtp-reduced-topk": ("mtp-reduced", 0.8, 4, 1.0),
}


@pytest.fixture(scope="module")
def exact(models):
    cache = {}

    def get(temperature, top_k, top_p):
        key = (temperature, top_k, top_p)
        if key not in cache:
            cache[key] = exact_distribution(models["target"], *key)
        return cache[key]

    return get


def counts_of(outputs: np.ndarray) -> np.ndarray:
    """Counts of (t2, t3, t4) over V^3 cells."""
    idx = (outputs[:, 1] * V + outputs[:, 2]) * V + outputs[:, 3]
    return np.bincount(idx, minlength=V ** 3)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_speculative_sampling_matches_target_distribution(models, exact, setting):
    proposer, temperature, top_k, top_p = SETTINGS[setting]
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=NEW, ignore_eos=True)]
    outputs = generate(models, proposer, params * N)
    joint = exact(temperature, top_k, top_p)
    assert_distribution(np.bincount(outputs[:, 0], minlength=V), joint.sum(axis=(1, 2, 3)), ALPHA, "t1")
    assert_distribution(counts_of(outputs), joint.sum(axis=0).ravel(), ALPHA, f"{setting}: (t2, t3, t4)")


@pytest.mark.parametrize("proposer", ["perturbed", "mtp"])
def test_tensor_parallel_keeps_the_distribution(models, exact, proposer):
    """At tensor-parallel size 2: the draft model on the leader (its acceptance broadcast), the MTP head split."""
    params = [SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True)]
    outputs = generate(models, proposer, params * N, tensor_parallel_size=2)
    joint = exact(1.0, 0, 1.0)
    assert_distribution(counts_of(outputs), joint.sum(axis=0).ravel(), ALPHA, f"tp2 {proposer}: (t2, t3, t4)")


@pytest.mark.parametrize("proposer", ["perturbed", "mtp", "ngram"])
def test_adaptive_policy_keeps_the_distribution(models, exact, proposer, monkeypatch):
    """Whatever the adaptive policy decides (exploring each k, dropping the refill, probing), the output
    follows the target's distribution. Plain is measured once per bucket here, not three times: each request
    runs four tokens in one batch, and three plain samples would leave no step to speculate in."""
    real = build.policy_config
    monkeypatch.setattr(build, "policy_config",
                        lambda *a, **kw: dataclasses.replace(real(*a, **kw), plain_samples=1))
    params = [SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True)]
    outputs = generate(models, proposer, params * N, spec_policy="adaptive")
    joint = exact(1.0, 0, 1.0)
    assert_distribution(counts_of(outputs), joint.sum(axis=0).ravel(), ALPHA, f"adaptive {proposer}")


@pytest.mark.parametrize("proposer", ["perturbed", "mtp"])
def test_refill_drop_and_catch_up_keep_the_distribution(models, exact, proposer):
    """A plain step without refill, then a catch-up and a speculative step: tokens 3-4 come from a proposer
    that caught up (MTP: from the kept target hidden states)."""
    params = [SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True)]
    outputs = generate(models, proposer, params * N, policy=ScriptedPolicy(3, [False, True], off_refill=False))
    joint = exact(1.0, 0, 1.0)
    assert_distribution(counts_of(outputs), joint.sum(axis=0).ravel(), ALPHA, f"catch-up {proposer}")


@pytest.mark.parametrize("proposer", ["perturbed", "mtp"])
def test_chunked_prefill_keeps_the_distribution(models, exact, proposer):
    """Prompts prefilled in chunks (a budget of N + 7 tokens: chunk ends inside prompts) beside requests that
    decode one plainly sampled token per mixed step, the rest speculative: still the target's distribution."""
    params = [SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True)]
    outputs = generate(models, proposer, params * N, max_num_batched_tokens=N + 7)
    joint = exact(1.0, 0, 1.0)
    assert_distribution(np.bincount(outputs[:, 0], minlength=V), joint.sum(axis=(1, 2, 3)), ALPHA, "t1")
    assert_distribution(counts_of(outputs), joint.sum(axis=0).ravel(), ALPHA, f"chunked {proposer}")


def test_greedy_and_sampled_rows_in_one_batch(models, exact):
    """Greedy rows take the greedy path, sampled rows still follow p, in the same speculative batches."""
    sampled = SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    params = [greedy if i % 4 == 0 else sampled for i in range(N)]
    outputs = generate(models, "bad", params)
    g = outputs[0::4]
    assert (g == g[0]).all()
    plain_greedy = generate(models, "plain", [greedy])[0]
    assert g[0].tolist() == plain_greedy.tolist()
    rows = np.array([i % 4 != 0 for i in range(N)])
    assert_distribution(counts_of(outputs[rows]), exact(1.0, 0, 1.0).sum(axis=0).ravel(), ALPHA, "sampled rows")


def test_the_check_would_catch_the_bad_drafts_distribution(models, exact):
    """Power: had speculation emitted the bad draft's own distribution, the same test would reject it."""
    p = exact(1.0, 0, 1.0).sum(axis=0).ravel()
    q = exact_distribution(models["bad"][1], 1.0, 0, 1.0).sum(axis=0).ravel()
    _, df, pval = chi2_gof(np.round(q * N), p)
    assert pval < 1e-12, (df, pval)
