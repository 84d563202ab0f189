"""A simulated step engine for driving the real `EngineCore` and policy with injected step costs and acceptance
(no model): device time is a virtual clock the engine core reads, so throughput figures are exact and fast.

A scenario gives the cost of a step, cost(batch, num_draft, refill, tokens_so_far) in seconds, and each
request's per-position acceptance, alpha(request_id, tokens_so_far). Catch-up after dropped refills costs
`catch_up_per_token` per skipped token. `off_cost`: what a model proposer adds to a step in which nobody drafts,
as a fraction of that step's cost (its bookkeeping while off; a plain engine, without a proposer, never pays it).
Tokens are all 1 (no EOS): requests end at max_tokens.

`overlap=True` runs the core on `SimStream`, a stream that is not an `InlineStream`, so the core takes the
pipelined path a GPU runs (step N+1 decided and launched before step N is read back), yet runs each job at
once on the virtual clock: deterministic, and its device seconds are simulated ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from specstep.engine.parallel.group import SINGLE, TPGroup
from specstep.engine.sampling_params import SamplingParams
from specstep.engine.step_engine import StepOutput
from specstep.engine.stream import DeviceStream, StepHandle, ThreadStream
from specstep.scheduler.core.engine_core import EngineCore, SchedulerConfig
from specstep.scheduler.core.page_allocator import PageAllocator
from specstep.scheduler.core.request import Request
from specstep.scheduler.spec.cost_store import StepCostStore
from specstep.scheduler.spec.policy import AdaptivePolicy, PolicyConfig


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SleepClock:
    """Real time: advancing it (`now += seconds`, as the simulated engine charges a step) sleeps, so the real
    streams (`InlineStream`, the worker-thread `ThreadStream`) time the steps, `device_seconds` included."""

    @property
    def now(self) -> float:
        return time.perf_counter()

    @now.setter
    def now(self, value: float) -> None:
        time.sleep(max(0.0, value - time.perf_counter()))

    def __call__(self) -> float:
        return time.perf_counter()


class SimStream(DeviceStream):
    """Synchronous, but not inline: the core chains steps as on CUDA; device time is the virtual clock's."""

    def __init__(self, clock: SimClock) -> None:
        self.clock = clock

    def submit(self, name, fn):
        handle = StepHandle(name)
        handle.device_start = self.clock()
        try:
            handle._result = fn()
        except BaseException as e:  # noqa: BLE001 (delivered to the waiter, as the real streams do)
            handle._error = e
        handle.device_end = self.clock()
        handle._done.set()
        return handle


@dataclass
class SimProposer:
    kind: str  # "mtp" (model: lanes, refill) or "ngram" (host: rows)
    kv_lookahead: int = 0
    shift: int = 0

    @property
    def has_model(self) -> bool:
        return self.kind != "ngram"

    def draft_limits(self, token_ids: list[list[int]], k: int) -> None:
        return None  # the scenarios draw acceptance per step: no lookup to tell in advance


@dataclass
class SimContext:
    seqs: list[Request]
    num_draft: np.ndarray
    refill: bool


@dataclass
class Scenario:
    cost: Callable[[int, np.ndarray, bool, int], float]
    alpha: Callable[[str, int], float]
    catch_up_per_token: float = 2e-5  # an MTP head: about 1 / num_layers of a prefill token
    prefill_per_token: float = 1e-5
    off_cost: float = 0.0  # a model proposer's cost in a step without drafts, as a fraction of that step


