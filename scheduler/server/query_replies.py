"""Replies to one client's HEALTH/STATS queries, in the order it asked (the protocol matches them by order).

A STATS reply waits for the scheduler; a HEALTH reply does not. So a HEALTH answered at once could overtake a
STATS asked before it: while a client has a query pending, its later queries queue behind it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from specstep.scheduler.server.protocol import Error, ErrorCode, Wire

log = logging.getLogger("specstep.frontend")


class QueryReplies:
    def __init__(self, send: Callable[[bytes, Wire], object]) -> None:
        self._send = send
        self._last: dict[bytes, asyncio.Task] = {}  # per client: its last queued reply

    def pending(self, identity: bytes) -> bool:
        return identity in self._last

    def queue(self, identity: bytes, make: Callable[[], Awaitable[Wire]]) -> None:
        """Send `await make()` to the client after its earlier queued replies (an INTERNAL error if it fails)."""
        prev = self._last.get(identity)

        async def answer() -> None:
            if prev is not None:
                await asyncio.wait([prev])
            try:
                reply = await make()
            except Exception as e:  # noqa: BLE001 (answer the query whatever went wrong)
                log.exception("internal error answering a query")
                reply = Error(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
            self._send(identity, reply)

        task = asyncio.get_running_loop().create_task(answer())
        self._last[identity] = task

        def done(_: asyncio.Task) -> None:
            if self._last.get(identity) is task:
                del self._last[identity]
        task.add_done_callback(done)
