"""Speculative decoding through the whole engine: greedy output equals plain greedy output for every proposer,
batch size, k and page size; acceptance statistics are exact on constructed drafts; after any mix of accepts and
rejects the target's and the draft's KV caches equal a fresh prefill of the same tokens."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specstep.engine.batch_builder import build_forward_batch
from specstep.engine.kv_cache import KVPool
from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler.core.request import Request
from specstep.scheduler.spec.counters import SpecCounters
from tests.fixtures_models import fragment, make_mtp_head, make_permuted_draft, make_perturbed_copy
from tests.helpers import make_checkpoint, make_core, run_to_completion

PROMPT_LENS = [1, 2, 3, 5, 7, 8, 9, 12, 15, 16, 17, 20, 24, 31, 33, 40]
BATCHES = {1: [13], 5: [0, 4, 9, 12, 15], 16: list(range(16))}
PROPOSERS = ["draft_random", "draft_self", "ngram", "mtp"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def drafts(tiny_target, tiny_draft, tmp_path_factory):
    """proposer name -> (--spec, --draft)."""
    tmp = tmp_path_factory.mktemp("spec")
    return {
        "draft_random": ("draft_model", tiny_draft),  # random weights: acceptance ~ 0
        "draft_self": ("draft_model", tiny_target),  # the target as its own draft: acceptance exactly 1
        "draft_wrong": ("draft_model", make_permuted_draft(tmp / "wrong", tiny_target)),  # argmax never right
        "draft_perturbed": ("draft_model", make_perturbed_copy(tmp / "perturbed", tiny_target, 0.5)),
        "ngram": ("ngram", None),
        "mtp": ("mtp", make_mtp_head(tmp / "head", tiny_target)),
    }


def spec_core(target, drafts, proposer: str, **cfg):
    spec, draft = drafts[proposer]
    return make_core(target, spec=spec, draft=None if draft is None else str(draft), **cfg)


def make_prompts(vocab: int = 320) -> list[list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]
    prompts[5] = [7, 8, 9, 10] * 2  # repetitive prompts give the n-gram proposer something to find
    prompts[11] = [1, 2, 3, 4, 5] * 4
    return prompts


@pytest.fixture(scope="module")
def matrix(tiny_target):
    """Prompts, per-request params (different max_tokens; stop tokens taken from the plain output so requests
    finish at different steps for different reasons) and the plain greedy reference per page size."""
    prompts = make_prompts()
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    base = [r.output_token_ids for r in run_to_completion(make_core(tiny_target), prompts, greedy)]
    params, expected = [], []
    for i, out in enumerate(base):
        max_tokens = MAX_TOKENS - (i * 7) % 17
        stop = (out[2 + i % 6],) if i % 3 == 1 else ()
        params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop, ignore_eos=True))
        n = min(out.index(stop[0]) + 1, max_tokens) if stop else max_tokens
        reason = "stop" if stop and out.index(stop[0]) < max_tokens else "length"
        expected.append((out[:n], reason))
    assert {r for _, r in expected} == {"stop", "length"}
    assert len({len(t) for t, _ in expected}) >= 6
    refs = {}
    for page_size in (1, 16):
        reqs = run_to_completion(make_core(tiny_target, page_size=page_size), prompts, params)
        refs[page_size] = [(r.output_token_ids, r.finish_reason.value) for r in reqs]
        assert refs[page_size] == expected
    return prompts, params, refs


def check_against_plain(reqs, idx, ref, proposer):
    for i, r in zip(idx, reqs):
        assert (r.output_token_ids, r.finish_reason.value) == ref[i], f"request {i} differs from plain greedy"
    drafted = sum(r.stats.drafted for r in reqs)
    accepted = sum(r.stats.accepted for r in reqs)
    if proposer != "ngram":
        assert drafted > 0, "nothing was speculated"
    if proposer == "draft_self":
        assert accepted == drafted, f"the target as its own draft accepted {accepted}/{drafted}"
    if proposer == "draft_random":
        assert accepted <= 0.1 * drafted
    return drafted, accepted


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_equals_plain(tiny_target, drafts, matrix, proposer, batch, k, page_size):
    prompts, params, refs = matrix
    core = spec_core(tiny_target, drafts, proposer, num_spec_tokens=k, page_size=page_size)
    fragment(core.allocator, seed=k)
    idx = BATCHES[batch]
    reqs = run_to_completion(core, [prompts[i] for i in idx], [params[i] for i in idx])
    check_against_plain(reqs, idx, refs[page_size], proposer)


@pytest.mark.parametrize("policy,overlap", [("fixed", False), ("adaptive", True)])
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_equals_plain_without_overlap_and_with_adaptive_k(tiny_target, drafts, matrix, proposer, policy,
                                                                 overlap):
    """The synchronous loop, and the adaptive policy (which varies k per request, switches speculation off and
    on, and may drop and catch up the draft's refill)."""
    prompts, params, refs = matrix
    core = spec_core(tiny_target, drafts, proposer, num_spec_tokens=4, page_size=16, overlap=overlap,
                     spec_policy=policy)
    reqs = run_to_completion(core, prompts, params)
    check_against_plain(reqs, range(16), refs[16], proposer)


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    """A 16-token target where random proposers are right often enough to exercise accepts and rejects."""
    tmp = tmp_path_factory.mktemp("v16")
    target = make_checkpoint(tmp / "target", seed=3, vocab_size=16)
    return {"target": target, "draft_random": ("draft_model", make_checkpoint(tmp / "draft", seed=4, vocab_size=16,
                                                                              num_hidden_layers=1)),
            "mtp": ("mtp", make_mtp_head(tmp / "head", target, seed=1)), "ngram": ("ngram", None)}


@pytest.mark.parametrize("proposer", ["draft_random", "mtp", "ngram"])
def test_greedy_equals_plain_with_partial_acceptance(tiny_vocab, proposer):
    rng = random.Random(1)
    prompts = [[rng.randrange(16) for _ in range(n)] for n in (1, 6, 13, 30, 4)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain = run_to_completion(make_core(tiny_vocab["target"], page_size=4), prompts, params)
    core = spec_core(tiny_vocab["target"], tiny_vocab, proposer, num_spec_tokens=3, page_size=4)
    reqs = run_to_completion(core, prompts, params)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in plain]
    drafted, accepted = sum(r.stats.drafted for r in reqs), sum(r.stats.accepted for r in reqs)
    assert 0 < accepted < drafted


# ---- acceptance statistics on constructed drafts ----------------------------------------------------------


def expected_stats(max_tokens: int, k: int, always_accept: bool) -> SpecCounters:
    """What the synchronous loop must record: the prefill emits one token, then every step drafts
    min(k, tokens left - 1) (the last token of a request is always a bonus/corrected token, never a draft)."""
    s = SpecCounters()
    left = max_tokens - 1
    while left > 0:
        nd = min(k, left - 1)
        a = nd if always_accept else 0
        s.record(nd, a)
        left -= a + 1
    return s


def assert_stats(got: SpecCounters, want: SpecCounters) -> None:
    fields = ("steps", "drafted", "accepted", "drafted_per_position", "accepted_per_position")
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
    assert got.to_dict() == want.to_dict()


MAX_TOKENS_CASES = [1, 2, 3, 4, 7, 11, 16]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_stats_exact_when_draft_always_right(tiny_target, drafts, k):
    prompts = make_prompts()[:len(MAX_TOKENS_CASES)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS_CASES]
    core = spec_core(tiny_target, drafts, "draft_self", num_spec_tokens=k, overlap=False)
    reqs = run_to_completion(core, prompts, params)
    for r, m in zip(reqs, MAX_TOKENS_CASES):
        want = expected_stats(m, k, always_accept=True)
        assert_stats(r.stats, want)
        if want.steps:
            assert r.stats.acceptance_rate == 1.0
        if (m - 1) % (k + 1) == 0:  # no truncated final step: every step emitted k + 1 tokens
            assert r.stats.mean_accepted_length == (k + 1 if m > 1 else 0.0)


def test_stats_always_right_when_sampling_too(tiny_target, drafts):
    """With q == p (the target drafting for itself) the acceptance probability min(1, p/q) is 1."""
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=16, ignore_eos=True)
    core = spec_core(tiny_target, drafts, "draft_self", num_spec_tokens=3, overlap=False)
    reqs = run_to_completion(core, make_prompts()[:6], params, seeds=list(range(6)))
    for r in reqs:
        assert_stats(r.stats, expected_stats(16, 3, always_accept=True))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_stats_exact_when_draft_always_wrong(tiny_target, drafts, matrix, k, overlap):
    """lm_head rows rotated: the draft's first token is never the target's argmax, so nothing is accepted,
    every step emits exactly the target's token, and the output is still plain greedy."""
    prompts = make_prompts()[:len(MAX_TOKENS_CASES)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS_CASES]
    plain = run_to_completion(make_core(tiny_target), prompts, params)
    core = spec_core(tiny_target, drafts, "draft_wrong", num_spec_tokens=k, overlap=overlap)
    reqs = run_to_completion(core, prompts, params)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in plain]
    for r, m in zip(reqs, MAX_TOKENS_CASES):
        assert r.stats.accepted == 0 and r.stats.accepted_per_position == [0] * len(r.stats.drafted_per_position)
        if not overlap:  # with overlap, step N+1 is planned for the upper bound of step N's output
            assert_stats(r.stats, expected_stats(m, k, always_accept=False))
        elif m > 2:
            assert r.stats.steps > 0
        if r.stats.steps:
            assert r.stats.mean_accepted_length == 1.0 and r.stats.acceptance_rate == 0.0


