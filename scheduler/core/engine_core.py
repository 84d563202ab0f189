"""The engine core: the loop that launches the scheduler's plans (`scheduler/core/scheduler.py`) on the device
stream, chains decode steps, and hands each step's results back.

`step()` returns the outputs of one finished step. Prefill steps, and with a token budget the mixed steps of
chunked prefill (the batch's decode step and the step's prompt chunks, in one forward where the engine fuses
them), run synchronously.
Decode steps are pipelined when the stream overlaps (CPU worker thread or CUDA stream):

    scheduler thread:  [plan+build N+1] [wait N][process N]  [plan+build N+2] [wait N+1][process N+1]
    device stream:     ......... step N ..........][......... step N+1 ..........][......... step N+2 ...

Step N+1 is built before step N's accepted lengths are known: pages are reserved for the upper bound (every
draft accepted), and the device patches starts and last tokens from step N's outputs (`engine.step_context.
Chain`). A request that finishes in step N still rides along in step N+1 as a wasted lane, so its pages and
slot are released only once no step in flight includes it. A chained plan that cannot run as decided is
dropped before anything of it is counted, and the next step is planned after step N is read back. The offline
`generate` and the scheduler process both drive this class; it owns no sockets.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from specstep.engine.step_context import Chain, DecodePlan
from specstep.engine.step_engine import StepEngine, StepOutput
from specstep.engine.stream import DeviceStream, InlineStream, StepHandle
from specstep.scheduler.core.page_allocator import PageAllocator
from specstep.scheduler.core.scheduler import ModelFacts, Pacing, Scheduler, SchedulerConfig
from specstep.scheduler.core.step_plan import StepKind, StepPlan
from specstep.scheduler.core.stopping import RequestOutput
from specstep.scheduler.spec.policy import AdaptivePolicy, PolicyConfig
from specstep.traces import ranges
from specstep.traces.tracer import NULL_TRACER, Tracer

__all__ = ["EngineCore", "InFlight", "RequestOutput", "SchedulerConfig"]


@dataclass(slots=True)
class InFlight:
    plan: StepPlan
    handle: StepHandle[StepOutput]
    num_draft: np.ndarray  # [B] what the step really drafts (n-gram may match fewer; a stale draft none)
    refilled: np.ndarray  # [B] lanes whose draft is current after the step (current at launch, and it refills)
    catch_up_s: float  # the catch-up this step paid before it ran
    launched: float  # clock before its batch was built


class EngineCore:
    def __init__(self, step_engine: StepEngine, allocator: PageAllocator, config: SchedulerConfig,
                 eos_token_ids: tuple[int, ...] = (), policy: AdaptivePolicy | None = None,
                 stream: DeviceStream | None = None, tracer: Tracer = NULL_TRACER,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine = step_engine
        self.clock = clock  # step costs when inline (a test harness injects simulated device time)
        self.stream = stream or InlineStream()
        self.tracer = tracer
        self.inflight: InFlight | None = None
        self.chained_steps = 0  # decode steps built while the previous one ran (overlap)
        self.steps_run = 0  # steps launched: prefill, mixed and decode (chained ones included)
        self.mixed_steps = 0  # of them, mixed: decode rows and prompt chunks in one step
        policy = policy or AdaptivePolicy(PolicyConfig(kind="fixed", k_max=config.num_spec_tokens,
                                                       keeps_draft_kv=step_engine.has_draft_model))
        self.scheduler = Scheduler(ModelFacts.of(step_engine), allocator, config, policy, eos_token_ids, tracer)
        self.results = self.scheduler.results  # where each step's results go once read back

    # ---- the scheduler's state, for the process loop, `generate` and tests -------------------------------------
    @property
    def config(self) -> SchedulerConfig:
        return self.scheduler.config

    @property
    def allocator(self) -> PageAllocator:
        return self.scheduler.allocator

    @property
    def policy(self) -> AdaptivePolicy:
        return self.scheduler.policy

    @policy.setter
    def policy(self, policy: AdaptivePolicy) -> None:  # tests script decisions
        self.scheduler.policy = policy

    @property
    def running(self):
        return self.scheduler.queues.running

    @property
    def waiting(self):
        return self.scheduler.queues.waiting

    @property
    def prefilling(self):
        return self.scheduler.queues.prefilling

    @property
    def last_decision(self):
        return self.scheduler.last_decision

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.queues.num_preemptions

    @property
    def lookahead(self) -> int:
        return self.scheduler.facts.lookahead

    @property
    def chunked(self) -> bool:
        return self.scheduler.chunks is not None

    def pacing(self) -> Pacing | None:
        """The chunked-prefill pacer's figures at the current batch (None: whole-prompt prefill)."""
        return self.scheduler.pacing(self.mixed_steps / self.steps_run if self.steps_run else 0.0)

    def add_request(self, req) -> None:
        self.scheduler.add_request(req)

    def abort(self, request_id: str):
        return self.scheduler.abort(request_id)

    def page_tables(self) -> list[list[int]]:
        return self.scheduler.queues.page_tables()

    def check_integrity(self) -> None:
        self.allocator.check_integrity(self.page_tables())

    def has_unfinished(self) -> bool:
        return self.scheduler.queues.has_unfinished() or self.inflight is not None

    @property
    def tensor_parallel_size(self) -> int:
        return self.engine.tp.world_size

    @property
    def overlap(self) -> bool:
        return not isinstance(self.stream, InlineStream)

    def close(self, failed: bool = False) -> None:
        """Stop the device stream, then (tensor parallelism) release the follower ranks; `failed`: after an
        error, when ranks may be stuck in a step this process left."""
        self.stream.close()
        self.engine.close(failed)
        self.policy.close()  # stores the measured step costs for the next run

    # ---- one step --------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.inflight is None:
            with self.tracer.range(ranges.SCHEDULE):
                plan = self.scheduler.schedule()
            if plan.kind is StepKind.NONE:
                return list(plan.finished)
            self.steps_run += 1
            self.mixed_steps += plan.kind is StepKind.MIXED
            if plan.kind is StepKind.PREFILL:
                return self._prefill(plan)
            if plan.kind is StepKind.MIXED:
                return self._mixed(plan)
            self.inflight = self._launch(plan, self._catch_up(plan), None)
        return self._advance()

    def _advance(self) -> list[RequestOutput]:
        """Build and launch the next step while the current one runs (if possible), then complete it."""
        cur = self.inflight
        nxt = None
        if self.overlap and not self.scheduler.wants_admission():
            with self.tracer.range(ranges.SCHEDULE):
                plan = self.scheduler.schedule_chained(cur.plan, cur.num_draft, cur.refilled, self.engine.can_chain)
            if plan is not None:
                nxt = self._launch(plan, 0.0, cur)
                self.chained_steps += 1
                self.steps_run += 1
        outputs = self._complete(cur)
        self.inflight = nxt
        return outputs

    def _prefill(self, plan: StepPlan) -> list[RequestOutput]:
        batch = [r for r, _ in plan.prompts]
        with_proposer = plan.with_proposer[0]
        handle = self.stream.submit(ranges.PREFILL, lambda: self.engine.prefill(batch, with_proposer))
        with self.tracer.range(ranges.WAIT):
            tokens = handle.wait().tolist()  # host sync: the new tokens decide what happens next
        with self.tracer.range(ranges.PROCESS_OUTPUT):
            return self.results.finish_prefill(plan, tokens)

    def _mixed(self, plan: StepPlan) -> list[RequestOutput]:
        """The running batch's decode step as decided (drafts, verify, acceptance, refill: speculation goes on
        while prompts prefill) and the prompt chunks. Where the engine fuses them (`fuses_mixed`), one forward
        holds both; else the decode step runs, then a prompt forward over the chunks, in stream order. The
        streams' tokens are counted as a decode step's; what the chunks add goes to the pacer."""
        if not plan.decode:
            return self._chunks(plan, None)
        catch_up_s = self._catch_up(plan)
        launched = self.clock()
        ctx, refilled = self._build(plan, None)
        # A step taken to time a candidate runs apart from the chunks: fused, its cost could not be told
        if self.engine.fuses_mixed(ctx) and not plan.decision.measures:
            return self._fused(plan, ctx, refilled, catch_up_s, launched)
        handle = self.stream.submit(ranges.DECODE, lambda: self.engine.run_decode(ctx))
        cur = InFlight(plan, handle, ctx.num_draft, refilled, catch_up_s, launched)
        if self.overlap:  # the prompt forward is queued behind it: its outputs are processed meanwhile
            return self._chunks(plan, cur)
        return self._complete(cur) + self._chunks(plan, None)  # inline: it ran at launch; timed as any other

    def _chunks(self, plan: StepPlan, cur: InFlight | None) -> list[RequestOutput]:
        """A prompt forward over the plan's chunks; `cur`: the decode step queued before it, completed while it
        runs."""
        seqs = [r for r, _ in plan.prompts]
        q_lens = [q for _, q in plan.prompts]
        start = self.clock()
        handle = self.stream.submit(ranges.PREFILL,
                                    lambda: self.engine.prefill(seqs, list(plan.with_proposer), q_lens))
        outputs = self._complete(cur) if cur is not None else []
        with self.tracer.range(ranges.WAIT):
            tokens = handle.wait().tolist()
        seconds = handle.device_seconds() if self.overlap else self.clock() - start
        with self.tracer.range(ranges.PROCESS_OUTPUT):
            return outputs + self.results.finish_chunks(plan, tokens, seconds)

    def _fused(self, plan: StepPlan, ctx: DecodePlan, refilled: np.ndarray, catch_up_s: float,
               launched: float) -> list[RequestOutput]:
        """A mixed step in one forward. Its decode rows cost what the policy predicted for the batch's decode
        step (`plan.decode_s`): the policy's step costs learn from decode steps alone, and the pacer learns what
        the chunks add beyond that prediction. With no prediction (nothing timed yet) the pacer learns nothing,
        and the policy's governor takes the whole step as the decode rows' cost (an upper bound)."""
        seqs = [r for r, _ in plan.prompts]
        q_lens = [q for _, q in plan.prompts]
        handle = self.stream.submit(ranges.MIXED,
                                    lambda: self.engine.run_mixed(ctx, seqs, list(plan.with_proposer), q_lens))
        with self.tracer.range(ranges.WAIT):
            out, prompt_tokens = handle.wait()
            accepted, tokens = out.read()
            prompt_tokens = prompt_tokens.tolist()
        seconds = handle.device_seconds() if self.overlap else self.clock() - launched
        decode_s = plan.decode_s
        with self.tracer.range(ranges.PROCESS_OUTPUT):
            outputs = self.results.finish_decode(plan, out.num_draft.tolist(), refilled, accepted, tokens)
            outputs += self.results.finish_chunks(plan, prompt_tokens,
                                                  None if decode_s is None else max(seconds - decode_s, 0.0))
        d = plan.decision
        self.policy.observe_step(len(plan.decode), out.num_draft, d.refill, seconds if decode_s is None else decode_s,
                                 tokens=len(plan.decode) + sum(accepted), catch_up_s=catch_up_s,
                                 auto_drafted=d.auto_drafts(out.num_draft), timed=False)
        return outputs

    def _catch_up(self, plan: StepPlan) -> float:
        """The proposer skipped tokens while its refill was dropped; resync before it drafts. Its cost is charged
        to this step (`InFlight.catch_up_s`): resuming speculation pays it."""
        stale = list(plan.catch_up)
        if not stale:
            return 0.0
        lens = [r.draft_len for r in stale]
        t = self.clock()
        self.stream.submit(ranges.CATCH_UP, lambda: self.engine.catch_up(stale, lens)).wait()
        seconds = self.clock() - t
        self.results.caught_up(stale, lens, seconds)
        return seconds

    def _launch(self, plan: StepPlan, catch_up_s: float, prev: InFlight | None) -> InFlight:
        """`prev`: the step in flight a chained plan builds on."""
        launched = self.clock()
        ctx, refilled = self._build(plan, prev)
        handle = self.stream.submit(ranges.DECODE, lambda: self.engine.run_decode(ctx))
        return InFlight(plan, handle, ctx.num_draft, refilled, catch_up_s, launched)

    def _build(self, plan: StepPlan, prev: InFlight | None) -> tuple[DecodePlan, np.ndarray]:
        """The plan's decode step built on the host (counted as launched), and its lanes whose draft is current
        after it."""
        batch = list(plan.decode)
        chain = None
        if plan.chained:
            chain = Chain(prev=prev.handle, src=plan.chain_src, dst=np.arange(len(batch), dtype=np.int64))
        with self.tracer.range(ranges.BUILD_BATCH, batch=len(batch)):
            ctx = self.engine.plan_decode(batch, plan.decision.num_draft, chain, plan.decision.refill)
        return ctx, self.scheduler.launched(plan, ctx.num_draft)

    def _complete(self, inf: InFlight) -> list[RequestOutput]:
        with self.tracer.range(ranges.WAIT):
            out = inf.handle.wait()
            accepted, tokens = out.read()  # the step's one host sync
        with self.tracer.range(ranges.PROCESS_OUTPUT):
            outputs = self.results.finish_decode(inf.plan, out.num_draft.tolist(), inf.refilled, accepted, tokens)
        # The step's cost for the policy: device time when host work is hidden behind it (overlap); inline,
        # the whole step from build to processed outputs, since the host part then adds to every step too.
        cost = inf.handle.device_seconds() if self.overlap else self.clock() - inf.launched
        d = inf.plan.decision
        self.policy.observe_step(len(inf.plan.decode), out.num_draft, d.refill, cost,
                                 tokens=len(inf.plan.decode) + sum(accepted), catch_up_s=inf.catch_up_s,
                                 auto_drafted=d.auto_drafts(out.num_draft))
        return outputs
