"""Several servers behind the one-client interface: what an upstream router does with replicas (docs/replicas.md).

Each replica gets its own Client (one DEALER socket). A request goes to the live replica with the fewest
outstanding requests; among equals, round-robin, so an idle fleet fills evenly and a slow or stuck replica,
whose requests stay outstanding, gets fewer new ones. A replica is left out ("down") while its HEALTH is not
"ok" or goes unanswered, and from the moment one of its requests ends in an error that says it cannot serve
(TAKES_DOWN) until the next health check (`refresh`, run before every load point).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq.asyncio

from specstep.loadgen.client import CLIENT_TIMEOUT, Client, Result
from specstep.scheduler.server.protocol import Error, ErrorCode, GenerateRequest, HealthReply, StatsReply

NO_REPLICA = -1  # an error code of our own: every replica was down when the request was to be sent

# Errors after which no new request goes to that replica until its HEALTH is "ok" again. Not ENGINE_DIED (the
# server restarts its scheduler and queues new requests for it) nor OVERLOADED (outstanding counts steer
# around it already).
TAKES_DOWN = frozenset({CLIENT_TIMEOUT, ErrorCode.UNAVAILABLE, ErrorCode.SHUTTING_DOWN})
_TIMEOUTS = (TimeoutError, asyncio.TimeoutError)


def error_name(code: int | str) -> str:
    """An error code (or an `errors` key of metrics.summarize: the code as a string) by name, loadgen's own
    codes included."""
    own = {CLIENT_TIMEOUT: "CLIENT_TIMEOUT", NO_REPLICA: "NO_REPLICA"}
    try:
        code = int(code)
        return own.get(code) or ErrorCode(code).name
    except ValueError:
        return f"code {code}"


class NoReplicaError(RuntimeError):
    """No replica is live."""


class Router:
    def __init__(self, addresses: list[str],
                 make_client: Callable[[str, zmq.asyncio.Context], Client] = Client) -> None:
        if not addresses or len(set(addresses)) != len(addresses):
            raise ValueError(f"need one or more distinct addresses, got {addresses}")
        self.ctx = zmq.asyncio.Context()
        self._make_client = make_client
        self.clients = {a: make_client(a, self.ctx) for a in addresses}  # in round-robin order
        self.outstanding = dict.fromkeys(addresses, 0)
        self.down: dict[str, str] = {}  # address -> why it is left out
        self.health: dict[str, HealthReply] = {}  # the last "ok" HEALTH of each replica that ever answered one
        self._cursor = 0  # the replica first in line among equals

    @property
    def addresses(self) -> list[str]:
        return list(self.clients)

    @property
    def live(self) -> list[str]:
        return [a for a in self.clients if a not in self.down]

    def pick(self) -> str | None:
        """The live replica with the fewest outstanding requests; among equals the first at or after the cursor,
        which then moves past it. None when every replica is down."""
        order = self.addresses
        n = len(order)
        live = [a for a in (order[(self._cursor + i) % n] for i in range(n)) if a not in self.down]
        if not live:
            return None
        best = min(live, key=self.outstanding.__getitem__)  # min keeps the first of equals: round-robin
        self._cursor = (order.index(best) + 1) % n
        return best

    async def complete(self, req: GenerateRequest, timeout_s: float | None = None) -> Result:
        """As Client.complete, on the replica `pick` chooses. Never raises for a replica's failure: the result
        carries the error (NO_REPLICA when none was live)."""
        address = self.pick()
        if address is None:
            return Result(req.request_id, error=Error(NO_REPLICA, "no live replica", req.request_id))
        self.outstanding[address] += 1
        try:
            res = await self.clients[address].complete(req, timeout_s)
        finally:
            self.outstanding[address] -= 1
        if res.error is not None and res.error.code in TAKES_DOWN:
            self.down.setdefault(address, f"{error_name(res.error.code)}: {res.error.message}")
        return res

    async def connect(self, timeout_s: float) -> None:
        """Wait, for all replicas at once and up to `timeout_s`, for each one's HEALTH to say "ok"; those that
        do not are down. Raises NoReplicaError when none does."""

        async def one(address: str) -> None:
            try:
                self.health[address] = await self.clients[address].wait_ready(timeout_s)
                self.down.pop(address, None)
            except _TIMEOUTS:
                self.down[address] = f"HEALTH not ok within {timeout_s:g} s (start-up)"

        await asyncio.gather(*(one(a) for a in self.clients))
        self._need_live()

    async def refresh(self, idle_timeout_s: float, health_timeout_s: float = 5.0) -> None:
        """Before a load point: a replica whose HEALTH is "ok" is live (again) once it holds no request (Client.
        wait_idle, whose page-integrity failure propagates); any other is down. Raises NoReplicaError when none
        is live."""

        async def one(address: str) -> None:
            client = self.clients[address]
            try:
                h = await client.health(health_timeout_s)
            except _TIMEOUTS:
                self.down[address] = f"no HEALTH reply within {health_timeout_s:g} s"
                if not self.outstanding[address]:
                    # A fresh DEALER for the next probe: queries lost with a dead process would otherwise
                    # never be answered and shift the in-order matching of every later HEALTH/STATS reply.
                    client.close()
                    self.clients[address] = self._make_client(address, self.ctx)
                return
            if h.status != "ok":
                self.down[address] = f"HEALTH status {h.status!r}"
                return
            self.health[address] = h
            try:
                await client.wait_idle(idle_timeout_s)
                self.down.pop(address, None)
            except _TIMEOUTS as e:  # wait_idle's own says what it saw; a STATS query's is empty
                self.down[address] = str(e) or "no STATS reply in time"

        await asyncio.gather(*(one(a) for a in self.clients))
        self._need_live()

    async def stats(self, timeout_s: float = 10.0) -> dict[str, StatsReply | None]:
        """Each live replica's STATS (None: no reply within `timeout_s`); down replicas are not asked."""

        async def one(address: str) -> StatsReply | None:
            try:
                return await self.clients[address].stats(timeout_s)
            except _TIMEOUTS:
                return None

        live = self.live
        return dict(zip(live, await asyncio.gather(*(one(a) for a in live))))

    def _need_live(self) -> None:
        if not self.live:
            raise NoReplicaError("no replica is live: " + "; ".join(f"{a}: {why}" for a, why in self.down.items()))

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.ctx.destroy(linger=0)