def test_spec_stats_record_first_j_right():
    s = SpecCounters()
    for nd, a in [(3, 1), (5, 5), (0, 0), (2, 0), (4, 2)]:
        s.record(nd, a)
    assert (s.steps, s.drafted, s.accepted) == (4, 14, 8)
    assert s.drafted_per_position == [4, 4, 3, 2, 1]
    assert s.accepted_per_position == [3, 2, 1, 1, 1]
    assert s.mean_accepted_length == 1 + 8 / 4 and s.acceptance_rate == 8 / 14
    d = s.to_dict()
    assert d["acceptance_per_position"] == [0.75, 0.5, round(1 / 3, 4), 0.5, 1.0]
    assert (d["drafted_tokens"], d["accepted_tokens"], d["spec_steps"]) == (14, 8, 4)
    assert SpecCounters().to_dict()["mean_accepted_length"] == 0.0


# ---- KV consistency ----------------------------------------------------------------------------------------


def slots_of(table: list[int], n: int, page_size: int) -> torch.Tensor:
    return torch.tensor([table[p // page_size] * page_size + p % page_size for p in range(n)], dtype=torch.long)


def fresh_prefill(model, ids: list[int], page_size: int, hidden_in=None, embed=None):
    """Run `ids` from position 0 into a fresh pool; returns (pool, slots, output hidden states)."""
    pool = KVPool(model.cfg, len(model.layers), -(-len(ids) // page_size) + 1, page_size, torch.float32, "cpu")
    table = list(range(1, pool.num_pages))
    fb = build_forward_batch([ids], [0], [table], page_size, "cpu")
    hidden = model(fb, pool) if hidden_in is None else model(fb, pool, embed(fb.input_ids), hidden_in)
    return pool, slots_of(table, len(ids), page_size), hidden


def assert_kv_equal(pool, table, ref_pool, ref_slots, what: str) -> None:
    slots = slots_of(table, len(ref_slots), pool.page_size)
    for layer in range(len(pool.k)):
        for name, a, b in (("K", pool.k[layer], ref_pool.k[layer]), ("V", pool.v[layer], ref_pool.v[layer])):
            torch.testing.assert_close(a[slots], b[ref_slots], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name, lay=layer: f"{what} {n} layer {lay}: {m}")


# (proposer, temperature, page size, whether this run both accepts and rejects drafts)
KV_CASES = [("draft_perturbed", 0.0, 1, True), ("draft_perturbed", 1.0, 16, True), ("draft_random", 1.0, 4, True),
            ("ngram", 0.0, 16, True), ("ngram", 1.0, 1, False), ("mtp", 0.0, 16, False), ("mtp", 1.0, 1, True),
            ("draft_self", 1.0, 16, False)]


@pytest.mark.parametrize(("proposer", "temperature", "page_size", "mixed"), KV_CASES)
@torch.inference_mode()
def test_caches_equal_a_fresh_prefill(tiny_target, drafts, proposer, temperature, page_size, mixed):
    """Stop mid-generation after a mix of accepts and rejects; every running request's target KV (positions
    [0, num_computed)), draft KV and carried draft logits equal those of a fresh prefill of its tokens, and the
    target's next-token logits from the running cache equal the fresh ones."""
    core = spec_core(tiny_target, drafts, proposer, num_spec_tokens=3, page_size=page_size, overlap=False)
    fragment(core.allocator, seed=2)
    prompts = [p for p in make_prompts() if 3 <= len(p) <= 33][:6]
    params = SamplingParams(temperature=temperature, max_tokens=60, ignore_eos=True)
    reqs = [Request(str(i), p, params, seed=i) for i, p in enumerate(prompts)]
    for r in reqs:
        core.add_request(r)
    for _ in range(9):
        core.step()
        core.check_integrity()
    assert core.inflight is None and len(core.running) == len(reqs)
    drafted, accepted = sum(r.stats.drafted for r in reqs), sum(r.stats.accepted for r in reqs)
    print(f"accepted {accepted} of {drafted} drafts")
    assert drafted > 0
    if mixed:
        assert 0 < accepted < drafted, (accepted, drafted)

    eng = core.engine
    target, pool, prop = eng.target, eng.pool, eng.proposer
    for r in reqs:
        n = r.num_computed
        assert n == len(r.token_ids) - 1
        ref_pool, ref_slots, ref_hidden = fresh_prefill(target, r.token_ids, page_size)
        n_slots = ref_slots[:n]
        assert_kv_equal(pool, r.page_table, ref_pool, n_slots, f"request {r.request_id} target")
        # next step from the running cache: the last token at position n
        fb = build_forward_batch([[r.token_ids[-1]]], [n], [r.page_table], page_size, "cpu")
        got = target.compute_logits(target(fb, pool))[0]
        torch.testing.assert_close(got, target.compute_logits(ref_hidden[-1]), rtol=1e-4, atol=1e-5)

        if proposer.startswith("draft_"):
            assert r.draft_len == len(r.token_ids)
            d_pool, d_slots, d_hidden = fresh_prefill(prop.model, r.token_ids, page_size)
            assert_kv_equal(prop.pool, r.page_table, d_pool, d_slots, f"request {r.request_id} draft")
            torch.testing.assert_close(prop.carried_logits[r.slot], prop.model.compute_logits(d_hidden[-1]),
                                       rtol=1e-4, atol=1e-5)
        elif proposer == "mtp":
            # head position i consumes (target hidden h[i], token t[i + 1]) for i < len - 1
            h_pool, h_slots, h_out = fresh_prefill(prop.head, r.token_ids[1:], page_size,
                                                   hidden_in=ref_hidden[:-1], embed=target.embed_tokens)
            assert_kv_equal(prop.pool, r.page_table, h_pool, h_slots, f"request {r.request_id} head")
            torch.testing.assert_close(prop.carried_hidden[r.slot], h_out[-1], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(prop.carried_logits[r.slot], target.compute_logits(h_out[-1]),
                                       rtol=1e-4, atol=1e-5)


def test_a_chained_step_counts_the_token_in_flight_against_max_tokens(tiny_target, tiny_draft):
    """Two tokens left: a step built from current lengths may draft one; a step built while another is in
    flight (which surely adds a token) may draft none."""
    core = make_core(tiny_target, spec="draft_model", draft=str(tiny_draft), num_spec_tokens=3, spec_policy="fixed")
    req = Request("r", [5, 9, 11], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), seed=1)
    req.token_ids += [7, 7, 7]  # three of five output tokens
    assert core.scheduler.decide([req]).num_draft.tolist() == [1]
    assert core.scheduler.decide([req], pending=np.array([4])).num_draft.tolist() == [0]
    core.stream.close()
