"""The token-budget step planner (`scheduler/core/chunked_prefill.py`, `prefill_pacer.py`) over the real
`EngineCore` and a simulated engine on a virtual clock (no wall time): decode rows first, then chunks of several
prompts filling the budget the cost model allows; whole prompts up to the compute-efficient size when no stream
runs; the streams' ITL target held under steady arrivals while speculation goes on in mixed steps; and a request
that finishes while a chained step still includes it keeps its pages and slot until that step lands."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler.core.engine_core import EngineCore, SchedulerConfig
from specstep.scheduler.core.page_allocator import PageAllocator
from specstep.scheduler.core.prefill_budget import StepCostModel, choose_budget
from specstep.scheduler.core.request import Request, Status
from specstep.scheduler.core.step_plan import StepKind
from specstep.scheduler.spec.policy import AdaptivePolicy, PolicyConfig
from tests.sim_engine import Scenario, SimClock, SimProposer, SimStepEngine, SimStream

# A prompt forward: 15 ms fixed (the weights' pass), 1 ms a token; a token's cost stops falling past 64 tokens.
FORWARD = StepCostModel(fixed=0.015, per_token=1e-3)
MULTIPLE = 3.0


def decode_cost(b: int, num_draft: np.ndarray | None, refill: bool, tokens: int) -> float:
    """A decode step: 50 ms plus 2 ms a request plus 1 ms a verified draft."""
    drafts = 0 if num_draft is None else int(np.asarray(num_draft).sum())
    return 0.05 + 0.002 * b + 0.001 * drafts


class ForwardSim(SimStepEngine):
    """Prompt forwards cost `forward`'s (what start-up measured); it records each one's chunks."""

    forward: StepCostModel = FORWARD

    def __post_init__(self) -> None:
        super().__post_init__()
        self.forwards: list[list[int]] = []

    def prefill(self, seqs, with_proposer=True, q_lens=None):
        self.clock.now += self.forward.fixed
        return self.chunks_in_step(seqs, q_lens)

    def chunks_in_step(self, seqs, q_lens):
        """Chunks in a forward of their own (after its fixed cost) or in a fused mixed step's (none)."""
        q_lens = list(q_lens) if q_lens is not None else [len(s.token_ids) - s.num_computed for s in seqs]
        self.forwards.append(q_lens)
        self.clock.now += sum(self.forward.chunk_cost(q, s.num_computed) for s, q in zip(seqs, q_lens))
        return torch.ones(len(seqs), dtype=torch.long)


def make_core(proposer: str | None = None, k: int = 0, overlap: bool = False, forward: StepCostModel = FORWARD,
              max_batch_size=16, fused: bool = False):
    clock = SimClock()
    engine = ForwardSim(Scenario(cost=decode_cost, alpha=lambda rid, n: 0.7), clock,
                        SimProposer(proposer) if proposer else None, fuses=fused)
    engine.forward = forward
    budget = choose_budget(forward, decode_cost(1, None, False, 0), MULTIPLE, 4096, fused=fused)
    policy = AdaptivePolicy(PolicyConfig(kind="fixed", k_max=k, keeps_draft_kv=engine.has_draft_model))
    core = EngineCore(engine, PageAllocator(8192, 16),
                      SchedulerConfig(max_batch_size=max_batch_size, prefill_budget=budget, num_spec_tokens=k,
                                      max_model_len=100_000),
                      policy=policy, clock=clock, stream=SimStream(clock) if overlap else None)
    return core, engine, clock


def start_streams(core: EngineCore, n: int, steps: int) -> list[Request]:
    """n streams of 8-token prompts, prefilled and then decoding for `steps` steps (the policy times them)."""
    streams = [request(f"s{i}", 8, 1000) for i in range(n)]
    for r in streams:
        core.add_request(r)
    while len(core.running) < n:
        core.step()
    for _ in range(steps):
        core.step()
    return streams


def request(rid: str, n: int, max_tokens: int) -> Request:
    return Request(rid, [1] * n, SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True), seed=1)


def test_no_streams_take_whole_prompts():
    """Nothing decodes: no gap to protect. Waiting prompts are prefilled whole, several sharing a forward, as
    whole-prompt prefill does, not in chunks of the compute-efficient size (64 tokens for FORWARD: 15 ms fixed
    over 1 ms a token); a prompt left part-way when the streams ended goes on whole."""
    core, engine, _ = make_core()
    pacer = core.scheduler.chunks.pacer
    assert pacer.efficient == 64
    for i in range(5):
        core.add_request(request(f"p{i}", 40, 1))
    plan = core.scheduler.schedule()
    assert plan.kind is StepKind.MIXED and not plan.decode
    assert [q for _, q in plan.prompts] == [40] * 5
    long = request("long", 3000, 1)
    long.num_computed = 2000
    assert pacer.chunk(pacer.room(0, None), long.num_computed, 1000) == 1000


