"""Chunked prefill's step budget: how many prompt tokens a mixed step takes beside the running requests' decode
tokens (`scheduler/core/chunked_prefill.py`).

A fixed budget (`--max-num-batched-tokens N`) counts tokens, as vLLM's does. A calibrated one
(`--max-step-latency X`) bounds a mixed step's cost at X of the running batch's decode steps, from costs timed
at start-up and fitted as

    cost(prefill step) = fixed + sum over chunks of per_token * q + per_context * ctx + per_key * q * (ctx + q)

and a mixed step is taken to cost its batch's decode step plus that sum for its prompt chunks of q tokens at
context ctx. A chunk attends to about q * (ctx + q) keys (per_key: with the torch backend on CPU a 64-token
chunk at context 3,000 cost ~3x one at context 0), and it reads its whole context once whatever its size
(per_context: gathering the pages, the attention kernel's pass over every key block; a 1-token chunk at context
4,000 cost ~2x one at context 0 on SmolLM2). Without per_context the fit, made at context 0 and 1,024, took a
late chunk of a long prompt for cheap and let its step run to ~3x the bound. So a calibrated chunk shrinks late
in a long prompt, where a token count alone would let the step grow, down to one token where the context alone
fills the room. A fixed budget is the same arithmetic in token units (per_token 1, the rest 0: a chunk's "cost"
is its token count).

The arithmetic here is pure (unit-tested with injected costs); `measure_step_costs` does the timing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from specstep.engine.engine_config import EngineConfig
from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler.core.request import Request

MIN_BUDGET = 16  # a calibrated budget's floor, in tokens at context 0: smaller chunks pay the fixed cost per token
# A prompt forward is compute-efficient from the size where doubling it saves less than this share of a token's
# cost: beyond it the forward's fixed costs (the weights' pass, launches) are spread thin and bigger steps only
# lengthen the streams' gaps.
EFFICIENT_GAIN = 0.10


@dataclass(frozen=True, slots=True)
class StepCostModel:
    fixed: float = 0.0
    per_token: float = 0.0
    per_key: float = 0.0
    per_context: float = 0.0

    def chunk_cost(self, q: int, ctx: int) -> float:
        if q <= 0:
            return 0.0
        return self.per_token * q + self.per_context * ctx + self.per_key * q * (ctx + q)

    def tokens_within(self, left: float, ctx: int) -> int:
        """The largest q with chunk_cost(q, ctx) <= left (0 when nothing fits; unbounded costs: a large q)."""
        rest = left - self.per_context * ctx  # what any chunk at this context pays before its first token
        if rest <= 0:
            return 0
        a, b = self.per_key, self.per_token + self.per_key * ctx
        if a <= 0 and b <= 0:
            return 1 << 30
        # The root of a q^2 + b q = rest in the form that stays exact when a is tiny beside b (a live fit's
        # per_key of 1e-25: (-b + sqrt(b^2 + 4 a rest)) / 2a cancels to 0 there)
        q = rest / b if a <= 0 else 2 * rest / (b + math.sqrt(b * b + 4 * a * rest))
        q = int(q * (1 + 1e-12))  # a cost that is exactly q tokens' must give q, not q - 1 (0.25 / 0.001 = 249.99..)
        while q > 0 and self.chunk_cost(q, ctx) > left * (1 + 1e-12):  # float rounding at the boundary
            q -= 1
        return q


def efficient_tokens(fixed: float, model: StepCostModel, max_tokens: int) -> int:
    """The compute-efficient prompt forward at context 0: the smallest size (MIN_BUDGET doubled) whose doubling
    lowers a token's cost, (fixed + chunk_cost(q, 0)) / q, by less than EFFICIENT_GAIN; at most `max_tokens`."""
    def per_token(n: int) -> float:
        return (fixed + model.chunk_cost(n, 0)) / n

    q = min(MIN_BUDGET, max_tokens)
    while 2 * q <= max_tokens and per_token(2 * q) < (1.0 - EFFICIENT_GAIN) * per_token(q):
        q *= 2
    return q


