"""Chunked prefill's step budget (`scheduler/core/prefill_budget.py`, `prefill_pacer.py`): the cost model's fit and
inverse, the budget a step-latency multiple chooses, the share a prompt keeps when decode rows fill the budget,
the live pacing of mixed steps, the start-up timing driven with an injected clock (no wall time anywhere), and
`serve`'s default of a calibrated budget."""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest
import torch

from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler import generate_cmd, serve_cmd
from specstep.scheduler.build import build_engine
from specstep.scheduler.core.engine_core import EngineCore, SchedulerConfig
from specstep.scheduler.core.page_allocator import PageAllocator
from specstep.scheduler.core.prefill_budget import (
    CHUNKS,
    MIN_BUDGET,
    PrefillBudget,
    StepCostModel,
    choose_budget,
    efficient_tokens,
    fit_costs,
    measure_step_costs,
)
from specstep.scheduler.core.prefill_pacer import HEADROOM, WINDOW, PrefillPacer
from specstep.scheduler.core.request import Request
from tests.sim_engine import Scenario, SimClock, SimStepEngine

MODEL = StepCostModel(fixed=0.05, per_token=0.006, per_key=4e-6, per_context=2e-5)


def test_fit_recovers_the_costs_it_was_given():
    shapes = (8, 0), (32, 0), (8, 1024), (32, 1024)  # the start-up shapes (`CHUNKS`)
    fit = fit_costs([(q, ctx, MODEL.fixed + MODEL.chunk_cost(q, ctx)) for q, ctx in shapes])
    assert fit.fixed == pytest.approx(MODEL.fixed) and fit.per_token == pytest.approx(MODEL.per_token)
    assert fit.per_key == pytest.approx(MODEL.per_key) and fit.per_context == pytest.approx(MODEL.per_context)
    # one size far in: reading the context cannot be told from attending to it, so it is not fitted
    old = fit_costs([(q, ctx, MODEL.fixed + MODEL.chunk_cost(q, ctx)) for q, ctx in ((8, 0), (32, 0), (32, 1024))])
    assert old.per_context == 0.0 and old.per_key > 0


def test_a_late_chunk_pays_for_its_context_whatever_its_size():
    """A chunk reads its whole context once (the torch backend gathers every page): late in a long prompt the
    context alone can fill the room, and a model without that term (what start-up fitted before) lets a step
    run past its bound there."""
    room = 0.1
    q = MODEL.tokens_within(room, 4000)
    assert MODEL.chunk_cost(q, 4000) <= room and q < StepCostModel(
        MODEL.fixed, MODEL.per_token, MODEL.per_key).tokens_within(room, 4000)
    assert MODEL.tokens_within(0.9 * MODEL.per_context * 4000, 4000) == 0
    # the step's first chunk still advances: its floor buys tokens beyond the context's read
    budget = PrefillBudget(64, MODEL, "test", max_tokens=4096, multiple=3.0, decode_s=0.05)
    late = budget.chunk(0.0, 4000, remaining=1000, floor=0.05)
    assert late == MODEL.tokens_within(0.05 + MODEL.per_context * 4000, 4000) and late > 1
    assert budget.chunk(0.0, 4000, remaining=1000) == 0


def test_tokens_within_stays_exact_for_a_vanishing_attention_term():
    # a live fit's per_key of 1e-25 beside 1 ms a token: the chunk is the token count, not 0 by cancellation
    assert StepCostModel(per_token=1e-3, per_key=1e-25).tokens_within(0.1, 0) == 100
    assert StepCostModel(per_key=1e-4).tokens_within(0.01, 0) == 10  # attention alone: sqrt(rest / per_key)


def test_fit_drops_a_term_noise_made_negative():
    # Longer context measured *cheaper* (a noisy neighbour): no negative attention cost, the rest refitted.
    fit = fit_costs([(8, 0, 0.10), (32, 0, 0.25), (32, 1024, 0.24)])
    assert fit.per_key == 0.0 and fit.per_token > 0 and fit.fixed > 0
    one_size = fit_costs([(8, 0, 0.1), (8, 0, 0.1)])  # a tiny KV cache: a cost per token only
    assert one_size.fixed == one_size.per_key == 0.0 and one_size.per_token == pytest.approx(0.1 / 8)


