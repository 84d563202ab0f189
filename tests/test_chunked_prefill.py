"""Chunked prefill mixed with decoding (`max_num_batched_tokens`): token-identical to whole-prompt prefill for
every proposer and chunk size (chunk boundaries inside pages: page size 4, budgets that are not multiples of
it), with requests arriving while others decode so steps really mix; the proposer consumes every chunk (a
draft that is the target accepts every draft after a chunked prefill, and its carried state equals a whole
prefill's); seeded sampling unchanged; preemption and abort mid-prefill free everything; page integrity is
checked after every step."""

from __future__ import annotations

import random

import pytest
import torch

from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler.core.request import Request, Status
from specstep.scheduler.core.step_plan import StepKind
from tests.fixtures_models import make_mtp_head
from tests.helpers import make_core

PROMPT_LENS = [37, 5, 22, 1, 9, 40, 13, 4]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def proposers(tiny_target, tiny_draft, tmp_path_factory):
    """name -> (--spec, --draft)."""
    return {"none": ("none", None), "ngram": ("ngram", None), "draft_random": ("draft_model", tiny_draft),
            "draft_self": ("draft_model", tiny_target),
            "mtp": ("mtp", make_mtp_head(tmp_path_factory.mktemp("head"), tiny_target))}


def prompts() -> list[list[int]]:
    rng = random.Random(1)
    out = [[rng.randrange(320) for _ in range(n)] for n in PROMPT_LENS]
    out[2] = [5, 6, 7, 8] * 5 + [5, 6]  # repetitive: the n-gram proposer finds matches
    return out


def core_for(target, proposers, name: str, budget: int | None, **cfg):
    spec, draft = proposers[name]
    cfg.setdefault("max_batch_size", 4)
    return make_core(target, spec=spec, draft=None if draft is None else str(draft), page_size=4,
                     max_num_batched_tokens=budget, **cfg)


class StepLog:
    """Wraps the scheduler to record what each prefill/mixed step held."""

    def __init__(self, core) -> None:
        # (decode rows, chunk lengths, chunk final, verify tokens of the decode rows, decode rows that drafted)
        self.steps: list[tuple[int, list[int], list[bool], int, int]] = []
        inner = core.scheduler.schedule

        def schedule():
            plan = inner()
            if plan.kind is StepKind.MIXED:
                chunks = [q for _, q in plan.prompts]
                final = [r.num_computed + q == len(r.token_ids) for r, q in plan.prompts]
                nd = plan.decision.num_draft if plan.decision is not None else []
                self.steps.append((len(plan.decode), chunks, final, int(sum(nd)) + len(nd), int((nd > 0).sum())
                                   if len(nd) else 0))
            return plan
        core.scheduler.schedule = schedule

    @property
    def mixed(self) -> int:
        return sum(1 for d, c, *_ in self.steps if d and c)

    @property
    def speculative_mixed(self) -> int:
        """Mixed steps whose decode rows carried drafts."""
        return sum(1 for d, c, _, _, drafting in self.steps if d and c and drafting)

    @property
    def partial_chunks(self) -> int:
        return sum(f.count(False) for _, _, f, *_ in self.steps)


