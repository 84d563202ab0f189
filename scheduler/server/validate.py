"""Validation of a client's generate request against the limits the scheduler reported in its ready message.

Runs in the frontend (no torch here), so a bad request is answered without touching the engine; the engine
core validates again, and its rejection also reaches the client as a typed error.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from specstep.engine.tokenizer import Tokenizer
from specstep.scheduler.server.decode_errors import MAX_REQUEST_ID_LEN
from specstep.scheduler.server.protocol import EngineRequest, ErrorCode, GenerateRequest, ProtocolError, Ready

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 64
MAX_SPEC_TOKENS = 16  # EngineConfig's bound on k
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True, slots=True)
class Limits:
    vocab_size: int
    max_prompt_len: int
    max_tokens: int

    @classmethod
    def from_ready(cls, ready: Ready, max_tokens: int | None) -> Limits:
        # A request can never hold more tokens than the model's length, nor than the whole KV cache.
        cap = min(ready.max_model_len - 1, (ready.num_pages - 1) * ready.page_size - 2)
        return cls(ready.vocab_size, ready.max_prompt_len, min(max_tokens, cap) if max_tokens else cap)


def check_request_id(request_id: str) -> None:
    # The error carries no id: a client routing by id would match a shortened one to the wrong request.
    if not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
        raise ProtocolError(ErrorCode.INVALID_PARAMS, f"request_id: must be 1-{MAX_REQUEST_ID_LEN} characters, "
                            f"got {len(request_id)}")


def validate_generate(msg: GenerateRequest, limits: Limits, tokenizer: Tokenizer | None,
                      engine_id: str) -> EngineRequest:
    """The engine request for `msg`, or ProtocolError (INVALID_PARAMS / PROMPT_TOO_LONG) whose message starts
    with the field at fault (`max_tokens: ...`). Lengths of strings are in characters (code points)."""
    ids = _prompt_ids(msg, limits, tokenizer)
    _check_sampling(msg, limits)
    _check_stops(msg, limits, tokenizer)
    if msg.num_spec_tokens is not None and not 0 <= msg.num_spec_tokens <= MAX_SPEC_TOKENS:
        raise _bad(msg, f"num_spec_tokens: must be null (server policy) or in [0, {MAX_SPEC_TOKENS}], "
                   f"got {msg.num_spec_tokens}")
    seed = msg.seed if msg.seed is not None else random.getrandbits(63)
    return EngineRequest(request_id=engine_id, prompt_token_ids=list(ids), seed=seed, max_tokens=msg.max_tokens,
                         temperature=float(msg.temperature), top_p=float(msg.top_p), top_k=max(msg.top_k, 0),
                         stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
                         num_spec_tokens=msg.num_spec_tokens, client_seed=msg.seed)


def _bad(msg: GenerateRequest, text: str, code: ErrorCode = ErrorCode.INVALID_PARAMS) -> ProtocolError:
    return ProtocolError(code, text, msg.request_id)


def _prompt_ids(msg: GenerateRequest, limits: Limits, tokenizer: Tokenizer | None) -> list[int]:
    """The prompt's token ids: `prompt` encoded, or `prompt_token_ids` checked against the vocabulary."""
    if (msg.prompt is None) == (msg.prompt_token_ids is None):
        given = "both" if msg.prompt is not None else "neither"
        raise _bad(msg, f"prompt: give exactly one of prompt and prompt_token_ids, got {given}")
    if msg.prompt is not None:
        if not msg.prompt:
            raise _bad(msg, "prompt: must not be empty")
        if tokenizer is None:
            raise _bad(msg, "prompt: this model has no tokenizer; send prompt_token_ids")
        bound = tokenizer.max_token_chars
        if bound is not None and len(msg.prompt) > limits.max_prompt_len * bound:  # surely too long: no encoding
            raise _bad(msg, f"prompt: {len(msg.prompt)} characters, more than {limits.max_prompt_len} tokens can "
                       "hold", ErrorCode.PROMPT_TOO_LONG)
        ids = tokenizer.encode(msg.prompt)
        if not ids:
            raise _bad(msg, "prompt: encodes to no tokens")
    else:
        ids = msg.prompt_token_ids or []
        if not ids:
            raise _bad(msg, "prompt_token_ids: must not be empty")
        outside = [t for t in ids if not 0 <= t < limits.vocab_size]
        if outside:
            raise _bad(msg, f"prompt_token_ids: outside the vocabulary [0, {limits.vocab_size}): {outside[:5]}")
    if len(ids) > limits.max_prompt_len:
        field = "prompt" if msg.prompt is not None else "prompt_token_ids"
        raise _bad(msg, f"{field}: {len(ids)} tokens; this server allows at most {limits.max_prompt_len}",
                   ErrorCode.PROMPT_TOO_LONG)
    return ids


def _check_sampling(msg: GenerateRequest, limits: Limits) -> None:
    if not 1 <= msg.max_tokens <= limits.max_tokens:
        raise _bad(msg, f"max_tokens: must be in [1, {limits.max_tokens}], got {msg.max_tokens}")
    if not (math.isfinite(msg.temperature) and 0.0 <= msg.temperature <= MAX_TEMPERATURE):
        raise _bad(msg, f"temperature: must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {msg.temperature}")
    if not (math.isfinite(msg.top_p) and 0.0 < msg.top_p <= 1.0):
        raise _bad(msg, f"top_p: must be in (0, 1], got {msg.top_p}")
    # -1 is "off" as in vLLM and SGLang; a top_k of the vocabulary size or more keeps every token, like 0.
    if not -1 <= msg.top_k < 2**31:
        raise _bad(msg, f"top_k: must be 0 or -1 (off), or a count in [1, 2^31), got {msg.top_k}")
    if msg.seed is not None and not 0 <= msg.seed < 2**63:
        raise _bad(msg, f"seed: must be in [0, 2^63), got {msg.seed}")


def _check_stops(msg: GenerateRequest, limits: Limits, tokenizer: Tokenizer | None) -> None:
    if len(msg.stop) > MAX_STOP_STRINGS:
        raise _bad(msg, f"stop: at most {MAX_STOP_STRINGS} strings, got {len(msg.stop)}")
    if any(not s or len(s) > MAX_STOP_STRING_LEN for s in msg.stop):
        raise _bad(msg, f"stop: each string must be 1-{MAX_STOP_STRING_LEN} characters")
    if msg.stop and tokenizer is None:
        raise _bad(msg, "stop: this model has no tokenizer, so no stop strings; use stop_token_ids")
    if len(msg.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise _bad(msg, f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, got {len(msg.stop_token_ids)}")
    outside = [t for t in msg.stop_token_ids if not 0 <= t < limits.vocab_size]
    if outside:
        raise _bad(msg, f"stop_token_ids: outside the vocabulary [0, {limits.vocab_size}): {outside[:5]}")
