"""The scheduler: request queues, admission, page reservation, the speculation decision and preemption by
recompute. `schedule()` returns the next step as a frozen `StepPlan`; the engine core
(`scheduler/core/engine_core.py`) launches it, says so through `launched`, and hands the step's results to
`results` (`Postprocessor`, `scheduler/core/postprocess.py`). It never calls the step engine: what it must know
of it comes in `ModelFacts`.

Pages: every running request's page table holds every position its next step may write (the allocator's
`step_tokens`); a step that cannot get its pages runs without speculation, else the newest work is preempted
(its KV dropped, its tokens kept, re-prefilled when readmitted).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from specstep.engine.errors import InvalidRequestError
from specstep.scheduler.core.chunked_prefill import ChunkPlanner
from specstep.scheduler.core.draft_lanes import draft_lag, draft_room, stale_lanes
from specstep.scheduler.core.page_allocator import PageAllocator
from specstep.scheduler.core.postprocess import Postprocessor
from specstep.scheduler.core.prefill_budget import PrefillBudget
from specstep.scheduler.core.prefill_pacer import Pacing, PrefillPacer
from specstep.scheduler.core.request import FinishReason, Request, Status
from specstep.scheduler.core.request_queues import RequestQueues
from specstep.scheduler.core.step_plan import StepKind, StepPlan
from specstep.scheduler.core.stopping import RequestOutput
from specstep.scheduler.spec.decision import Decision
from specstep.scheduler.spec.policy import AdaptivePolicy
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


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What scheduling needs to know of the step engine."""

    vocab_size: int
    has_proposer: bool
    has_draft_model: bool  # the proposer keeps a KV of its own (a draft model or a head): it can fall behind
    draft_shift: int  # tokens a skipped prompt leaves the draft at (a head never consumes t[0]: 1)
    lookahead: int  # positions the proposer writes past the verify window
    # (token ids of each request, k) -> [B] drafts the proposer would make now, where it knows before the step
    # (n-gram's lookup: `Proposer.draft_limits`); None where it cannot tell
    draft_limits: Callable[[list[list[int]], int], np.ndarray | None] | None = None

    @classmethod
    def of(cls, engine) -> ModelFacts:
        p = engine.proposer
        return cls(engine.vocab_size, p is not None, engine.has_draft_model,
                   p.shift if engine.has_draft_model else 0, p.kv_lookahead if p is not None else 0,
                   p.draft_limits if p is not None else None)


