"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Every error the ZMQ path can give (a `ProtocolError` and its `ErrorCode`) maps onto one status and type here, so
both frontends refuse the same requests for the same reasons. `param` is the field at fault: validation messages
start with `FIELD: ` (scheduler/server/validate.py), and that prefix names it.
"""

from __future__ import annotations

import re

from specstep.scheduler.server.protocol import ErrorCode, ProtocolError

# (HTTP status, OpenAI error type) per error code. OpenAI's clients retry 429 and 5xx by themselves.
STATUS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.MALFORMED: (400, "invalid_request_error"),
    ErrorCode.UNKNOWN_TYPE: (404, "invalid_request_error"),
    ErrorCode.INVALID_PARAMS: (400, "invalid_request_error"),
    ErrorCode.PROMPT_TOO_LONG: (400, "invalid_request_error"),
    ErrorCode.DUPLICATE_REQUEST_ID: (409, "invalid_request_error"),
    ErrorCode.ENGINE_DIED: (503, "server_error"),
    ErrorCode.UNAVAILABLE: (503, "server_error"),
    ErrorCode.SHUTTING_DOWN: (503, "server_error"),
    ErrorCode.OVERLOADED: (429, "server_error"),
    ErrorCode.INTERNAL: (500, "server_error"),
    ErrorCode.TOO_LARGE: (413, "invalid_request_error"),
}
# OpenAI's own code names where it has one for the same thing; elsewhere the ErrorCode's name, lower case.
_OPENAI_CODES = {ErrorCode.PROMPT_TOO_LONG: "context_length_exceeded"}
_FIELD = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+|\[\d+\])*): ")


class ApiError(ProtocolError):
    """A ProtocolError with an HTTP status of its own (an unknown model is 404, not 400)."""

    def __init__(self, code: ErrorCode, message: str, status: int, openai_code: str, param: str | None = None) -> None:
        super().__init__(code, message)
        self.status = status
        self.openai_code = openai_code
        self.param = param


def model_not_found(model: str, served: str) -> ApiError:
    return ApiError(ErrorCode.INVALID_PARAMS, f"model: {model!r} is not served here; this server serves {served!r} "
                    "(GET /v1/models)", 404, "model_not_found", "model")


def error_body(e: ProtocolError, renamed: dict[str, str] | None = None) -> tuple[int, dict]:
    """(HTTP status, OpenAI error object) for `e`. `renamed` maps the ZMQ protocol's field names onto the names
    the client used (a chat request's `prompt` is its `messages`)."""
    status, kind = STATUS.get(e.code, (500, "server_error"))
    code = _OPENAI_CODES.get(e.code, e.code.name.lower())
    param = None
    if isinstance(e, ApiError):
        status, code, param = e.status, e.openai_code, e.param
    message = e.message
    if param is None and (m := _FIELD.match(message)) and m.group(1) != "body":
        param = m.group(1)
    if renamed and param is not None:
        root = re.split(r"[.\[]", param, maxsplit=1)[0]
        if root in renamed:
            new = renamed[root] + param[len(root):]
            message = new + message[len(param):]
            param = new
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}
