"""Drive one load point against a server: closed loop (fixed concurrency) or open loop (Poisson arrivals)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from specstep.loadgen.client import Client, Result
from specstep.scheduler.server.protocol import GenerateRequest

if TYPE_CHECKING:
    from specstep.loadgen.router import Router


@dataclass(frozen=True, slots=True)
class LoadPoint:
    mode: str  # "closed" | "open"
    load: float  # concurrency (closed) or requests per second (open)

    @property
    def label(self) -> str:
        return f"c={int(self.load)}" if self.mode == "closed" else f"rate={self.load:g}/s"


@dataclass(slots=True)
class RunResult:
    point: LoadPoint
    results: list[Result]
    duration_s: float


async def run_point(client: Client | Router, point: LoadPoint, requests: list[GenerateRequest], tag: str,
                    on_done: Callable[[Result], None] = lambda r: None, timeout_s: float = 600.0,
                    seed: int = 0) -> RunResult:
    """Send every request in `requests` (ids prefixed with `tag`) and collect the results (a request that times
    out is one with a CLIENT_TIMEOUT error, see Client.complete)."""
    reqs = [msgspec.structs.replace(r, request_id=f"{tag}-{r.request_id}") for r in requests]

    async def one(req: GenerateRequest) -> Result:
        res = await client.complete(req, timeout_s)
        on_done(res)
        return res

    start = time.perf_counter()
    if point.mode == "closed":
        results = await _closed(reqs, max(1, int(point.load)), one)
    else:
        results = await _open(reqs, point.load, one, random.Random(seed))
    return RunResult(point, results, time.perf_counter() - start)


async def _closed(reqs: list[GenerateRequest], concurrency: int, one) -> list[Result]:
    """`concurrency` workers, each sending its next request as soon as its previous one finishes."""
    results: list[Result | None] = [None] * len(reqs)
    it = iter(enumerate(reqs))

    async def worker() -> None:
        for i, req in it:
            results[i] = await one(req)

    await asyncio.gather(*[worker() for _ in range(min(concurrency, len(reqs)))])
    return [r for r in results if r is not None]


async def _open(reqs: list[GenerateRequest], rate: float, one, rng: random.Random) -> list[Result]:
    """Arrivals of a Poisson process at `rate` per second, independent of how fast the server answers."""
    tasks = []
    next_t = time.perf_counter()
    for req in reqs:
        delay = next_t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(req)))
        next_t += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))