@dataclass
class SimStepEngine:
    scenario: Scenario
    clock: SimClock
    proposer: SimProposer | None
    seed: int = 0
    vocab_size: int = 1000
    device: torch.device = torch.device("cpu")
    tokens: int = 0  # emitted so far (scenarios change with it)
    steps: list[tuple[int, int, bool]] = field(default_factory=list)  # (batch, k, refill) per decode step
    trace: list[tuple[int, float]] = field(default_factory=list)  # (tokens emitted, clock) after each decode step
    fuses: bool = False  # mixed steps run as one forward (`run_mixed`), else a decode step and a prompt forward

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    tp: TPGroup = SINGLE

    @property
    def has_draft_model(self) -> bool:
        return self.proposer is not None and self.proposer.has_model

    def can_chain(self, num_draft: np.ndarray) -> bool:
        # As the real engine: a host proposer (n-gram) needs the previous step's tokens on the host to draft.
        return self.proposer is None or self.proposer.has_model or not np.asarray(num_draft).any()

    def close(self, failed: bool = False) -> None:
        pass

    def prefill(self, seqs, with_proposer=True, q_lens=None):
        n = sum(q_lens) if q_lens is not None else sum(len(s.token_ids) - s.num_computed for s in seqs)
        self.clock.now += self.scenario.prefill_per_token * n
        return torch.ones(len(seqs), dtype=torch.long)

    def fuses_mixed(self, ctx: SimContext) -> bool:
        return self.fuses

    def run_mixed(self, ctx: SimContext, seqs, with_proposer, q_lens):
        """The decode step, then what the chunks add to its forward (`chunks_in_step`)."""
        return self.run_decode(ctx), self.chunks_in_step(seqs, q_lens)

    def chunks_in_step(self, seqs, q_lens):
        self.clock.now += self.scenario.prefill_per_token * sum(q_lens)
        return torch.ones(len(seqs), dtype=torch.long)

    def catch_up(self, seqs, draft_lens):
        self.clock.now += self.scenario.catch_up_per_token * sum(len(s.token_ids) - n for s, n in zip(seqs, draft_lens))

    def plan_decode(self, seqs, num_draft, chain=None, refill=True):
        nd = np.asarray(num_draft, dtype=np.int64).copy()
        if self.proposer is None or (self.has_draft_model and not refill):
            nd[:] = 0
        return SimContext(seqs, nd, refill)

    def run_decode(self, ctx: SimContext) -> StepOutput:
        b, nd = len(ctx.seqs), ctx.num_draft
        k = int(nd.max(initial=0))
        cost = self.scenario.cost(b, nd, ctx.refill and self.has_draft_model, self.tokens)
        if k == 0 and self.has_draft_model:
            cost *= 1.0 + self.scenario.off_cost
        self.clock.now += cost
        accepted = np.zeros(b, dtype=np.int64)
        for i, s in enumerate(ctx.seqs):
            a = self.scenario.alpha(s.request_id, self.tokens)
            while accepted[i] < nd[i] and self.rng.random() < a:
                accepted[i] += 1
        self.tokens += int(accepted.sum()) + b
        self.steps.append((b, k, ctx.refill))
        self.trace.append((self.tokens, self.clock.now))
        return StepOutput(out_tokens=torch.ones(b, k + 1, dtype=torch.long), num_accepted=torch.from_numpy(accepted),
                          num_draft=nd, start=torch.zeros(b, dtype=torch.long))


@dataclass
class SimResult:
    tokens: int
    seconds: float
    steps: list[tuple[int, int, bool]]
    requests: list[Request]
    core: EngineCore
    chosen_k: list[int]  # the policy's own choice of k after each step (not explorations, re-measurements, probes)
    trace: list[tuple[int, float]]  # (tokens emitted, clock) after each decode step

    def throughput_from(self, tokens: int) -> float:
        """Tokens per second from the first step that ended at or past `tokens` emitted to the last step."""
        start = next(i for i, (t, _) in enumerate(self.trace) if t >= tokens)
        (t0, c0), (t1, c1) = self.trace[start], self.trace[-1]
        return (t1 - t0) / (c1 - c0)

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds

    def k_switches(self) -> int:
        ks = self.chosen_k
        return sum(a != b for a, b in zip(ks, ks[1:]))

    def speculating(self, lo: float = 0.0, hi: float = 1.0) -> float:
        """Fraction of decode steps in [lo, hi) of the run (by step index) that drafted."""
        part = self.steps[int(lo * len(self.steps)): int(hi * len(self.steps))]
        return sum(k > 0 for _, k, _ in part) / max(len(part), 1)


def simulate(scenario: Scenario, proposer: str | None, arrivals: list[tuple[int, str, int | None]],
             max_tokens: int, policy: PolicyConfig | None = None, seed: int = 0, overlap: bool = False,
             prompt_len: int = 3, real_time: bool = False, store: StepCostStore | None = None) -> SimResult:
    """arrivals: (tokens emitted when it arrives, request id, fixed k or None) per request. `real_time`: costs
    are slept and the core runs on the real streams (overlap: the CPU worker thread) and the real clock. `store`:
    the policy's step costs carried across runs (loaded at start, written when the core closes)."""
    clock = SleepClock() if real_time else SimClock()
    engine = SimStepEngine(scenario, clock, SimProposer(proposer) if proposer else None, seed=seed)
    k_max = policy.k_max if policy is not None else 0
    pol = AdaptivePolicy(policy, store) if policy is not None else None
    core = EngineCore(engine, PageAllocator(8192, 16), SchedulerConfig(max_batch_size=64, num_spec_tokens=k_max,
                                                                        max_model_len=100_000),
                      policy=pol, clock=clock,
                      stream=(ThreadStream() if real_time else SimStream(clock)) if overlap else None)
    start = clock.now
    pending = sorted(arrivals, key=lambda a: a[0])
    reqs, chosen = [], []
    while pending or core.has_unfinished():
        while pending and pending[0][0] <= engine.tokens:
            _, rid, k = pending.pop(0)
            params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
            reqs.append(Request(rid, [1] * prompt_len, params, seed=1, num_spec_tokens=k))
            core.add_request(reqs[-1])
        if not core.has_unfinished():  # idle until the next arrival: jump there
            engine.tokens = pending[0][0]
            continue
        core.step()
        chosen.append(core.policy.current_k)
    core.check_integrity()
    core.close()
    # Tokens the requests received: with overlap, a lane of a request that finished one step earlier is wasted.
    return SimResult(sum(r.num_output_tokens for r in reqs), clock.now - start, engine.steps, reqs, core, chosen,
                     engine.trace)