def run_staggered(core, prompt_list, params, seeds=None) -> list[Request]:
    """Half the requests at once, the rest one per step while those decode (so prefill chunks meet decodes)."""
    reqs = [Request(str(i), list(p), params, seed=(seeds[i] if seeds else 100 + i)) for i, p in enumerate(prompt_list)]
    pending = list(reqs)
    for _ in range(len(reqs) // 2):
        core.add_request(pending.pop(0))
    while core.has_unfinished() or pending:
        if pending and (core.running or not core.has_unfinished()):
            core.add_request(pending.pop(0))
        core.step()
        core.check_integrity()
    assert core.allocator.num_free == core.allocator.num_usable, "pages leaked after all requests finished"
    assert not core.prefilling and not core.running
    return reqs


@pytest.fixture(scope="module")
def reference(tiny_target, proposers):
    """Whole-prompt prefill outputs per proposer (plain greedy for 'none')."""
    return {name: [r.output_token_ids for r in run_staggered(core_for(tiny_target, proposers, name, None),
                                                             prompts(), GREEDY)]
            for name in proposers}


@pytest.mark.parametrize("budget", [5, 7, 13])
@pytest.mark.parametrize("name", ["none", "ngram", "draft_random", "draft_self", "mtp"])
def test_chunked_prefill_is_token_identical_to_whole_prefill(tiny_target, proposers, reference, name, budget):
    core = core_for(tiny_target, proposers, name, budget)
    log = StepLog(core)
    reqs = run_staggered(core, prompts(), GREEDY)
    assert [r.output_token_ids for r in reqs] == reference[name] == reference["none"]
    assert log.mixed > 0 and log.partial_chunks > 0, "no step mixed decodes with a part of a prompt"
    # prompt chunks fill what the decode rows' verify tokens leave; when they leave nothing, a quarter (the floor)
    assert all(sum(c) <= max(budget - verify, budget // 4, 1) for _, c, _, verify, _ in log.steps)
    if name != "none":
        assert sum(r.stats.drafted for r in reqs) > 0
        # speculation goes on in mixed steps: the decode rows verify their drafts beside the prompt chunks
        assert log.speculative_mixed > 0, "no mixed step speculated"
    if name == "draft_self":  # its KV after chunked prefills is exact: every draft is the target's own token
        assert all(r.stats.accepted == r.stats.drafted for r in reqs)


@pytest.mark.parametrize("name", ["draft_self", "mtp"])
def test_proposer_state_after_chunks_equals_whole_prefill(tiny_target, proposers, name):
    prompt = prompts()[0]  # 37 tokens: chunks of 6 end inside pages of 4
    carried = []
    for budget in (None, 6):
        core = core_for(tiny_target, proposers, name, budget, max_batch_size=1)
        req = Request("r", list(prompt), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), seed=0)
        core.add_request(req)
        while req.status in (Status.WAITING, Status.PREFILLING):  # until its prefill's last chunk has run
            core.step()
        p = core.engine.proposer
        carried.append((p.carried_logits[req.slot].clone(), p.carried_hidden[req.slot].clone()))
        assert req.draft_len == len(req.token_ids)
    torch.testing.assert_close(carried[0], carried[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["none", "mtp"])
def test_seeded_sampling_is_unchanged_by_chunking(tiny_target, proposers, name):
    """Draws are keyed by (seed, position), and a mixed step's decode rows sample exactly as a plain step: with
    speculation off the seeded outputs are identical. (Speculative sampling's lossless distribution under
    chunking: tests/test_spec_sampling.py.)"""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True)
    outs = []
    for budget in (None, 7):
        core = core_for(tiny_target, proposers, name, budget, num_spec_tokens=0)
        outs.append([r.output_token_ids for r in run_staggered(core, prompts(), params, seeds=list(range(8)))])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("name", ["mtp", "ngram"])
def test_preemption_mid_prefill_frees_everything_and_output_is_unchanged(tiny_target, proposers, reference, name):
    """A KV cache too small for every request at once: running requests that need pages (their drafts' too)
    preempt the prompts part-way through their chunks (then the newest running requests); pages stay owned
    exactly once after every step (`run_staggered`), and every output still equals the plain one."""
    core = core_for(tiny_target, proposers, name, 6, kv_cache_tokens=80)
    log = StepLog(core)
    reqs = run_staggered(core, prompts(), GREEDY)
    assert core.num_preemptions > 0 and log.partial_chunks > 0 and log.speculative_mixed > 0
    assert [r.output_token_ids for r in reqs] == reference["none"]


def test_abort_mid_prefill_frees_its_pages_and_slot(tiny_target, proposers):
    core = core_for(tiny_target, proposers, "draft_self", 5)
    a = Request("a", prompts()[1], GREEDY, seed=0)
    b = Request("b", prompts()[0], GREEDY, seed=1)
    core.add_request(a)
    core.step()  # a prefilled whole (5 tokens), running
    core.add_request(b)
    core.step()  # a decodes, b's first chunk
    core.check_integrity()
    assert b.status == Status.PREFILLING and 0 < b.num_computed < len(b.token_ids) and b.page_table
    free_slots = len(core.scheduler.queues.free_slots)
    core.abort("b")
    core.check_integrity()
    assert b.finished and not b.page_table and b.slot == -1 and len(core.scheduler.queues.free_slots) == free_slots + 1
    while core.has_unfinished():
        core.step()
        core.check_integrity()
    assert core.allocator.num_free == core.allocator.num_usable
    assert a.output_token_ids == plain_greedy(tiny_target, proposers, prompts()[1])


def plain_greedy(target, proposers, prompt: list[int]) -> list[int]:
    core = core_for(target, proposers, "none", None)
    r = Request("x", list(prompt), GREEDY, seed=0)
    core.add_request(r)
    while core.has_unfinished():
        core.step()
    return r.output_token_ids


@pytest.mark.parametrize("budget", [12, 3])
def test_every_stream_gets_a_token_in_every_step_while_a_long_prompt_prefills(tiny_target, proposers, budget):
    """Four streams decode while a 120-token prompt arrives: in every step until its first token each stream
    emits a token (the prompt never stops them), and the prompt advances in every step, also with a budget below
    the running count (3 < 4 streams: its chunk keeps a quarter of the budget)."""
    core = core_for(tiny_target, proposers, "none", budget, max_batch_size=5)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    streams = [Request(f"s{i}", prompts()[i], params, seed=i) for i in range(4)]
    for s in streams:
        core.add_request(s)
    for _ in range(100):  # bounded: a starved prompt would never start
        if all(s.status == Status.RUNNING for s in streams):
            break
        core.step()
    assert all(s.status == Status.RUNNING for s in streams), "a stream's prompt was starved"
    long = Request("long", [random.Random(2).randrange(320) for _ in range(120)], GREEDY, seed=9)
    core.add_request(long)
    steps = 0
    while long.num_output_tokens == 0:
        tokens, computed = [s.num_output_tokens for s in streams], long.num_computed
        core.step()
        steps += 1
        assert all(s.num_output_tokens > n for s, n in zip(streams, tokens)), f"step {steps}: a stream waited"
        assert long.num_computed > computed or long.num_output_tokens, f"step {steps}: the prompt waited"
    assert steps >= 120 // max(budget - 4, 1)  # chunks of what the 4 decode tokens leave, or a quarter of 3
    assert all(not s.finished for s in streams)


@pytest.mark.parametrize("short_len", [5, 30])
def test_a_short_prompt_behind_a_long_one_is_done_before_the_long_one(tiny_target, proposers, short_len):
    """A prompt with others behind it takes half of what is left: one that arrives behind a long prompt gets its
    first token within a few steps (admitted in the first, then half of every step), not after the long
    prompt's last chunk."""
    core = core_for(tiny_target, proposers, "none", 12, max_batch_size=5)
    long = Request("long", [random.Random(3).randrange(320) for _ in range(120)], GREEDY, seed=0)
    core.add_request(long)
    core.step()
    short = Request("short", [random.Random(4).randrange(320) for _ in range(short_len)], GREEDY, seed=1)
    core.add_request(short)
    steps = 0
    while short.num_output_tokens == 0:
        core.step()
        steps += 1
    assert long.status == Status.PREFILLING and steps == -(-short_len // 6)  # 6 of the 12 tokens a step


def logical_kv(core, pool, length) -> dict[str, torch.Tensor]:
    """Each unfinished request's keys at its first `length(request)` positions, read through its page table
    (page ids and positions past those are the allocator's and a step's scratch)."""
    ps = core.engine.page_size
    out = {}
    for r in core.scheduler.queues.requests.values():
        if not r.finished and r.page_table:
            slots = torch.tensor([r.page_table[i // ps] * ps + i % ps for i in range(length(r))], dtype=torch.long)
            out[r.request_id] = torch.stack([k.reshape(-1, *k.shape[-2:])[slots] for k in pool.k])
    return out


@pytest.mark.parametrize("name", ["ngram", "draft_self", "mtp"])
def test_a_fused_mixed_step_is_its_decode_step_and_prompt_forward(tiny_target, proposers, name):
    """A mixed step in one forward (`StepEngine.run_mixed`) against the same steps run as the decode step, then
    a prompt forward: step by step the same tokens, and after every step the same bits in the target's KV and
    in the draft's or head's KV (which the fused step's rows write: a wrong row offset writes another's)."""
    cores = [core_for(tiny_target, proposers, name, 7) for _ in range(2)]
    cores[1].engine.fuses_mixed = lambda plan: False  # the same engine, each mixed step as two forwards
    fused = []
    run_mixed = cores[0].engine.run_mixed
    cores[0].engine.run_mixed = lambda *a: fused.append(1) or run_mixed(*a)
    pending = [[Request(str(i), list(p), GREEDY, seed=100 + i) for i, p in enumerate(prompts())] for _ in cores]
    for queue, core in zip(pending, cores):
        for _ in range(4):
            core.add_request(queue.pop(0))
    while cores[0].has_unfinished() or pending[0]:
        for queue, core in zip(pending, cores):
            if queue and core.running:
                core.add_request(queue.pop(0))
        steps = [[(o.request.request_id, o.new_token_ids) for o in core.step()] for core in cores]
        assert steps[0] == steps[1]
        views = [(core.engine.pool, lambda r: r.num_computed)]
        if cores[0].engine.proposer.pool is not None:  # the draft's KV, as far as it is current
            views.append((None, lambda r: max(0, min(r.num_computed, r.draft_len) - 1)))
        for pool, length in views:
            kv = [logical_kv(core, pool or core.engine.proposer.pool, length) for core in cores]
            assert kv[0].keys() == kv[1].keys()
            assert all(torch.equal(kv[0][rid], kv[1][rid]) for rid in kv[0])
    assert not cores[1].has_unfinished() and fused