def fit_costs(samples: list[tuple[int, int, float]]) -> StepCostModel:
    """Least squares over (chunk tokens, context, seconds). Noise on a shared host can make a term negative:
    it is dropped (0) and the rest refitted, so every term stays a cost."""
    q, ctx, t = (np.array(col, dtype=np.float64) for col in zip(*samples))
    columns = {"fixed": np.ones_like(q), "per_token": q, "per_key": q * (ctx + q), "per_context": ctx}
    if len(set(ctx.tolist())) < 2:
        del columns["per_key"], columns["per_context"]  # one context: attention cannot be told from per_token
    elif len({qi for qi, c in zip(q.tolist(), ctx.tolist()) if c > 0}) < 2:
        del columns["per_context"]  # one size at a context: reading it cannot be told from attending to it
    if len(set(q.tolist())) < 2:
        columns.pop("fixed")  # one size (a tiny KV pool): a cost per token only
    # Relative residuals: a 512-token forward's noise must not swamp what a 16-token one says of the fixed cost
    w = 1.0 / np.maximum(t, 1e-9)
    while True:
        a = np.stack(list(columns.values()), axis=1) * w[:, None]
        x, *_ = np.linalg.lstsq(a, t * w, rcond=None)
        coef = dict(zip(columns, x.tolist()))
        negative = [name for name, v in coef.items() if v < 0]
        if not negative or len(columns) == 1:
            return StepCostModel(**{name: max(v, 0.0) for name, v in coef.items()})
        del columns[negative[0]]


@dataclass(frozen=True, slots=True)
class PrefillBudget:
    """What a mixed step may hold. A fixed budget counts the step's tokens, decode rows included (`tokens`).
    A calibrated one bounds the step's cost at `multiple` x the running batch's decode step: the step costs that
    decode step plus its prompt chunks' `chunk_cost` (`PrefillPacer` keeps both true while serving); `tokens`
    is then what a step takes at context 0 beside one decoding request, for the ready line."""

    tokens: int
    model: StepCostModel
    how: str  # for the ready line
    max_tokens: int  # no chunk is larger
    multiple: float | None = None  # calibrated: the bound, in decode steps; None: a fixed token budget
    decode_s: float = 0.0  # calibrated: the decode step at batch 1 timed at start-up
    efficient: int = 0  # calibrated: the compute-efficient prompt forward at start-up (`efficient_tokens`)
    # Mixed steps run as one forward (`StepEngine.run_mixed`): the chunks share the decode rows' pass over the
    # weights, so they add no forward's fixed cost, and the step's rows, not the chunks alone, make it efficient.
    fused: bool = False

    @classmethod
    def fixed_tokens(cls, tokens: int) -> PrefillBudget:
        return cls(tokens, StepCostModel(per_token=1.0), f"{tokens} tokens a step (--max-num-batched-tokens)",
                   max_tokens=tokens)

    def describe(self) -> str:
        return f"chunked prefill {self.how}"

    def chunk(self, left: float, ctx: int, remaining: int, floor: float | None = None) -> int:
        """A chunk of a prompt with `remaining` tokens to go at context `ctx` whose cost fits `left`, or whose cost
        beyond reading the context fits `floor` where that is more, and then at least one token. Every running
        request decodes in every mixed step, even past the budget (a stream never waits for a prompt); the step's
        first chunk gets a floor (`PrefillPacer.plan`: a quarter of an empty step's room), so prompts are never
        starved."""
        q = self.model.tokens_within(left, ctx)
        if floor is not None:  # the floor buys tokens beyond the context's read, or late chunks shrink to one
            q = max(q, self.model.tokens_within(floor + self.model.per_context * ctx, ctx), 1)
        return min(q, remaining, self.max_tokens)

    def chunk_cost(self, q: int, ctx: int) -> float:
        return self.model.chunk_cost(q, ctx)


def choose_budget(model: StepCostModel, decode_s: float, multiple: float, max_tokens: int,
                  measured_s: float = 0.0, measured_up_to: int | None = None, fused: bool = False) -> PrefillBudget:
    """A mixed step may cost `multiple` x its batch's decode step: the decode step, then prompt chunks that cost
    at most (multiple - 1) decode steps (less a prompt forward's fixed cost where they run as a forward of their
    own: not `fused`), and never less than the compute-efficient size (`efficient_tokens` of the fitted model:
    the fit pools every probe, where the knee of the raw curve moved with one noisy probe, 16 instead of 128 on a
    loaded host; fused, the step's rows count towards it), never past the largest size timed
    (`measured_up_to`). `tokens`: what that leaves beside one decoding request at context 0, at most
    `max_tokens`. With no stream to protect, prompts are prefilled whole (`PrefillPacer.room`)."""
    efficient = efficient_tokens(model.fixed, model, min(measured_up_to or max_tokens, max_tokens))
    fixed = 0.0 if fused else model.fixed
    floor = max(efficient - 1, 1) if fused else efficient
    tokens = max(floor, min(model.tokens_within((multiple - 1) * decode_s - fixed, 0), max_tokens))
    how = (f"calibrated to an ITL target of {multiple:g} x the running streams' decode step "
           f"({multiple * decode_s * 1e3:.1f} ms at batch 1 at start-up): {tokens} prompt tokens a step at context 0 "
           f"beside one stream, never below {efficient}{' rows a step' if fused else ''} (compute-efficient: a "
           f"token's cost stops falling there), "
           f"whole prompts up to {max_tokens} with none; "
           f"prompt forwards {model.fixed * 1e3:.1f} ms + {model.per_token * 1e3:.2f} ms/token + "
           f"{model.per_key * 1e6:.3f} us/token/key + {model.per_context * 1e6:.1f} us/key of context beyond it "
           f"(measured in {measured_s:.1f} s){'; chunks share the decode rows forward' if fused else ''}")
    return PrefillBudget(tokens, model, how, max_tokens, multiple, decode_s, efficient, fused)