def test_tokens_within_is_the_largest_chunk_that_fits():
    for ctx in (0, 1000, 4000):
        for left in (0.01, 0.1, 0.5):
            q = MODEL.tokens_within(left, ctx)
            assert MODEL.chunk_cost(q, ctx) <= left < MODEL.chunk_cost(q + 1, ctx)
    assert MODEL.tokens_within(-1.0, 0) == 0
    # Later in a prompt a chunk's attention covers more keys: the same cost buys fewer tokens.
    assert MODEL.tokens_within(0.2, 0) > MODEL.tokens_within(0.2, 2000) > MODEL.tokens_within(0.2, 4000) > 0


def test_budget_fills_the_multiple_beside_one_decoding_request():
    decode = 0.2
    for multiple in (3.0, 4.0, 8.0):
        b = choose_budget(MODEL, decode, multiple, max_tokens=4096)
        # a mixed step costs the decode step plus a prompt forward: its fixed cost, then its chunks
        room = (multiple - 1) * decode - MODEL.fixed
        assert MODEL.chunk_cost(b.tokens, 0) <= room < MODEL.chunk_cost(b.tokens + 1, 0)
        assert "calibrated" in b.describe() and f"{b.tokens} prompt tokens" in b.describe()
    # the floor: the compute-efficient size (MODEL: 32), where the target leaves less
    assert choose_budget(MODEL, decode, 1.1, max_tokens=4096).tokens == 32
    assert choose_budget(MODEL, decode, 50.0, max_tokens=300).tokens == 300  # at most a whole-prefill step


def test_a_calibrated_chunk_fills_the_room_at_every_context():
    b = choose_budget(MODEL, 0.2, 2.5, max_tokens=4096)
    for decode_s in (None, 0.3):
        room = 1.5 * (decode_s or 0.2) - MODEL.fixed  # what the prompt forward's fixed cost leaves
        for decode_rows in (1, 4):
            left, floor = PrefillPacer(b).plan(decode_rows, decode_s)
            assert left == pytest.approx(room)  # the batch's own decode step already holds its rows
            for ctx in (0, 500, 3000):
                q = b.chunk(left, ctx, remaining=10_000, floor=floor)
                assert q >= 1 and b.chunk_cost(q, ctx) <= room < b.chunk_cost(q + 1, ctx)


def test_fixed_budget_counts_tokens():
    b = PrefillBudget.fixed_tokens(20)
    left, floor = PrefillPacer(b).plan(4, decode_s=0.3)  # 4 decode rows; step times do not move a token budget
    assert b.chunk(left, ctx=3000, remaining=100, floor=floor) == 16  # no context discount: tokens are tokens
    left -= b.chunk_cost(16, 3000)
    assert b.chunk(left, ctx=0, remaining=100) == 0
    assert b.chunk(20.0, ctx=0, remaining=7) == 7  # a prompt's last chunk


def test_decode_rows_past_the_budget_leave_prompts_a_quarter():
    """Every running request decodes in every mixed step; when they take a fixed budget the step's first prompt
    chunk still gets a quarter of an empty step's room (later ones nothing): prompts are never starved."""
    b = PrefillBudget.fixed_tokens(16)
    left, floor = PrefillPacer(b).plan(40, None)
    assert b.chunk(left, ctx=0, remaining=100, floor=floor) == 4
    assert b.chunk(left, ctx=0, remaining=100) == 0
    assert b.chunk(left, ctx=0, remaining=2, floor=floor) == 2


def _mixed_steps(n: int, seed: int = 0) -> list[list[tuple[int, int]]]:
    """Prompt chunks of mixed steps as a long prompt's chunks see them: 1-64 tokens at contexts up to 4,000."""
    rng = np.random.default_rng(seed)
    return [[(int(rng.integers(1, 65)), int(rng.integers(0, 4000)))] for _ in range(n)]