@pytest.mark.parametrize("fused", [False, True])
def test_decode_rows_first_then_chunks_of_several_prompts_fill_the_budget(fused):
    """With streams running, a step takes every running request's decode step with its drafts, then prompt
    chunks of several waiting prompts whose cost fits the streams' ITL target: multiple x their decode step,
    as the policy prices it (verify rows included), less a prompt forward's fixed cost unless the chunks share
    the decode rows' forward (fused)."""
    core, engine, clock = make_core("mtp", k=2, fused=fused)
    start_streams(core, 4, 6)  # the policy times the batch's speculative step
    for i in range(4):
        core.add_request(request(f"p{i}", 40, 1000))
    plan = core.scheduler.schedule()
    assert plan.kind is StepKind.MIXED and len(plan.decode) == 4
    assert plan.decision.num_draft.tolist() == [2, 2, 2, 2]  # speculation goes on beside the prompts
    decode_s = decode_cost(4, plan.decision.num_draft, True, 0)
    assert plan.decode_s == pytest.approx(decode_s)
    room = (MULTIPLE - 1) * decode_s - (0.0 if fused else FORWARD.fixed)  # what the target leaves the chunks
    chunks = [q for _, q in plan.prompts]
    assert len(chunks) >= 3 and chunks[:2] == [40, 40]  # several prompts share the step
    assert abs(sum(chunks) - room / FORWARD.per_token) <= 1  # the chunks fill the room


@pytest.mark.parametrize("fused", [False, True])
def test_prompt_forwards_keep_the_compute_efficient_size_where_the_itl_target_leaves_less(fused):
    """A prompt forward whose fixed cost (60 ms) eats most of what the streams' target leaves: chunks of what is
    left (~40 tokens) would pay it for few tokens each. The forward keeps the compute-efficient size (256: a
    token's cost stops falling there), several prompts sharing it; the streams' gap is one such forward. Fused,
    the chunks share the decode rows' forward: the step's rows make it efficient (two streams verifying 3 rows
    each leave 250), and the chunks pay no fixed cost."""
    forward = StepCostModel(fixed=0.06, per_token=1e-3)
    core, engine, clock = make_core("mtp", k=2, forward=forward, fused=fused)
    pacer = core.scheduler.chunks.pacer
    assert pacer.efficient == 256 and (pacer.overhead == 0.0) == fused
    start_streams(core, 2, 6)
    for i in range(3):
        core.add_request(request(f"p{i}", 200, 1000))
    plan = core.scheduler.schedule()
    assert (MULTIPLE - 1) * plan.decode_s - forward.fixed < forward.chunk_cost(64, 0)  # the target leaves < 64
    assert plan.decision.num_draft.tolist() == [2, 2]
    assert [q for _, q in plan.prompts] == ([200, 50] if fused else [200, 56])


def test_the_itl_target_is_the_steady_batchs_when_prompts_wait():
    """Two streams run and fourteen prompts wait, in a batch of 16: once admitted, the streams' gap is the decode
    step of 16. The target follows that step rather than the two streams' own, or the chunks stay small, the
    prompts wait and the batch stays small."""
    core, engine, clock = make_core("mtp", k=2, fused=True)
    streams = start_streams(core, 16, 8)  # the policy times steps of 16
    for r in streams[2:]:
        core.abort(r.request_id)
    while len(core.running) > 2:
        core.step()
    for _ in range(8):  # and of 2
        core.step()
    for i in range(14):
        core.add_request(request(f"p{i}", 100, 1000))
    steady = core.scheduler.steady_decode_s(core.last_decision)
    assert steady == pytest.approx(decode_cost(16, np.full(16, 2), True, 0), rel=0.1)
    plan = core.scheduler.schedule()
    assert len(plan.decode) == 2 and plan.decode_s < 0.7 * steady
    room = MULTIPLE * steady - plan.decode_s  # the steady batch's target, less the step's own decode rows
    assert abs(sum(q for _, q in plan.prompts) - room / FORWARD.per_token) <= 2
    assert core.pacing().itl_target_s == pytest.approx(MULTIPLE * steady)


def test_an_untimed_steady_batch_is_priced_from_the_start_up_fit():
    """A burst of prompts beside the first streams, before any step of the whole batch ran: the steady batch's
    step is a forward of its rows as start-up priced prompt rows, not the two streams' own step."""
    core, engine, clock = make_core("mtp", k=2, fused=True)
    start_streams(core, 2, 4)
    for i in range(14):
        core.add_request(request(f"p{i}", 100, 1000))
    pacer = core.scheduler.chunks.pacer
    steady = core.scheduler.steady_decode_s(core.last_decision)
    assert steady == pytest.approx(FORWARD.fixed + FORWARD.per_token * 16 * 3)
    assert steady == pacer.forward_s(48) and steady > core.scheduler.decode_step_s(core.last_decision)


