"""The OpenAI-compatible HTTP server: aiohttp on the frontend's event loop (uvloop), beside the ZMQ ROUTER.

    POST /v1/completions, /v1/chat/completions ─▶ decode (openai_requests.py) ─▶ GenerateRequest
        ─▶ Frontend.admit / submit / outputs: the ZMQ path's validation, scheduler, detokenizer and stop strings
        ─▶ one JSON body, or server-sent events: `data: {chunk}` ... `data: [DONE]` (responses.py)
    GET /v1/models, /health

Each request is served by its aiohttp handler task, which is the request's task for the frontend: a client that
goes away cancels it (`handler_cancellation`), and its `finally` aborts the request in the scheduler, which frees
its KV pages at once. Errors are OpenAI's shape with the status of their ErrorCode (errors.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Protocol

import msgspec
from aiohttp import web

from specstep.scheduler.server.http.chat_template import ChatTemplate, chat_messages, no_template_error
from specstep.scheduler.server.http.errors import error_body, model_not_found
from specstep.scheduler.server.http.openai_requests import (
    ChatRequest,
    CompletionRequest,
    completion_prompt,
    decode,
    generate_request,
)
from specstep.scheduler.server.http.responses import DONE, ResponseShape, sse
from specstep.scheduler.server.metrics import ServerMetrics
from specstep.scheduler.server.protocol import (
    MAX_FRAME_BYTES,
    Delta,
    ErrorCode,
    Final,
    GenerateRequest,
    HealthReply,
    ProtocolError,
)
from specstep.scheduler.server.request_stream import RequestStream
from specstep.scheduler.server.validate import Limits

log = logging.getLogger("specstep.http")

# The frontend tells requests apart by (client identity, request id). A leading zero byte and six bytes: no ZMQ
# peer has this identity (ZMQ's own are five bytes, and one a client sets cannot start with zero).
HTTP_IDENTITY = b"\x00http/"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is what the model allows


class RequestFrontend(Protocol):
    """What the HTTP server uses of the frontend (scheduler/server/frontend.py)."""

    metrics: ServerMetrics

    def admit(self, identity: bytes, msg: GenerateRequest) -> RequestStream: ...
    async def limits(self) -> Limits: ...
    async def submit(self, st: RequestStream) -> None: ...
    def outputs(self, st: RequestStream) -> AsyncIterator[Delta | Final]: ...
    def observe_abort(self, st: RequestStream) -> Final: ...
    def forget(self, st: RequestStream) -> None: ...
    def health(self) -> HealthReply: ...


class OpenAIServer:
    def __init__(self, frontend: RequestFrontend, model_name: str, chat_template: ChatTemplate | None) -> None:
        self.frontend = frontend
        self.model_name = model_name
        self.chat_template = chat_template
        self.created = int(time.time())
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, host: str, port: int) -> str:
        """Listen on (host, port), port 0 for any free one; returns the URL. OSError when it cannot bind."""
        app = web.Application(client_max_size=MAX_FRAME_BYTES, middlewares=[_json_errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        try:
            await web.TCPSite(self.runner, host, port).start()
        except OSError:
            await self.runner.cleanup()
            raise
        bound = self.runner.addresses[0][1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{bound}"
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    # ---- endpoints -----------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            req = decode(await request.read(), CompletionRequest)
            self._check_model(req.model)
            text, ids = completion_prompt(req.prompt)
            max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
            msg = generate_request(req, f"cmpl-{uuid.uuid4().hex}", text, ids, max_tokens)
        except ProtocolError as e:
            return self._error(e)
        shape = ResponseShape(False, msg.request_id, int(time.time()), self.model_name, bool(req.return_token_ids),
                              req.include_usage)
        return await self._serve(request, msg, shape, {})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        renamed = {"prompt": "messages"}
        try:
            req = decode(await request.read(), ChatRequest)
            self._check_model(req.model)
            if self.chat_template is None:
                raise no_template_error()
            prompt = self.chat_template.render(chat_messages(req.messages))
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            if req.max_completion_tokens is not None:
                renamed["max_tokens"] = "max_completion_tokens"
            if max_tokens is None:
                max_tokens = (await self.frontend.limits()).max_tokens
            msg = generate_request(req, f"chatcmpl-{uuid.uuid4().hex}", prompt, None, max_tokens)
        except ProtocolError as e:
            return self._error(e, renamed)
        shape = ResponseShape(True, msg.request_id, int(time.time()), self.model_name, bool(req.return_token_ids),
                              req.include_usage)
        return await self._serve(request, msg, shape, renamed)

    async def models(self, request: web.Request) -> web.Response:
        h = self.frontend.health()
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specstep",
                "max_model_len": h.max_model_len or None}
        return _json(200, {"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        h = self.frontend.health()
        return _json(200 if h.status == "ok" else 503, {f: getattr(h, f) for f in h.__struct_fields__})

    # ---- one request -----------------------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise model_not_found(model, self.model_name)

    async def _serve(self, request: web.Request, msg: GenerateRequest, shape: ResponseShape,
                     renamed: dict[str, str]) -> web.StreamResponse:
        try:
            st = self.frontend.admit(HTTP_IDENTITY, msg)
        except ProtocolError as e:
            return self._error(e, renamed)
        st.task = asyncio.current_task()  # cancelled by the frontend on shutdown, by aiohttp on a disconnect
        resp: web.StreamResponse | None = None
        final: Final | None = None  # once set, the request is over: a disconnect after it aborts nothing
        try:
            await self.frontend.submit(st)
            if not msg.stream:
                async for out in self.frontend.outputs(st):
                    final = out
                return _json(200, shape.response(final))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            first = True
            async for out in self.frontend.outputs(st):
                if isinstance(out, Final):
                    final = out
                    await resp.write(shape.last_chunks(out, first))
                elif out.text or (shape.return_token_ids and out.token_ids):
                    await resp.write(shape.chunk(out.text, out.token_ids, first))
                    first = False
            await resp.write_eof()
            return resp
        except ProtocolError as e:
            return await self._fail(resp, e, renamed)
        except asyncio.CancelledError:
            if st.cancel_reason != "shutdown" or final is not None:  # the client went away, or all was sent
                if final is None:
                    self.frontend.observe_abort(st)
                raise
            asyncio.current_task().uncancel()
            return await self._fail(resp, ProtocolError(ErrorCode.SHUTTING_DOWN, "the server shut down before the "
                                                        "request finished"), renamed)
        except ConnectionError:  # the client went away between two writes
            if final is None:
                self.frontend.observe_abort(st)
            return resp
        except Exception as e:  # a bug must not leave the client waiting forever
            log.exception("internal error serving request %r", msg.request_id)
            return await self._fail(resp, ProtocolError(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}: "
                                                        f"{e}"), renamed)
        finally:
            self.frontend.forget(st)

    def _error(self, e: ProtocolError, renamed: dict[str, str] | None = None) -> web.Response:
        self.frontend.metrics.observe_error(e.code)
        status, body = error_body(e, renamed)
        return _json(status, body)

    async def _fail(self, resp: web.StreamResponse | None, e: ProtocolError,
                    renamed: dict[str, str]) -> web.StreamResponse:
        """The error as a response, or as the last event of a stream already under way."""
        if resp is None:
            return self._error(e, renamed)
        self.frontend.metrics.observe_error(e.code)
        try:
            await resp.write(sse(error_body(e, renamed)[1]) + DONE)
            await resp.write_eof()
        except ConnectionError:
            pass
        return resp


def _json(status: int, body: dict) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(body), content_type="application/json")


@web.middleware
async def _json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own refusals (no such path, wrong method, body too large) in OpenAI's error shape."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = ErrorCode.TOO_LARGE if e.status == 413 else ErrorCode.INVALID_PARAMS
        _, body = error_body(ProtocolError(code, f"{request.method} {request.path}: {e.reason}"))
        if e.status != 413:  # 413 keeps too_large, as a ZMQ client would get it
            body["error"]["code"] = e.reason.lower().replace(" ", "_")
        return _json(e.status, body)