def test_pacer_follows_the_batchs_decode_step_and_what_mixed_steps_really_cost():
    b = choose_budget(MODEL, 0.2, 2.5, max_tokens=4096)
    pacer = PrefillPacer(b)
    # before the engine timed a decode step: start-up's; the prompt forward's fixed cost as start-up fitted it
    assert pacer.room(4, None) == pytest.approx(1.5 * 0.2 - MODEL.fixed)
    assert pacer.room(4, 0.3) == pytest.approx(1.5 * 0.3 - MODEL.fixed)  # the running batch's own
    # Serving, a chunk's context read costs 3x what the start-up probes said, its tokens what they said, and a
    # prompt forward 50 ms of its own: a scale on the start-up model cannot say which term is off (a late
    # 4-token chunk is mostly read, an early 64-token one mostly tokens); the live model does.
    true = dataclasses.replace(MODEL, per_context=3 * MODEL.per_context)
    for chunks in _mixed_steps(WINDOW):
        pacer.observe(chunks, 0.05 + sum(true.chunk_cost(q, c) for q, c in chunks))
    for q, ctx in ((4, 3500), (64, 0), (32, 2000), (16, 1000)):  # what a prompt forward costs
        assert pacer.overhead + pacer.chunk_cost(q, ctx) == pytest.approx(0.05 + true.chunk_cost(q, ctx), rel=0.04)
    for ctx in (0, 2000, 3500):  # the chunk that fills the room costs the room, at every context
        room = pacer.room(4, 0.4)
        q = pacer.chunk(room, ctx, remaining=10_000)
        assert 0.05 + true.chunk_cost(q, ctx) <= 1.5 * 0.4 * 1.04 < 0.05 + true.chunk_cost(q + 2, ctx) + 0.03
    before = pacer.model
    pacer.observe([(8, 3000)], 10.0)  # one step slowed by a neighbour barely moves it
    assert pacer.model.per_context == pytest.approx(before.per_context, rel=0.1)
    assert pacer.model.per_token == pytest.approx(before.per_token, rel=0.1)
    for chunks in _mixed_steps(WINDOW):  # however slow the steps, a step keeps room for the efficient size
        pacer.observe(chunks, 1000.0)
    assert pacer.room(4, 0.2) == pytest.approx(pacer.chunk_cost(pacer.efficient, 0)) and pacer.efficient >= 16
    fixed = PrefillPacer(PrefillBudget.fixed_tokens(20))
    fixed.observe([(4, 0)], 9.0)
    assert fixed.room(4, 0.5) == fixed.room(4, None) == 16


def test_pacer_keeps_headroom_for_the_slow_steps():
    """Steps planned to the bound run past it half the time: with noisy step costs the room keeps HEADROOM
    median residuals free, so most steps stay within the bound."""
    b = choose_budget(MODEL, 0.08, 2.5, max_tokens=4096)
    quiet, noisy = PrefillPacer(b), PrefillPacer(b)
    rng = np.random.default_rng(1)
    for chunks in _mixed_steps(WINDOW):
        cost = MODEL.fixed + sum(MODEL.chunk_cost(q, c) for q, c in chunks)
        quiet.observe(chunks, cost)
        noisy.observe(chunks, cost * (1 + 0.2 * rng.standard_normal()))
    assert noisy.room(4, 0.3) < quiet.room(4, 0.3) - HEADROOM * 0.5 * noisy._spread
    within = []
    for chunks in _mixed_steps(200, seed=2):
        ctx = chunks[0][1]
        q = noisy.chunk(noisy.room(4, 0.3), ctx, remaining=10_000)
        forward = MODEL.fixed + MODEL.chunk_cost(q, ctx)
        within.append(0.3 + forward * (1 + 0.2 * rng.standard_normal()) <= 2.5 * 0.3)
    assert np.mean(within) >= 0.9  # planned to the bound without headroom: ~0.5


class MixedSim(SimStepEngine):
    """A mixed step's prompt forward costs 2 ms plus 3 ms a prompt token (3x what the fit below says)."""

    def prefill(self, seqs, with_proposer=True, q_lens=None):
        self.clock.now += 0.002 + 3e-3 * sum(q_lens)
        return torch.ones(len(seqs), dtype=torch.long)