@pytest.mark.parametrize("fused", [False, True])
def test_the_itl_target_holds_under_steady_arrivals(fused):
    """A closed loop of 8 streams (each one's end brings a new 48-token prompt) with speculation on: every step
    the streams see, mixed or not, costs at most MULTIPLE x their decode step, prompts keep starting, and most
    steps mix a prompt with speculative decode rows. Fused, the pacer learns that the chunks add no fixed cost."""
    core, engine, clock = make_core("mtp", k=2, fused=fused)
    n = 0

    def arrive() -> None:
        nonlocal n
        core.add_request(request(f"r{n}", 48, 24))
        n += 1

    for _ in range(8):
        arrive()
    gaps, priced, mixed, speculative_mixed = [], [], 0, 0
    inner = core.scheduler.schedule
    plans = []
    core.scheduler.schedule = lambda: plans.append(inner()) or plans[-1]
    for step in range(400):
        streams = len(core.running)
        t0 = clock.now
        finished = [o for o in core.step() if o.finished]
        plan = plans[-1]
        if streams and plan.decode and step > 40:  # past the pacer's first fits
            true_s = decode_cost(len(plan.decode), plan.decision.num_draft, True, 0)
            # The target is a multiple of the decode step as the policy prices it (per batch bucket: within ~15%
            # of the true step here): the prompt forward gets the rest of it.
            forward = clock.now - t0 - true_s
            gaps.append((forward / ((MULTIPLE - 1) * (plan.decode_s or true_s)), (clock.now - t0) / true_s))
            priced.append((plan.decode_s or true_s) / true_s)
            mixed += plan.kind is StepKind.MIXED
            speculative_mixed += plan.kind is StepKind.MIXED and bool(plan.decision.num_draft.any())
        for _ in finished:
            arrive()
    assert n > 60  # prompts kept starting and finishing
    assert max(g for g, _ in gaps) <= 1.001, sorted(gaps)[-5:]
    assert max(g for _, g in gaps) <= MULTIPLE * 1.15 and np.median([g for _, g in gaps]) <= MULTIPLE
    assert mixed > 0.3 * len(gaps) and speculative_mixed > 0.9 * mixed
    # The policy prices decode steps from decode steps alone: a fused step's chunks never inflate them
    assert 0.8 < min(priced) and max(priced) < 1.35, (min(priced), max(priced))  # a batch bucket's spread
    if fused:
        assert core.scheduler.chunks.pacer.overhead < 0.1 * FORWARD.fixed
    core.check_integrity()


def test_a_finished_request_keeps_its_pages_and_slot_while_a_chained_step_includes_it():
    """On the overlap path step N+1 is built and launched before step N is read back: a request that finishes in
    step N still rides in step N+1, whose device work writes its KV pages and its proposer slot. Until that step
    lands neither may be handed to another request."""
    core, engine, clock = make_core("mtp", k=2, overlap=True, max_batch_size=4)
    reqs = [request(f"r{i}", 8, 5 + 3 * i) for i in range(6)]
    for r in reqs:
        core.add_request(r)
    seen = 0
    while core.has_unfinished():
        core.step()
        core.check_integrity()
        inflight = core.inflight.plan.decode if core.inflight is not None else ()
        queues = core.scheduler.queues
        for r in inflight:
            if r.finished:
                seen += 1
                assert r.page_table and not set(r.page_table) & set(core.allocator._free), r.request_id
                assert r.slot >= 0 and r.slot not in queues.free_slots
                live = [x for x in (*core.running, *core.prefilling) if x.slot == r.slot]
                assert not live, f"slot {r.slot} of {r.request_id} handed to {live[0].request_id}"
    assert seen > 0, "no request finished while a chained step included it"
    assert all(r.status is Status.FINISHED and not r.page_table and r.slot == -1 for r in reqs)
    assert core.allocator.num_free == core.allocator.num_usable


@pytest.mark.parametrize("reason", ["explore", "remeasure", "fixed"])
def test_a_step_taken_to_time_a_candidate_is_not_fused(reason):
    """Exploration and re-measurement run a k to time it: fused with prompt chunks its cost could not be told
    from theirs, so such a mixed step runs as the decode step, then a prompt forward, and its cost is learned.
    Any other mixed step fuses, and its decode rows teach the step costs nothing."""
    from dataclasses import replace

    core, engine, clock = make_core("mtp", k=2, fused=True)
    start_streams(core, 2, 4)
    decide = core.scheduler.decide
    core.scheduler.decide = lambda running: replace(decide(running), reason=reason)
    fused, observed = [], []
    run_mixed, observe = engine.run_mixed, core.policy.costs.observe
    engine.run_mixed = lambda *a: fused.append(1) or run_mixed(*a)
    core.policy.costs.observe = lambda *a, **k: observed.append(a[0]) or observe(*a, **k)
    core.add_request(request("p", 40, 4))
    before = core.policy.observed
    core.step()
    assert bool(fused) == (reason == "fixed")
    assert bool(observed) == (reason != "fixed")
    assert core.policy.observed == before + 1  # every decode step reaches the policy's bookkeeping once
