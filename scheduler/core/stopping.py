"""Stop conditions: the tokens of a step that a request keeps, and why it ends. EOS (unless ignored), stop
tokens, max_tokens and max_model_len end it; the tokens after the one that ends it are dropped (a verify step
may accept drafts past an EOS).
"""

from __future__ import annotations

from dataclasses import dataclass

from specstep.scheduler.core.request import FinishReason, Request


@dataclass(slots=True)
class RequestOutput:
    request: Request
    new_token_ids: list[int]
    finished: bool
    num_draft: int = 0  # drafts proposed for it in the step that produced these tokens
    num_accepted: int = 0


def append_tokens(req: Request, new: list[int], eos_token_ids: frozenset[int],
                  max_model_len: int) -> tuple[list[int], FinishReason | None]:
    """Append a step's tokens to `req` up to the first that ends it: (tokens kept, why it ends or None)."""
    kept: list[int] = []
    for tok in new:
        req.token_ids.append(tok)
        kept.append(tok)
        if (tok in eos_token_ids and not req.params.ignore_eos) or tok in req.params.stop_token_ids:
            return kept, FinishReason.STOP
        if req.num_output_tokens >= req.params.max_tokens or len(req.token_ids) >= max_model_len:
            return kept, FinishReason.LENGTH
    return kept, None