def test_mixed_steps_cost_the_multiple_of_the_streams_decode_step_when_the_fit_is_off():
    """The real `EngineCore` over a simulated engine (virtual clock): prompt tokens cost 3x what the start-up fit
    says. Once the pacer has seen a few mixed steps, every mixed step of a long prompt costs what 2.5 of the
    streams' decode steps cost, not more and not much less (the budget is used)."""
    clock = SimClock()
    decode = lambda b, nd, refill, tokens: 0.05 + 0.001 * b  # noqa: E731
    engine = MixedSim(Scenario(cost=decode, alpha=lambda rid, n: 0.0), clock, None)
    budget = choose_budget(StepCostModel(fixed=0.002, per_token=1e-3), decode(1, None, False, 0), 2.5, 4096)
    assert budget.efficient == 16  # the fixed cost is small: the target, not the floor, sizes the chunks
    core = EngineCore(engine, PageAllocator(8192, 16), SchedulerConfig(max_batch_size=8, prefill_budget=budget,
                                                                       max_model_len=100_000), clock=clock)
    params = SamplingParams(temperature=1.0, max_tokens=10_000, ignore_eos=True)
    for i in range(4):
        core.add_request(Request(f"s{i}", [1] * 30, params, seed=i))
    for _ in range(20):
        core.step()
    long = Request("long", [1] * 2000, SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True), seed=9)
    core.add_request(long)
    costs = []
    while long.num_output_tokens == 0:
        before = clock.now
        core.step()
        costs.append(clock.now - before)
    target = 2.5 * decode(4, None, False, 0)
    assert len(costs) > 20
    # The live model learns the 3x within a dozen steps (the prior is worth one step; a token is 4% of the room)
    assert all(c <= 1.05 * target for c in costs[:12]), costs
    assert all(0.95 * target <= c <= target * (1 + 1e-9) for c in costs[14:-1]), costs  # the last: what was left


class ReadSim(SimStepEngine):
    """A mixed step's prompt forward costs READ_MODEL's: a chunk pays for reading its context whatever its size
    (the start-up fit and the live one agree on it)."""

    def prefill(self, seqs, with_proposer=True, q_lens=None):
        self.clock.now += READ_MODEL.fixed + sum(READ_MODEL.chunk_cost(q, s.num_computed) for s, q in zip(seqs, q_lens))
        return torch.ones(len(seqs), dtype=torch.long)


READ_MODEL = StepCostModel(fixed=0.02, per_token=1e-3, per_context=1e-4)


def test_a_short_prompt_behind_a_long_one_late_in_its_chunks_starts_at_once():
    """Late in a long prompt its context read alone costs more than half a step's room. A short prompt arriving
    then takes the next step (with the floor a step's first chunk gets); before, the long prompt took the floor
    (its read and tokens past the whole room), the short one got nothing and waited for the long one's end."""
    clock = SimClock()
    decode = lambda b, nd, refill, tokens: 0.05 + 0.001 * b  # noqa: E731
    engine = ReadSim(Scenario(cost=decode, alpha=lambda rid, n: 0.0), clock, None)
    budget = choose_budget(READ_MODEL, decode(1, None, False, 0), 3.0, 4096)
    core = EngineCore(engine, PageAllocator(8192, 16), SchedulerConfig(max_batch_size=8, prefill_budget=budget,
                                                                       max_model_len=100_000), clock=clock)
    params = SamplingParams(temperature=1.0, max_tokens=10_000, ignore_eos=True)
    for i in range(4):
        core.add_request(Request(f"s{i}", [1] * 30, params, seed=i))
    long = Request("long", [1] * 4000, SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True), seed=9)
    core.add_request(long)
    while long.num_computed < 1500:
        core.step()
    short = Request("short", [1] * 20, SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True), seed=8)
    core.add_request(short)
    steps = 0
    while short.num_output_tokens == 0 and steps < 5:
        core.step()
        steps += 1
    assert short.num_output_tokens == 1 and steps <= 2, steps
    assert long.num_output_tokens == 0  # the long one goes on after it
    while long.num_output_tokens == 0:
        core.step()
    core.check_integrity()


class TimedEngine:
    """A step engine whose steps advance a virtual clock by known costs (prefill: MODEL; decode: 0.08 s), the
    first call of each shape paying extra (a cold start the medians must outlast); it records the shapes it
    ran."""

    def __init__(self) -> None:
        self.now, self.shapes, self.seen = 0.0, [], set()

    def clock(self) -> float:
        return self.now

    def _tick(self, key, cost: float) -> None:
        self.now += cost + (1.0 if key not in self.seen else 0.0)
        self.seen.add(key)

    def prefill(self, seqs, with_proposer=True, q_lens=None):
        (s,), (q,) = seqs, q_lens
        assert s.num_computed + q == len(s.token_ids) and not with_proposer
        assert len(s.page_table) * 16 >= len(s.token_ids) and 0 not in s.page_table  # never the dummy page
        self.shapes.append((q, s.num_computed))
        self._tick((q, s.num_computed), MODEL.fixed + MODEL.chunk_cost(q, s.num_computed))
        return np.zeros(1)

    def plan_decode(self, seqs, num_draft, chain=None, refill=True):
        (s,) = seqs
        assert s.num_computed == len(s.token_ids) - 1 and not refill and list(num_draft) == [0]
        return s

    def run_decode(self, ctx):
        self._tick("decode", 0.08)
        return type("Out", (), {"read": lambda self: None})()


