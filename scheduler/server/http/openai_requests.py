"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) decoded and mapped onto the ZMQ protocol's
GenerateRequest, which the frontend then validates exactly as it validates a ZMQ client's (validate.py).

Fields OpenAI defines that this server does not implement are refused by name when set to anything but their
neutral value (`n` > 1, `logprobs`, penalties, `echo`, ...); fields nobody defines are ignored, as OpenAI's and
vLLM's servers do, since clients send extras (`user`, `metadata`). Extensions, as vLLM and llama.cpp's server
name them: `top_k`, `ignore_eos`, `stop_token_ids`, `return_token_ids`; and specstep's `num_spec_tokens`.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from specstep.scheduler.server.protocol import MAX_FRAME_BYTES, ErrorCode, GenerateRequest, ProtocolError


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None


class _Sampling(msgspec.Struct, kw_only=True):
    """What both endpoints share. `None` is "not given" (clients send explicit nulls too)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None
    num_spec_tokens: int | None = None
    # Defined by OpenAI, not implemented: refused unless neutral (see _refuse_unsupported).
    n: int | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None  # an int on /v1/completions, a bool on /v1/chat/completions
    top_logprobs: int | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Any = None  # text, token ids, or a list holding one of either
    echo: bool | None = None
    suffix: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: Any = None  # text, or a list of {"type": "text", "text": ...} parts
    name: str | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    response_format: Any = None


# Each unimplemented field's neutral value (or null): anything else is refused by name.
_NEUTRAL: dict[str, Any] = {
    "n": 1, "best_of": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {}, "logprobs": False,
    "top_logprobs": 0, "echo": False, "suffix": "", "tools": [],
}
_PATH = re.compile(r"^(?P<what>.*) - at `\$(?P<path>[^`]*)`$")


def decode(body: bytes, cls: type[msgspec.Struct]) -> Any:
    """The request body as `cls`; MALFORMED (as a ProtocolError naming the field) when it is not."""
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"request body of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        return msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as e:
        text = str(e)
        if m := _PATH.match(text):
            field = m["path"].lstrip(".") or "body"
            raise ProtocolError(ErrorCode.MALFORMED, f"{field}: {_plain(m['what'])}") from None
        if m := re.match(r"^Object missing required field `(\w+)`", text):
            raise ProtocolError(ErrorCode.MALFORMED, f"{m[1]}: required field missing") from None
        raise ProtocolError(ErrorCode.MALFORMED, f"body: {_plain(text)}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(ErrorCode.MALFORMED, f"body: not a JSON object ({e})") from None


def _plain(msgspec_text: str) -> str:
    return msgspec_text.replace("Expected", "expected", 1).replace("`", "")


def _refuse_unsupported(req: _Sampling) -> None:
    for name, neutral in _NEUTRAL.items():
        value = getattr(req, name, None)
        if value is None or value == neutral:  # 0 == False: `logprobs: 0` is neutral too
            continue
        if name == "n":
            raise _bad(f"n: only 1 choice per request is supported, got {value}; send {value} requests instead")
        raise _bad(f"{name}: not supported by this server (leave it unset), got {value!r}")


def _bad(text: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_PARAMS, text)


def completion_prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    """(text, token ids) from a completions `prompt`: a string, a list of token ids, or a list holding one."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise _bad(f"prompt: one prompt per request is supported, got a list of {len(prompt)}")
    if prompt is None:
        raise _bad("prompt: required field missing")
    raise _bad("prompt: must be a string or a list of token ids")


def generate_request(req: _Sampling, request_id: str, prompt: str | None, prompt_ids: list[int] | None,
                     max_tokens: int) -> GenerateRequest:
    """The ZMQ protocol's request for these fields (validated later, with the ZMQ path's code)."""
    _refuse_unsupported(req)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return GenerateRequest(
        request_id, prompt=prompt, prompt_token_ids=prompt_ids, max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,  # OpenAI's default
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=req.seed, stop=stop,
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=bool(req.ignore_eos), stream=bool(req.stream),
        num_spec_tokens=req.num_spec_tokens)