def check_prompt(req: Request, vocab: int, max_model_len: int, max_prompt_tokens: int) -> None:
    """A request the engine can run to its first token, or a typed error saying why not."""
    n = len(req.prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("prompt is empty")
    bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    if n + 1 > max_model_len:
        raise InvalidRequestError(f"prompt has {n} tokens; the model allows at most {max_model_len - 1}")
    if n > max_prompt_tokens:
        raise InvalidRequestError(f"prompt of {n} tokens does not fit the KV cache")
    req.params.validate(vocab)


class Scheduler:
    def __init__(self, facts: ModelFacts, allocator: PageAllocator, config: SchedulerConfig, policy: AdaptivePolicy,
                 eos_token_ids: tuple[int, ...] = (), tracer: Tracer = NULL_TRACER) -> None:
        self.facts = facts
        self.allocator = allocator
        self.config = config
        self.tracer = tracer
        self.queues = RequestQueues(allocator, config.max_batch_size)
        pacer = PrefillPacer(config.prefill_budget) if config.prefill_budget else None
        self.chunks = ChunkPlanner(allocator, pacer, config.max_batch_size, self.step_tokens) if pacer else None
        self.results = Postprocessor(self.queues, policy, pacer, facts.draft_shift, frozenset(eos_token_ids),
                                     config.max_model_len)
        self.policy = policy
        self.last_decision: Decision | None = None  # the latest launched decode step's, as it ran

    @property
    def policy(self) -> AdaptivePolicy:
        return self._policy

    @policy.setter
    def policy(self, policy: AdaptivePolicy) -> None:  # tests script decisions: its results observe the same one
        self._policy = self.results.policy = policy

    # ---- requests in and out -------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.queues.requests:
            raise InvalidRequestError(f"duplicate request id {req.request_id!r}")
        check_prompt(req, self.facts.vocab_size, self.config.max_model_len,
                     self.allocator.max_prompt_tokens(self.facts.lookahead))
        self.queues.add(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.queues.requests.get(request_id)
        if req is None or req.finished:
            return None
        self.queues.finish(req, FinishReason.ABORT)
        return req

    def step_tokens(self, num_tokens: int, num_draft: int = 0) -> int:
        return self.allocator.step_tokens(num_tokens, num_draft, self.facts.lookahead)

    # ---- plans ---------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step when none is in flight: prompts first (whole, or chunks beside the decode rows), else
        the running batch's decode step."""
        if self.chunks is not None:
            plan = self._schedule_mixed()
            if plan is not None:
                return plan
            if self.queues.prefilling and not self.queues.running:  # cannot happen by the admission rule; never spin
                log.warning("no prefill chunk fits the KV cache; preempting %s", self.queues.prefilling[-1].request_id)
                self.queues.preempt(self.queues.prefilling[-1])
                return StepPlan(StepKind.NONE)
        else:
            admitted = self._admit()
            if admitted:
                # While speculation is off the proposer skips the prompt too (it catches up if speculation
                # resumes): "off" costs what plain decoding costs, prefill included.
                with_proposer = self.policy.proposer_current
                return StepPlan(StepKind.PREFILL, prompts=tuple((r, len(r.token_ids)) for r in admitted),
                                with_proposer=(with_proposer,) * len(admitted))
        if not self.queues.running:
            return StepPlan(StepKind.NONE)
        return self._schedule_decode()

    def wants_admission(self) -> bool:
        """A prompt could start now: the engine core drains instead of chaining another decode step."""
        if self.queues.prefilling:
            return True
        if not self.queues.waiting or len(self.queues.running) >= self.config.max_batch_size:
            return False
        req = self.queues.waiting[0]
        return self.allocator.can_fit(req.page_table, self.step_tokens(len(req.token_ids)))

    def _admit_chunked(self, req: Request) -> None:
        req.prefill_with_proposer = self.policy.proposer_current  # fixed for all of its chunks
        self.queues.admit(req, Status.PREFILLING)

    def _admit(self) -> list[Request]:
        batch: list[Request] = []
        tokens = 0
        while self.queues.waiting and len(self.queues.running) + len(batch) < self.config.max_batch_size:
            req = self.queues.waiting[0]
            n = len(req.token_ids)
            if batch and tokens + n > self.config.max_prefill_tokens:
                break
            if not self.allocator.can_fit(req.page_table, self.step_tokens(n)):
                break
            self.allocator.ensure(req.page_table, self.step_tokens(n))
            self.queues.admit(req, Status.RUNNING)
            batch.append(req)
            tokens += n
        return batch

    def _schedule_mixed(self) -> StepPlan | None:
        """A mixed step: the running batch's decode step as `_schedule_decode` would plan it (speculation
        included), then prompt chunks up to the pacer's budget. None if no prompt chunk runs, or the decode rows'
        pages need a preemption (the decode path plans that step)."""
        running = self.queues.running
        if not self.queues.prefilling and not self.queues.waiting:
            return None  # no prompt to chunk: not worth deciding the decode rows twice
        decision = None
        if running:
            decision = self.decide(running)
            if not self.reserve_pages(running, decision.num_draft):
                if not decision.num_draft.any():
                    return None
                decision = replace(decision, num_draft=np.zeros_like(decision.num_draft), k=0, probing=None,
                                   catch_up=None)
                if not self.reserve_pages(running, decision.num_draft):
                    return None
        decode_s = self.decode_step_s(decision)
        verify = int(decision.num_draft.sum()) + len(running) if decision is not None else 0
        chunks = self.chunks.plan(len(running), verify, self.queues.prefilling, self.queues.waiting, decode_s,
                                  self._admit_chunked, self.steady_decode_s(decision))
        if not chunks:
            return None
        return StepPlan(StepKind.MIXED, decode=tuple(running), prompts=tuple(chunks),
                        with_proposer=tuple(r.prefill_with_proposer for r, _ in chunks), decision=decision,
                        catch_up=stale_lanes(running, decision) if decision is not None else (), decode_s=decode_s)

    def pacing(self, mixed_share: float) -> Pacing | None:
        """The pacer's figures for the running batch as last decided (None: whole-prompt prefill)."""
        if self.chunks is None:
            return None
        pacer, b = self.chunks.pacer, len(self.queues.running)
        d = self.last_decision
        decode_s = self.decode_step_s(d) if d is not None and len(d.num_draft) == b else self.plain_decode_s()
        verify = b + (int(d.num_draft.sum()) if d is not None and len(d.num_draft) == b else 0)
        steady = self.steady_decode_s(d if d is not None and len(d.num_draft) == b else None)
        return Pacing(pacer.budget_tokens(verify, decode_s, steady), pacer.itl_target(decode_s, steady) or 0.0,
                      pacer.efficient, mixed_share)

    def decode_step_s(self, decision: Decision | None) -> float | None:
        """The running batch's decode step as decided, priced by the policy's live step costs (None: not timed
        yet, or no stream runs): the gap the streams see, which a mixed step is held to a multiple of."""
        b = len(self.queues.running)
        if decision is None or not b:
            return None
        return self.policy.costs.predict(b, decision.num_draft, decision.refill) or self.plain_decode_s()

    def steady_decode_s(self, decision: Decision | None = None) -> float | None:
        """The decode step of the batch the running, prefilling and waiting requests make together (at most
        max_batch_size), each drafting the most `decision` drafts (none without one), where that batch is larger
        than the running one (else None): the gap the streams see once the waiting prompts decode
        (`PrefillPacer.itl_target`). As the policy prices it, or where it has timed no such step, as start-up
        priced prompt rows (`PrefillPacer.forward_s`)."""
        q = self.queues
        b = min(len(q.running) + len(q.prefilling) + len(q.waiting), self.config.max_batch_size)
        if b <= len(q.running):
            return None
        k = int(decision.num_draft.max(initial=0)) if decision is not None else 0
        refill = decision.refill if decision is not None else False
        timed = self.policy.costs.predict(b, np.full(b, k, np.int64), refill) or self.policy.costs.plain(b, refill)
        # Not timed yet (a server's first steps, when a burst of prompts arrives): a forward of as many rows as the
        # start-up fit prices prompt rows. Without it the first burst paced itself to one stream's gap.
        return timed or self.chunks.pacer.forward_s(b * (k + 1))

    def plain_decode_s(self) -> float | None:
        """The running batch's plain decode step as the policy last timed it (None: not yet): what the streams'
        gaps are measured against."""
        b = len(self.queues.running)
        return (self.policy.costs.plain(b, False) or self.policy.costs.plain(b, True)) if b else None

    def _schedule_decode(self) -> StepPlan:
        """Pages for every running request's next step: without speculation if that is what fits, else preempt
        the newest requests. A lone request that cannot grow by one token has filled the KV cache: it finishes
        (`length`, as at the model's length limit) instead of failing the whole engine."""
        while True:
            decision = self.decide(self.queues.running)
            fits = self.reserve_pages(self.queues.running, decision.num_draft)
            if not fits and decision.num_draft.any():  # speculation off for this step: a decision of its own
                decision = replace(decision, num_draft=np.zeros_like(decision.num_draft), k=0, probing=None,
                                   catch_up=None)
                fits = self.reserve_pages(self.queues.running, decision.num_draft)
            if fits:
                return StepPlan(StepKind.DECODE, decode=tuple(self.queues.running), decision=decision,
                                catch_up=stale_lanes(self.queues.running, decision))
            # Not run (nothing of it was counted): decided again for the batch left after preempting.
            if self.queues.prefilling:  # the newest work: a prompt part-way through its chunks
                self.queues.preempt(self.queues.prefilling[-1])
                continue
            if len(self.queues.running) > 1:
                self.queues.preempt(self.queues.running[-1])
                continue
            req = self.queues.running[0]
            log.warning("request %s filled the KV cache (%d tokens); finishing it", req.request_id,
                        len(req.token_ids))
            self.queues.finish(req, FinishReason.LENGTH)
            return StepPlan(StepKind.NONE, finished=(RequestOutput(req, [], True),))

    def schedule_chained(self, prev: StepPlan, prev_num_draft: np.ndarray, prev_refilled: np.ndarray,
                         can_chain) -> StepPlan | None:
        """Step N+1 for the running requests, planned while step N (`prev`, which drafted `prev_num_draft` and
        keeps current the drafts of `prev_refilled`) runs: built on N's device outputs, with pages reserved for
        every draft of N accepted. None if it cannot run as decided (a draft must first catch up on host
        tokens, `can_chain(num_draft)` says the engine cannot build it blind, or pages would need a
        preemption): the engine core then drains and plans it with `schedule`, and nothing of the dropped plan
        was counted."""
        batch = list(self.queues.running)  # every one of them is in step N (nothing was admitted since)
        if not batch:
            return None
        row = {id(r): i for i, r in enumerate(prev.decode)}
        src = np.array([row[id(r)] for r in batch], dtype=np.int64)
        pending = prev_num_draft[src].astype(np.int64) + 1
        current = {id(r) for r, f in zip(prev.decode, prev_refilled) if f}
        lag = draft_lag(batch, pending, current) if self.facts.has_draft_model else None
        decision = self.decide(batch, pending, lag)
        lanes = decision.catch_up if decision.catch_up is not None else np.ones(len(batch), dtype=bool)
        if ((decision.refill and lag is not None and (lanes & (lag > 0)).any()) or not can_chain(decision.num_draft)
                or not self.reserve_pages(batch, decision.num_draft, pending)):
            return None  # never committed: the policy saw nothing of it
        refilled = prev_refilled[src] if lag is not None else np.zeros(len(batch), dtype=bool)
        return StepPlan(StepKind.DECODE, decode=tuple(batch), decision=decision, chain_src=src,
                        chain_refilled=refilled.copy())

    def decide(self, reqs: list[Request], pending: np.ndarray | None = None, lag: np.ndarray | None = None
               ) -> Decision:
        """The policy's k per request, capped by `draft_room`. `pending`, `lag`: a chained step's, after the step
        in flight (see `draft_lanes`); `lag` None: from the host state."""
        b = len(reqs)
        if not self.facts.has_proposer:
            return Decision(np.zeros(b, dtype=np.int64), 0, False, 0.0, 0.0, "none")
        extra = pending if pending is not None else np.zeros(b, dtype=np.int64)
        max_len = min(self.config.max_model_len, self.config.spec_max_len or self.config.max_model_len)
        room = draft_room(reqs, extra, max_len, self.step_tokens)
        if lag is None and self.facts.has_draft_model:
            lag = draft_lag(reqs, extra, set())
        # A host proposer that knows now how many drafts each lane would make (n-gram: none without a match, few
        # after a short one) tells the adaptive policy, which then prices and predicts the drafts the step would
        # really run. Not for a chained step: its tokens are not on the host yet.
        limits = None
        if (pending is None and self.facts.draft_limits is not None and self.policy.cfg.kind != "fixed"
                and int(room.max(initial=0)) > 0):
            k = max(self.config.num_spec_tokens, *(r.num_spec_tokens or 0 for r in reqs))
            limits = self.facts.draft_limits([r.token_ids for r in reqs], k)
        decision = self.policy.choose([r.acceptance for r in reqs], [r.num_spec_tokens for r in reqs], room, lag,
                                      commit=False, limits=limits)
        if not self.facts.has_draft_model and decision.refill:
            decision = replace(decision, refill=False)
        if self.tracer.recording:
            self.tracer.instant("spec_decision", batch=b, governor=self.policy.governor_state, **decision.to_log())
        return decision

    def reserve_pages(self, reqs: list[Request], num_draft: np.ndarray, pending: np.ndarray | None = None) -> bool:
        """Grow each page table to hold its step's writes: current tokens, what a step in flight may still add
        (`pending`), k drafts, the bonus token and the proposer's look-ahead. All or nothing."""
        extra = pending if pending is not None else np.zeros(len(reqs), dtype=np.int64)
        return self.allocator.reserve([r.page_table for r in reqs], [
            self.step_tokens(len(r.token_ids) + int(p), int(k)) for r, p, k in zip(reqs, extra, num_draft)])

    # ---- launch --------------------------------------------------------------------------------------------
    def launched(self, plan: StepPlan, num_draft: np.ndarray) -> np.ndarray:
        """A decode plan was launched, drafting `num_draft` (n-gram may match fewer than decided, a stale draft
        none): its requests are in flight, and its decision counts (`AdaptivePolicy.commit`: the only place a
        decision changes the policy). Returns the lanes whose draft is current after the step."""
        d = plan.decision
        if self.facts.has_proposer:
            self.policy.commit(d)
        if plan.chain_refilled is not None:
            refilled = plan.chain_refilled.copy()
        else:
            refilled = np.array([r.draft_len >= len(r.token_ids) for r in plan.decode], dtype=bool)
        refilled &= d.refill and self.facts.has_draft_model
        # The decision as it runs: what is counted and shown.
        self.last_decision = replace(d, num_draft=num_draft, k=int(num_draft.max(initial=0)))
        self.queues.launched(plan.decode)
        return refilled
