"""Response bodies and stream chunks in OpenAI's shapes, for both endpoints.

    /v1/completions        object "text_completion"        choices[0].text
    /v1/chat/completions   object "chat.completion"        choices[0].message {role, content}
                           chunks "chat.completion.chunk"  choices[0].delta   {role} first, then {content}

The last chunk (the one with a finish_reason) and a whole response carry `specstep`: the request's speculation
figures (drafted, accepted, mean accepted length, ...), its server-side timings and preemptions. With
`stream_options.include_usage` a chunk with empty `choices` and the usage follows it, as OpenAI sends it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from specstep.scheduler.server.protocol import Final, Wire


def _fields(s: Wire) -> dict[str, Any]:
    """A wire struct as a dict (its msgpack form is a positional array)."""
    return {f: getattr(s, f) for f in s.__struct_fields__}


def extension(final: Final) -> dict[str, Any]:
    """The `specstep` field: speculation figures, timings and preemptions of one request."""
    return {**_fields(final.spec), "timings": _fields(final.timings), "num_preemptions": final.num_preemptions}


def usage(final: Final) -> dict[str, int]:
    u = final.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


@dataclass(frozen=True, slots=True)
class ResponseShape:
    chat: bool  # /v1/chat/completions (else /v1/completions)
    id: str
    created: int
    model: str
    return_token_ids: bool = False
    include_usage: bool = False

    def _choice(self, text: str, token_ids: list[int], finish_reason: str | None, delta: bool,
                first: bool = False) -> dict[str, Any]:
        if not self.chat:
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        elif delta:
            body = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _head(self, stream: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def response(self, final: Final) -> dict[str, Any]:
        """The whole reply of a request that does not stream (its Final holds all of its text and ids)."""
        return {**self._head(False), "choices": [self._choice(final.text, final.token_ids, final.finish_reason,
                                                              delta=False)],
                "usage": usage(final), "specstep": extension(final)}

    def chunk(self, text: str, token_ids: list[int], first: bool = False) -> bytes:
        body = {**self._head(True), "choices": [self._choice(text, token_ids, None, delta=True, first=first)]}
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def last_chunks(self, final: Final, first: bool = False) -> bytes:
        """The chunk with the finish reason and `specstep`; the usage chunk if asked for; `[DONE]`."""
        body = {**self._head(True), "choices": [self._choice(final.text, final.token_ids, final.finish_reason,
                                                             delta=True, first=first)]}
        if self.include_usage:
            body["usage"] = None
        body["specstep"] = extension(final)
        out = sse(body)
        if self.include_usage:
            out += sse({**self._head(True), "choices": [], "usage": usage(final)})
        return out + DONE


DONE = b"data: [DONE]\n\n"


def sse(body: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + msgspec.json.encode(body) + b"\n\n"