# ---- timing (the real step engine) -------------------------------------------------------------------------
DECODE_CONTEXT = 128
# (tokens, context): the cost curve at context 0, doubling up to past where a token's cost stops falling on the
# hosts measured (SmolLM2: ~128-256 on a 2-core AVX-512 host), which fixes fixed / per_token and the
# compute-efficient size; and two sizes far in, which tell per_key (grows with the size) from per_context (does
# not). Sizes past max_prefill_tokens or the KV cache are skipped.
CURVE = (16, 32, 64, 128, 256, 512)
CHUNKS = (*((q, 0) for q in CURVE), (8, 1024), (32, 1024))
MARGIN = 8  # positions past a probe's tokens that a step may write (the proposer's look-ahead)


@dataclass(frozen=True, slots=True)
class StepCosts:
    decode_s: float  # a plain decode step at batch 1 (median)
    chunks: tuple[tuple[int, int, float], ...]  # (tokens, context, median seconds) of single prompt chunks
    measured_s: float  # what timing them cost


def measure_step_costs(engine, num_pages: int, page_size: int, max_len: int, repeats: int = 3,
                       max_tokens: int = 1 << 30, clock: Callable[[], float] = time.perf_counter) -> StepCosts:
    """Time a plain decode step at batch 1 and prompt chunks of the real engine, each shape once per round so
    that a noisy neighbour slows them alike; medians of `repeats` rounds (no warm-up round: the memory plan's
    warm-up already ran these forwards, and on SmolLM2 on CPU a first round measured no slower; a median of
    three outlasts one slow call). Runs before any request: it writes KV into pages 1.. and the proposer's slot
    0, which the first requests overwrite."""
    room = min((num_pages - 1) * page_size, max_len) - MARGIN  # pages 1.. (page 0 is the dummy page)
    shapes = list(dict.fromkeys((q, max(0, min(ctx, room - q))) for q, ctx in CHUNKS
                                if q <= min(room, max_tokens)))
    decode_ctx = max(1, min(DECODE_CONTEXT, room - 1))
    pages = list(range(1, num_pages))
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def probe(q: int, ctx: int) -> Request:
        req = Request("calibration", [0] * (ctx + q), params, seed=0)
        req.num_computed, req.slot = ctx, 0
        req.page_table = pages[: -(-(ctx + q + MARGIN) // page_size)]
        return req

    def decode() -> None:
        req = probe(1, decode_ctx - 1)  # running: num_computed == len(token_ids) - 1
        engine.run_decode(engine.plan_decode([req], np.zeros(1, np.int64), refill=False)).read()

    def chunk(q: int, ctx: int) -> None:
        engine.prefill([probe(q, ctx)], False, [q]).tolist()

    start = clock()
    times: dict[tuple, list[float]] = {("decode",): [], **{s: [] for s in shapes}}
    for _ in range(repeats):
        for key in times:
            t0 = clock()
            decode() if key == ("decode",) else chunk(*key)
            times[key].append(clock() - t0)
    med = {key: float(np.median(ts)) for key, ts in times.items()}
    return StepCosts(med.pop(("decode",)), tuple((q, ctx, t) for (q, ctx), t in med.items()), clock() - start)


def resolve_budget(cfg: EngineConfig, engine, num_pages: int, max_len: int,
                   fused: bool = False) -> PrefillBudget | None:
    """The engine's budget (None: chunked prefill off), once its KV pools exist (`scheduler.build`); `fused`: its
    mixed steps run as one forward (`StepEngine.fuses_mixed`)."""
    if cfg.chunked_prefill == "off":
        return None
    if cfg.chunked_prefill == "fixed":
        return PrefillBudget.fixed_tokens(cfg.max_num_batched_tokens)
    costs = measure_step_costs(engine, num_pages, cfg.page_size, max_len, max_tokens=cfg.max_prefill_tokens)
    return choose_budget(fit_costs(list(costs.chunks)), costs.decode_s, cfg.max_step_latency,
                         cfg.max_prefill_tokens, costs.measured_s, max(q for q, ctx, _ in costs.chunks if ctx == 0),
                         fused)