def test_measured_costs_give_the_budget_the_costs_imply():
    eng = TimedEngine()
    costs = measure_step_costs(eng, num_pages=400, page_size=16, max_len=2048, repeats=3, clock=eng.clock)
    assert costs.decode_s == pytest.approx(0.08)  # medians: the slow first round is outvoted
    assert len(costs.chunks) == len(CHUNKS) and all(eng.shapes.count(s) == 3 for s in set(eng.shapes))
    b = choose_budget(fit_costs(list(costs.chunks)), costs.decode_s, 3.0, 4096)
    assert b.tokens == choose_budget(MODEL, 0.08, 3.0, 4096).tokens
    # The cost curve at context 0 is timed past where a token's cost stops falling: the size the true costs call
    # compute-efficient (MODEL: 0.05 s fixed over 6 ms a token: 32, doubling saves < 10% beyond)
    assert max(q for q, ctx, _ in costs.chunks if ctx == 0) > 2 * 32
    assert b.efficient == efficient_tokens(MODEL.fixed, MODEL, 4096) == 32
    assert efficient_tokens(MODEL.fixed, MODEL, 20) == MIN_BUDGET  # never past the largest prompt forward
    # nor past the largest size timed: a fixed cost that dwarfs the tokens' would call for ever larger forwards
    flat = StepCostModel(fixed=1.0, per_token=1e-6)
    assert choose_budget(flat, 0.08, 3.0, 4096, measured_up_to=512).efficient == 512


def test_measuring_fits_a_small_kv_cache():
    eng = TimedEngine()
    costs = measure_step_costs(eng, num_pages=5, page_size=16, max_len=2048, repeats=1, clock=eng.clock)
    assert all(q + ctx <= 4 * 16 for q, ctx in eng.shapes) and costs.chunks


def cli_config(module, tiny_target, *argv: str):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    args = p.parse_args(["--model", str(tiny_target), "--spec", "none", "--device", "cpu", *argv])
    return generate_cmd.engine_config_from_args(args)


def test_serve_calibrates_a_budget_by_default(tiny_target):
    """`serve` chunks prompts with a budget timed on its own target at start-up; the ready line says so."""
    cfg = cli_config(serve_cmd, tiny_target)
    assert cfg.chunked_prefill == "calibrated" and cfg.max_step_latency == serve_cmd.MAX_STEP_LATENCY
    core, _, info = build_engine(dataclasses.replace(cfg, kv_cache_tokens=4096))
    budget = core.config.prefill_budget
    assert budget is not None and MIN_BUDGET <= budget.tokens <= cfg.max_prefill_tokens
    assert budget.multiple == serve_cmd.MAX_STEP_LATENCY and budget.decode_s > 0 and budget.model.fixed > 0
    text = generate_cmd.ready_text(info)
    assert "chunked prefill calibrated to an ITL target of 3 x the running streams' decode step" in text
    assert f"{budget.tokens} prompt tokens a step" in text and f"never below {budget.efficient}" in text
    assert budget.efficient >= MIN_BUDGET
    core.close()


@pytest.mark.parametrize("argv, mode", [((), "calibrated"), (("--max-num-batched-tokens", "64"), "fixed"),
                                        (("--max-num-batched-tokens", "0"), "off"), (("--no-chunked-prefill",), "off"),
                                        (("--max-step-latency", "4", "--max-num-batched-tokens", "9"), "fixed")])
def test_a_fixed_budget_or_off_overrides_the_calibration(tiny_target, argv, mode):
    assert cli_config(serve_cmd, tiny_target, *argv).chunked_prefill == mode
    assert cli_config(generate_cmd, tiny_target).chunked_prefill == "off"  # offline throughput: whole prompts


def test_fixed_and_off_budgets_reach_the_core(tiny_target):
    for argv, tokens in ((("--max-num-batched-tokens", "9"), 9), (("--no-chunked-prefill",), None)):
        cfg = dataclasses.replace(cli_config(serve_cmd, tiny_target, *argv), kv_cache_tokens=1024)
        core, _, info = build_engine(cfg)
        budget = core.config.prefill_budget
        assert (budget.tokens if budget else None) == tokens and core.chunked == (tokens is not None)
        assert ("(--max-num-batched-tokens)" if tokens else "chunked prefill off") in info.prefill
        core.close()
