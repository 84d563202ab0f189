"""A finished step's results applied to its requests (nano-vllm's postprocess): tokens appended up to a stop
condition, per-request stats and acceptance, the draft's length, and a prompt whose last token was prefilled
joining the running batch. The scheduler (`scheduler/core/scheduler.py`) plans steps; the engine core hands each
step's results here once it has read them back.
"""

from __future__ import annotations

import time

import numpy as np

from specstep.scheduler.core.prefill_pacer import PrefillPacer
from specstep.scheduler.core.request import Request
from specstep.scheduler.core.request_queues import RequestQueues
from specstep.scheduler.core.step_plan import StepPlan
from specstep.scheduler.core.stopping import RequestOutput, append_tokens
from specstep.scheduler.spec.policy import AdaptivePolicy


class Postprocessor:
    def __init__(self, queues: RequestQueues, policy: AdaptivePolicy, pacer: PrefillPacer | None,
                 draft_shift: int, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.queues = queues
        self.policy = policy  # observes each request's acceptance and the catch-ups' cost
        self.pacer = pacer  # observes the mixed steps' cost (chunked prefill)
        self.draft_shift = draft_shift  # tokens a skipped prompt leaves the draft at (`ModelFacts.draft_shift`)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def caught_up(self, stale: list[Request], draft_lens: list[int], seconds: float) -> None:
        """The drafts of `stale` (at `draft_lens`) consumed the tokens they skipped, in `seconds`."""
        self.policy.observe_catch_up(sum(len(r.token_ids) - n for r, n in zip(stale, draft_lens)), seconds)
        for r in stale:
            r.draft_len = len(r.token_ids)

    def finish_prefill(self, plan: StepPlan, tokens: list[int]) -> list[RequestOutput]:
        now = time.monotonic()
        for req, _ in plan.prompts:
            req.num_computed = len(req.token_ids)
        return [self._start_decoding(req, tok, w, now) for (req, _), tok, w in zip(plan.prompts, tokens,
                                                                                     plan.with_proposer)]

    def finish_chunks(self, plan: StepPlan, tokens: list[int], seconds: float | None) -> list[RequestOutput]:
        """A mixed step's prompt chunks added `seconds` to it (None: not known) (its decode step went through
        `finish_decode`): a prompt whose last chunk ran starts decoding with the token sampled after it."""
        if seconds is not None:
            self.pacer.observe([(q, r.num_computed) for r, q in plan.prompts], seconds, bool(plan.decode))
        now = time.monotonic()
        outputs = []
        for (req, q), tok, with_proposer in zip(plan.prompts, tokens, plan.with_proposer):
            req.num_computed += q
            if req.num_computed == len(req.token_ids):
                outputs.append(self._start_decoding(req, tok, with_proposer, now))
        return outputs

    def finish_decode(self, plan: StepPlan, num_draft: list[int], refilled: np.ndarray, accepted: list[int],
                      tokens: list[list[int]]) -> list[RequestOutput]:
        """A decode step's results: `accepted[b]` drafts of lane b and the token after them, `tokens[b]`."""
        d = plan.decision
        probing = d.probing if d.probing is not None else np.zeros(len(plan.decode), bool)
        limits = d.limits.tolist() if d.limits is not None else [None] * len(plan.decode)
        outputs = []
        for req, a, row, nd, probe, current, limit in zip(plan.decode, accepted, tokens, num_draft,
                                                          probing.tolist(), refilled.tolist(), limits):
            self.queues.landed(req)
            if req.finished:  # finished in an earlier step or aborted: a wasted lane
                continue
            req.stats.record(nd, a)
            self.policy.observe_request(req.acceptance, nd, a, probe, d.break_even, limit)
            req.num_computed = len(req.token_ids) + a  # target KV now holds last + a accepted drafts
            ro = self._append(req, row[: a + 1])
            ro.num_draft, ro.num_accepted = nd, a
            outputs.append(ro)
            if current:
                req.draft_len = len(req.token_ids)
        self.queues.release_landed()
        return outputs

    def _start_decoding(self, req: Request, token: int, with_proposer: bool, now: float) -> RequestOutput:
        """Its prompt is prefilled and `token` sampled after it: the request joins the running batch."""
        # The draft consumed the prompt and the sampled token, or (skipped) nothing it needs.
        req.draft_len = len(req.token_ids) + 1 if with_proposer else self.draft_shift
        self.queues.start_decoding(req)
        if req.first_token_time is None:
            req.first_token_time = now
        return self._append(req, [token])

    def _append(self, req: Request, new: list[int]) -> RequestOutput:
        kept, reason = append_tokens(req, new, self.eos_token_ids, self.max_model_len)
        if reason is not None:
            self.queues.finish(req, reason)
        return RequestOutput(req, kept, req.finished)
