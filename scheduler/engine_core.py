"""The engine core: admission, continuous batching, preemption by recompute, stop conditions, and the
pipelined decode loop that hides batch preparation behind device work.

`step()` returns the outputs of one finished batch. Prefill batches, and with a token budget the mixed steps of
chunked prefill (`scheduler/chunked_prefill.py`), run synchronously. Decode steps are
pipelined when the stream overlaps (CPU worker thread or CUDA stream):

    scheduler thread:  [schedule+build N+1] [wait N][process N]  [schedule+build N+2] [wait N+1][process N+1]
    device stream:     ......... step N ..........][......... step N+1 ..........][......... step N+2 ...

Step N+1 is built before step N's accepted lengths are known: pages are reserved for the upper bound (every
draft accepted), and the device patches starts and last tokens from step N's outputs (`engine.step_context.
Chain`). A request that finishes in step N still rides along in step N+1 as a wasted lane, so its pages and
slot are released only once no step in flight includes it. The offline `generate` and the scheduler process
both drive this class; it owns no sockets.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from specstep.engine.errors import InvalidRequestError
from specstep.engine.step_context import Chain
from specstep.engine.step_engine import StepEngine, StepOutput
from specstep.engine.stream import DeviceStream, InlineStream, StepHandle
from specstep.scheduler.chunked_prefill import ChunkedPrefill
from specstep.scheduler.page_allocator import PageAllocator
from specstep.scheduler.prefill_budget import PrefillBudget
from specstep.scheduler.prefill_pacer import PrefillPacer
from specstep.scheduler.request import FinishReason, Request, Status
from specstep.scheduler.spec_decision import Decision
from specstep.scheduler.spec_policy import AdaptivePolicy, PolicyConfig
from specstep.scheduler.stopping import RequestOutput, Stopping
from specstep.traces import ranges
from specstep.traces.tracer import NULL_TRACER, Tracer

log = logging.getLogger("specstep.engine")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_size: int = 64
    max_prefill_tokens: int = 4096
    prefill_budget: PrefillBudget | None = None  # chunked prefill mixed with decoding (None: whole-prompt steps)
    num_spec_tokens: int = 0  # k for every request unless overridden (0 = speculation off)
    max_model_len: int = 2048
    spec_max_len: int | None = None  # the draft's own context limit: requests past it stop speculating


@dataclass(slots=True)
class InFlight:
    batch: list[Request]
    handle: StepHandle[StepOutput]
    chainable: bool  # the next step may be built before this one is read back
    decision: Decision  # as the policy made it (never changed)
    num_draft: np.ndarray  # [B] what the step really drafts (n-gram may match fewer; a stale draft none)
    refilled: np.ndarray  # [B] lanes whose draft is current after the step (current at launch, and it refills)
    catch_up_s: float  # the catch-up this step paid before it ran
    launched: float  # perf_counter before its batch was built


class EngineCore(ChunkedPrefill, Stopping):
    def __init__(self, step_engine: StepEngine, allocator: PageAllocator, config: SchedulerConfig,
                 eos_token_ids: tuple[int, ...] = (), policy: AdaptivePolicy | None = None,
                 stream: DeviceStream | None = None, tracer: Tracer = NULL_TRACER,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine = step_engine
        self.clock = clock  # step costs when inline (a test harness injects simulated device time)
        self.stream = stream or InlineStream()
        self.tracer = tracer
        self.inflight: InFlight | None = None
        self._inflight_count: dict[int, int] = {}  # id(request) -> steps in flight that include it
        self._pending_release: list[Request] = []  # finished, but a step in flight still includes them
        self.allocator = allocator
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.policy = policy or AdaptivePolicy(PolicyConfig(kind="fixed", k_max=config.num_spec_tokens,
                                                            keeps_draft_kv=step_engine.has_draft_model))
        self.last_decision: Decision | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefilling: list[Request] = []  # chunked prefill: admitted, prompt part-way through (oldest first)
        self.pacer = PrefillPacer(config.prefill_budget) if config.prefill_budget else None
        self.requests: dict[str, Request] = {}
        self._free_slots = list(range(config.max_batch_size - 1, -1, -1))
        self.lookahead = step_engine.proposer.kv_lookahead if step_engine.proposer else 0
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {req.request_id!r}")
        n = len(req.prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt is empty")
        vocab = self.engine.vocab_size
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if n + 1 > self.config.max_model_len:
            limit = self.config.max_model_len - 1
            raise InvalidRequestError(f"prompt has {n} tokens; the model allows at most {limit}")
        if n > self.allocator.max_prompt_tokens(self.lookahead):
            raise InvalidRequestError(f"prompt of {n} tokens does not fit the KV cache")
        req.params.validate(vocab)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        if req.status == Status.WAITING:
            self.waiting.remove(req)
        self._finish(req, FinishReason.ABORT)
        return req

    @property
    def tensor_parallel_size(self) -> int:
        tp = getattr(self.engine, "tp", None)  # simulated engines in tests have none
        return tp.world_size if tp is not None else 1

    def close(self, failed: bool = False) -> None:
        """Stop the device stream, then (tensor parallelism) release the follower ranks; `failed`: after an
        error, when ranks may be stuck in a step this process left."""
        self.stream.close()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close(failed)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling or self.inflight)

    def page_tables(self) -> list[list[int]]:
        return [r.page_table for r in (*self.running, *self.prefilling, *self._pending_release)]

    def check_integrity(self) -> None:
        self.allocator.check_integrity(self.page_tables())

    @property
    def overlap(self) -> bool:
        return not isinstance(self.stream, InlineStream)

    # ---- one step --------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.inflight is None:
            if self.chunked:
                with self.tracer.range(ranges.SCHEDULE):
                    chunks = self._schedule_chunks()
                if chunks:
                    return self._mixed(chunks)
                if self.prefilling and not self.running:  # cannot happen by the admission rule; never spin
                    log.warning("no prefill chunk fits the KV cache; preempting %s", self.prefilling[-1].request_id)
                    self._preempt(self.prefilling[-1])
                    return []
            else:
                with self.tracer.range(ranges.SCHEDULE):
                    admitted = self._admit()
                if admitted:
                    return self._prefill(admitted)
            if not self.running:
                return []
            with self.tracer.range(ranges.SCHEDULE):
                decision, outputs = self._reserve()
            if decision is None:
                return outputs
            batch = list(self.running)
            caught = self._catch_up(batch, decision)
            self.inflight = self._launch(batch, decision, None, caught)
        return self._advance()

    def _advance(self) -> list[RequestOutput]:
        """Build and launch the next step while the current one runs (if possible), then complete it."""
        cur = self.inflight
        nxt = self._launch_chained(cur) if cur.chainable and not self._wants_admission() else None
        outputs = self._complete(cur)
        self.inflight = nxt
        return outputs

    def _wants_admission(self) -> bool:
        if self.prefilling:
            return True
        if not self.waiting or len(self.running) >= self.config.max_batch_size:
            return False
        req = self.waiting[0]
        return self.allocator.can_fit(req.page_table, self._step_tokens(len(req.token_ids)))

    def _admit(self) -> list[Request]:
        batch: list[Request] = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.config.max_batch_size:
            req = self.waiting[0]
            n = len(req.token_ids)
            if batch and tokens + n > self.config.max_prefill_tokens:
                break
            if not self.allocator.can_fit(req.page_table, self._step_tokens(n)):
                break
            self.waiting.popleft()
            self.allocator.ensure(req.page_table, self._step_tokens(n))
            req.slot = self._free_slots.pop()
            req.status = Status.RUNNING
            batch.append(req)
            tokens += n
        return batch

    def _prefill(self, batch: list[Request]) -> list[RequestOutput]:
        # While speculation is off the proposer skips the prompt too (it catches up if speculation resumes):
        # "off" costs what plain decoding costs, prefill included.
        with_proposer = self.policy.proposer_current
        handle = self.stream.submit(ranges.PREFILL, lambda: self.engine.prefill(batch, with_proposer))
        with self.tracer.range(ranges.WAIT):
            tokens = handle.wait().tolist()  # host sync: the new tokens decide what happens next
        now = time.monotonic()
        with self.tracer.range(ranges.PROCESS_OUTPUT):
            for req in batch:
                req.num_computed = len(req.token_ids)
            return [self._start_decoding(req, tok, with_proposer, now) for req, tok in zip(batch, tokens)]

    def _start_decoding(self, req: Request, token: int, with_proposer: bool, now: float) -> RequestOutput:
        """Its prompt is prefilled and `token` sampled after it: the request joins the running batch."""
        # The draft consumed the prompt and the sampled token, or (skipped) nothing it needs: a head never
        # consumes t[0] (shift 1), a draft model starts at it.
        shift = self.engine.proposer.shift if self.engine.has_draft_model else 0
        req.draft_len = len(req.token_ids) + 1 if with_proposer else shift
        req.status = Status.RUNNING
        self.running.append(req)
        if req.first_token_time is None:
            req.first_token_time = now
        return self._append(req, [token])

    def _decide(self, reqs: list[Request], pending: np.ndarray | None = None, cur: InFlight | None = None) -> Decision:
        """k per request from the policy, capped so no step drafts past max_tokens, the model's length or the
        draft's context. `pending`: tokens a step in flight (`cur`) may still add (upper bound) for each request;
        it surely adds one, which counts against max_tokens (the upper bound would forbid too much)."""
        b = len(reqs)
        if self.engine.proposer is None:
            return Decision(np.zeros(b, dtype=np.int64), 0, False, 0.0, 0.0, "none")
        extra = pending if pending is not None else np.zeros(b, dtype=np.int64)
        max_len = self.config.max_model_len
        if self.config.spec_max_len is not None:
            max_len = min(max_len, self.config.spec_max_len)
        room = np.array([min(r.params.max_tokens - r.num_output_tokens - min(int(e), 1) - 1,
                             max_len - self._step_tokens(len(r.token_ids) + int(e)))
                         for r, e in zip(reqs, extra)], dtype=np.int64)
        decision = self.policy.choose([r.acceptance for r in reqs], [r.num_spec_tokens for r in reqs], room,
                                      self._behind(reqs, extra, cur))
        if not self.engine.has_draft_model and decision.refill:
            decision = replace(decision, refill=False)
        if self.tracer.recording:
            self.tracer.instant("spec_decision", batch=b, governor=self.policy.governor_state, **decision.to_log())
        return decision

    def _reserve(self) -> tuple[Decision | None, list[RequestOutput]]:
        """Pages for every running request's next step: without speculation if that is what fits, else preempt
        the newest requests. A lone request that cannot grow by one token has filled the KV cache: it finishes
        (`length`, as at the model's length limit) instead of failing the whole engine."""
        while True:
            decision = self._decide(self.running)
            if self._reserve_pages(self.running, decision.num_draft):
                return decision, []
            if decision.num_draft.any():  # speculation off for this step: a decision of its own
                decision = replace(decision, num_draft=np.zeros_like(decision.num_draft), k=0, probing=None,
                                   catch_up=None)
                if self._reserve_pages(self.running, decision.num_draft):
                    return decision, []
            self.policy.retract(decision)  # not run: decided again for the batch left after preempting
            if self.prefilling:  # the newest work: a prompt part-way through its chunks
                self._preempt(self.prefilling[-1])
                continue
            if len(self.running) > 1:
                self._preempt(self.running[-1])
                continue
            req = self.running[0]
            log.warning("request %s filled the KV cache (%d tokens); finishing it", req.request_id,
                        len(req.token_ids))
            self._finish(req, FinishReason.LENGTH)
            return None, [RequestOutput(req, [], True)]

    def _step_tokens(self, num_tokens: int, num_draft: int = 0) -> int:
        return self.allocator.step_tokens(num_tokens, num_draft, self.lookahead)

    def _reserve_pages(self, reqs: list[Request], num_draft: np.ndarray, pending: np.ndarray | None = None) -> bool:
        """Grow each page table to hold its step's writes: current tokens, what a step in flight may still add
        (`pending`), k drafts, the bonus token and the proposer's look-ahead. All or nothing."""
        extra = pending if pending is not None else np.zeros(len(reqs), dtype=np.int64)
        need = [self._step_tokens(len(r.token_ids) + int(p), int(k)) for r, p, k in zip(reqs, extra, num_draft)]
        short = sum(max(0, self.allocator.pages_for(n) - len(r.page_table)) for r, n in zip(reqs, need))
        if short > self.allocator.num_free:
            return False
        for r, n in zip(reqs, need):
            self.allocator.ensure(r.page_table, n)
        return True

    def _behind(self, reqs: list[Request], pending: np.ndarray, cur: InFlight | None) -> np.ndarray | None:
        """Tokens each request's draft would have to catch up before drafting in the next step (None: a proposer
        without a draft KV). A chained step: after `cur`, which keeps current only the lanes it refills."""
        if not self.engine.has_draft_model:
            return None
        refilled = {id(r) for r, f in zip(cur.batch, cur.refilled) if f} if cur is not None else set()
        return np.array([0 if id(r) in refilled else len(r.token_ids) + int(p) - r.draft_len
                         for r, p in zip(reqs, pending)], dtype=np.int64)

    def _to_catch_up(self, batch: list[Request], decision: Decision) -> list[Request]:
        """The stale lanes the step needs current: every one when it refills, or only those a probe drafts with
        (`Decision.catch_up`); the others stay behind (the refill over them is wasted, and they catch up from
        their own `draft_len` when they next draft)."""
        if not decision.refill or not self.engine.has_draft_model:
            return []
        lanes = decision.catch_up if decision.catch_up is not None else np.ones(len(batch), dtype=bool)
        return [r for r, c in zip(batch, lanes) if c and r.draft_len < len(r.token_ids)]

    def _catch_up(self, batch: list[Request], decision: Decision) -> float:
        """The proposer skipped tokens while its refill was dropped; resync before it drafts. Its cost is charged
        to this step (`InFlight.catch_up_s`): resuming speculation pays it."""
        stale = self._to_catch_up(batch, decision)
        if not stale:
            return 0.0
        lens = [r.draft_len for r in stale]
        t = self.clock()
        self.stream.submit(ranges.CATCH_UP, lambda: self.engine.catch_up(stale, lens)).wait()
        seconds = self.clock() - t
        self.policy.observe_catch_up(sum(len(r.token_ids) - n for r, n in zip(stale, lens)), seconds)
        for r in stale:
            r.draft_len = len(r.token_ids)
        return seconds

    def _preempt(self, req: Request) -> None:
        """Recompute later: drop its KV, keep its tokens; it is re-prefilled (prompt + output) when readmitted."""
        (self.prefilling if req.status == Status.PREFILLING else self.running).remove(req)
        self._release(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _launch(self, batch: list[Request], decision: Decision, chain: Chain | None, catch_up_s: float = 0.0,
                refilled: np.ndarray | None = None) -> InFlight:
        """`refilled`: a chained step's lanes whose draft is current after the step in flight (None: from the
        host state, after this step's catch-up)."""
        launched = self.clock()
        with self.tracer.range(ranges.BUILD_BATCH, batch=len(batch)):
            ctx = self.engine.plan_decode(batch, decision.num_draft, chain, decision.refill)
        if refilled is None:
            refilled = np.array([r.draft_len >= len(r.token_ids) for r in batch], dtype=bool)
        refilled &= decision.refill and self.engine.has_draft_model
        # The decision as it runs (n-gram's matches, drafts dropped by a stale draft): what is counted and shown.
        self.last_decision = replace(decision, num_draft=ctx.num_draft, k=int(ctx.num_draft.max(initial=0)))
        handle = self.stream.submit(ranges.DECODE, lambda: self.engine.run_decode(ctx))
        for r in batch:
            self._inflight_count[id(r)] = self._inflight_count.get(id(r), 0) + 1
        proposer = self.engine.proposer
        chainable = self.overlap and (proposer is None or proposer.has_model)
        return InFlight(batch, handle, chainable, decision, ctx.num_draft, refilled, catch_up_s, launched)

    def _launch_chained(self, cur: InFlight) -> InFlight | None:
        """Step N+1 for the running requests, built while step N runs. None if it cannot be built blind
        (pages would need a preemption): the loop then drains and schedules synchronously."""
        with self.tracer.range(ranges.SCHEDULE):
            batch = list(self.running)  # every one of them is in step N (nothing was admitted since)
            if not batch:
                return None
            row = {id(r): i for i, r in enumerate(cur.batch)}
            src = np.array([row[id(r)] for r in batch], dtype=np.int64)
            pending = cur.num_draft[src].astype(np.int64) + 1
            decision = self._decide(batch, pending, cur)
            behind = self._behind(batch, pending, cur)
            lanes = decision.catch_up if decision.catch_up is not None else np.ones(len(batch), dtype=bool)
            # Cannot run as decided: un-count it (a probe stays due) and drain; `step` decides it again.
            if decision.refill and behind is not None and (lanes & (behind > 0)).any():
                self.policy.retract(decision)
                return None  # the draft must catch up on host tokens first: drain
            if not self._reserve_pages(batch, decision.num_draft, pending):
                self.policy.retract(decision)
                return None
        chain = Chain(prev=cur.handle, src=src, dst=np.arange(len(batch), dtype=np.int64))
        refilled = cur.refilled[src] if behind is not None else np.zeros(len(batch), dtype=bool)
        return self._launch(batch, decision, chain, 0.0, refilled.copy())

    def _complete(self, inf: InFlight) -> list[RequestOutput]:
        with self.tracer.range(ranges.WAIT):
            out = inf.handle.wait()
            accepted, tokens = out.read()  # the step's one host sync
        outputs = []
        with self.tracer.range(ranges.PROCESS_OUTPUT):
            d = inf.decision
            probing = d.probing if d.probing is not None else np.zeros(len(inf.batch), bool)
            lanes = zip(inf.batch, accepted, tokens, out.num_draft.tolist(), probing.tolist(), inf.refilled.tolist())
            for req, a, row, nd, probe, refilled in lanes:
                self._inflight_count[id(req)] -= 1
                if self._inflight_count[id(req)] == 0:
                    del self._inflight_count[id(req)]
                if req.finished:  # finished in an earlier step or aborted: a wasted lane
                    continue
                req.stats.record(nd, a)
                self.policy.observe_request(req.acceptance, nd, a, probe, d.break_even)
                req.num_computed = len(req.token_ids) + a  # target KV now holds last + a accepted drafts
                ro = self._append(req, row[: a + 1])
                ro.num_draft, ro.num_accepted = nd, a
                outputs.append(ro)
                if refilled:
                    req.draft_len = len(req.token_ids)
            for req in [r for r in self._pending_release if id(r) not in self._inflight_count]:
                self._pending_release.remove(req)
                self._release(req)
        # The step's cost for the policy: device time when host work is hidden behind it (overlap); inline,
        # the whole step from build to processed outputs, since the host part then adds to every step too.
        cost = inf.handle.device_seconds() if self.overlap else self.clock() - inf.launched
        self.policy.observe_step(len(inf.batch), out.num_draft, d.refill, cost,
                                 tokens=len(inf.batch) + sum(accepted), catch_up_s=inf.catch_up_s,
                                 auto_drafted=d.auto_drafts(out.num_draft))
        return outputs

    def _release(self, req: Request) -> None:
        self.allocator.free(req.page_table)
        if req.slot >= 0:
            self._free_slots.append(req.slot)
            req.slot = -1
