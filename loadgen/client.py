"""An async client of the public protocol (docs/protocol.md): what an upstream router does, in Python.

One DEALER socket and one reader task that routes each reply by request id into that request's queue;
health and stats replies (which carry no id) resolve waiting futures in order.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from specstep.scheduler.server.protocol import (
    AbortRequest,
    Delta,
    Error,
    Final,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    ProtocolError,
    StatsReply,
    StatsRequest,
    Wire,
    decode_server,
    encode,
)
from specstep.scheduler.server.sockets import make_socket

Event = Delta | Final | Error
CLIENT_TIMEOUT = 0  # an error code of our own (the server's codes start at 1): no answer within the timeout


@dataclass(slots=True)
class Result:
    """One request as the client saw it."""

    request_id: str
    address: str = ""  # the server that answered it ("": none took it, see loadgen/router.py)
    start: float = 0.0
    end: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    final: Final | None = None
    error: Error | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each message that carried tokens
    num_deltas: int = 0

    @property
    def ok(self) -> bool:
        return self.final is not None

    @property
    def num_output_tokens(self) -> int:
        """Tokens received; from the reported usage where the tokens themselves do not come back (OpenAI's API)."""
        if self.token_ids or self.final is None:
            return len(self.token_ids)
        return self.final.usage.completion_tokens

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive token-carrying messages (several tokens may arrive in one)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


async def poll_ready(health: Callable[..., Awaitable[HealthReply]], timeout_s: float) -> HealthReply:
    """Poll `health` until the server reports "ok" (either client's: ZMQ HEALTH or HTTP /health)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            h = await health(timeout_s=1.0)
            if h.status == "ok":
                return h
        except asyncio.TimeoutError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"server not ready within {timeout_s:g}s")
        await asyncio.sleep(0.1)


class Client:
    def __init__(self, address: str, ctx: zmq.asyncio.Context | None = None) -> None:
        self.address = address
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.asyncio.Context()
        self.sock = make_socket(self.ctx, zmq.DEALER, connect=address)
        self._streams: dict[str, asyncio.Queue] = {}
        self._replies: deque[asyncio.Future] = deque()
        self.stray: list[Wire] = []  # replies with no waiting request (e.g. errors for malformed messages)
        self._reader: asyncio.Task | None = None

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                msg = decode_server(frames)
            except ProtocolError as e:
                self.stray.append(e.to_wire())
                continue
            if isinstance(msg, (HealthReply, StatsReply)):
                if self._replies:
                    fut = self._replies.popleft()
                    if not fut.done():
                        fut.set_result(msg)
                continue
            q = self._streams.get(msg.request_id) if msg.request_id is not None else None
            if isinstance(msg, Error) and msg.request_continues:
                q = None  # a refused duplicate: the request running under this id goes on (docs/protocol.md)
            if q is None:
                self.stray.append(msg)
            else:
                q.put_nowait(msg)

    def send(self, msg: Wire) -> None:
        self.sock.send_multipart(encode(msg))

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Event]:
        """Send `req` and yield its Deltas, then its Final or Error."""
        self._ensure_reader()
        if req.request_id in self._streams:
            raise ValueError(f"request id {req.request_id!r} is already in flight on this client")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[req.request_id] = q
        try:
            self.send(req)
            while True:
                msg = await q.get()
                yield msg
                if not isinstance(msg, Delta):
                    return
        finally:
            self._streams.pop(req.request_id, None)

    async def complete(self, req: GenerateRequest, timeout_s: float | None = None) -> Result:
        """The whole request. Past `timeout_s` it is aborted on the server and ends with a CLIENT_TIMEOUT error:
        a server that does not answer (dead, unreachable) costs at most the timeout, never a hang."""
        res = Result(req.request_id, address=self.address, start=time.perf_counter())

        async def collect() -> None:
            async for msg in self.generate(req):
                now = time.perf_counter()
                if isinstance(msg, Error):
                    res.error = msg
                    break
                if msg.token_ids:
                    res.chunk_times.append(now)
                res.token_ids.extend(msg.token_ids)
                res.text += msg.text
                if isinstance(msg, Final):
                    res.final = msg
                else:
                    res.num_deltas += 1

        try:
            await asyncio.wait_for(collect(), timeout_s)
        except asyncio.TimeoutError:
            self.abort(req.request_id)
            res.error = Error(CLIENT_TIMEOUT, f"client-side timeout after {timeout_s:g} s", req.request_id)
        res.end = time.perf_counter()
        return res

    def abort(self, request_id: str) -> None:
        self.send(AbortRequest(request_id))

    async def _query(self, msg: Wire, timeout_s: float) -> Wire:
        self._ensure_reader()
        fut = asyncio.get_running_loop().create_future()
        self._replies.append(fut)  # a timed-out future stays queued and absorbs its late reply
        self.send(msg)
        return await asyncio.wait_for(asyncio.shield(fut), timeout_s)

    async def health(self, timeout_s: float = 5.0) -> HealthReply:
        return await self._query(HealthRequest(), timeout_s)

    async def stats(self, timeout_s: float = 10.0) -> StatsReply:
        return await self._query(StatsRequest(), timeout_s)

    async def wait_ready(self, timeout_s: float = 120.0) -> HealthReply:
        return await poll_ready(self.health, timeout_s)

    async def wait_idle(self, timeout_s: float = 30.0) -> StatsReply:
        """Poll stats until the server holds no request and every KV page is free (a finished request's pages
        are released once no step in flight includes it). Raises if page integrity fails or time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            s = await self.stats()
            e = s.engine
            if e is not None and not e.integrity_ok:
                raise AssertionError(f"KV page integrity check failed: {e.integrity_error}")
            if (e is not None and s.num_inflight == 0 and e.num_running == 0 and e.num_waiting == 0
                    and e.num_free_pages == e.num_usable_pages):
                return s
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not idle within {timeout_s:g}s: {s}")
            await asyncio.sleep(0.05)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.sock.close(linger=0)
        if self._own_ctx:
            self.ctx.destroy(linger=0)
