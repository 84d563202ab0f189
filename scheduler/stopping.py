"""Stop conditions and finishing, the part of `EngineCore` that appends a step's tokens to a request: EOS (unless
ignored), stop tokens, max_tokens and max_model_len end it; a finished request's pages and slot are released
once no step in flight still includes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from specstep.scheduler.request import FinishReason, Request, Status


@dataclass(slots=True)
class RequestOutput:
    request: Request
    new_token_ids: list[int]
    finished: bool
    num_draft: int = 0  # drafts proposed for it in the step that produced these tokens
    num_accepted: int = 0


class Stopping:
    """Mixed into `EngineCore` (it reads the core's queues, in-flight counts, allocator and config)."""

    def _append(self, req: Request, new: list[int]) -> RequestOutput:
        kept: list[int] = []
        reason = None
        for tok in new:
            req.token_ids.append(tok)
            kept.append(tok)
            if (tok in self.eos_token_ids and not req.params.ignore_eos) or tok in req.params.stop_token_ids:
                reason = FinishReason.STOP
            elif req.num_output_tokens >= req.params.max_tokens or len(req.token_ids) >= self.config.max_model_len:
                reason = FinishReason.LENGTH
            if reason:
                break
        if reason:
            self._finish(req, reason)
        return RequestOutput(req, kept, req.finished)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.PREFILLING:
            self.prefilling.remove(req)
        if id(req) in self._inflight_count:
            self._pending_release.append(req)  # a step in flight still writes its pages and slot
        else:
            self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)
