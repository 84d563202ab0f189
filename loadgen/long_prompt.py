"""The `long-prompt` workload: steady decode streams, and long prompts arriving while they run.

What it answers: how much does prefilling one long prompt stall everyone else? Without chunked prefill
(`--no-chunked-prefill`) the whole prompt runs in a step of its own and every stream waits for it; with it
(serve's default, or `--max-num-batched-tokens`) the prompt is prefilled in chunks beside the streams' decode
tokens. Reported per load point:

- `stream_itl_p50_ms`: the streams' median inter-token gap over the whole point, and `stream_itl_quiet_p50_ms`
  over the gaps that overlap no long prompt's prefill (plain decoding, the reference);
- `stream_itl_prefill_p99_ms` / `_max_ms`: the p99 and the largest gap among those that overlap a long
  prompt's prefill (from its send to its first token), and the p99's ratio to the quiet median
  (`stream_itl_prefill_p99_over_p50`);
- `long_ttft_p50_ms` / `long_ttft_max_ms`: the long prompts' time to first token.

`--concurrency` is the number of streams. Each stream sends its next short request as soon as the previous one
ends, until the last long prompt has finished; the long prompts go one after another, the first once every
stream has produced tokens.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from specstep.loadgen.client import Client, Result
from specstep.loadgen.runner import LoadPoint, RunResult
from specstep.scheduler.server.protocol import GenerateRequest

if TYPE_CHECKING:
    from specstep.loadgen.router import Router

SETTLE_S = 0.5  # between long prompts, and after every stream's first token before the first one


@dataclass(frozen=True, slots=True)
class LongPromptLoad:
    long_prompt_tokens: int = 4000
    num_long_prompts: int = 2
    long_max_tokens: int = 8


@dataclass(slots=True)
class LongPromptRun:
    run: RunResult  # the streams' requests
    long: list[Result]


def long_requests(load: LongPromptLoad, vocab_size: int, seed: int) -> list[GenerateRequest]:
    rng = random.Random(seed + 7)
    return [GenerateRequest(f"long{i}", prompt_token_ids=[rng.randrange(vocab_size)
                                                           for _ in range(load.long_prompt_tokens)],
                            max_tokens=load.long_max_tokens, temperature=0.0, ignore_eos=True)
            for i in range(load.num_long_prompts)]


async def run_long_prompt_point(client: Client | Router, streams: int, stream_reqs: list[GenerateRequest],
                                long_reqs: list[GenerateRequest], tag: str, timeout_s: float) -> LongPromptRun:
    """`streams` closed-loop streams cycling through `stream_reqs` until every request of `long_reqs` (sent
    one at a time) has finished."""
    done = asyncio.Event()
    first_tokens = [asyncio.Event() for _ in range(streams)]
    results: list[Result] = []
    counter = iter(range(1 << 30))

    async def stream(w: int) -> None:
        while not done.is_set():
            n = next(counter)
            req = msgspec.structs.replace(stream_reqs[n % len(stream_reqs)], request_id=f"{tag}-s{n}")
            res = await client.complete(req, timeout_s)
            results.append(res)
            if res.chunk_times:
                first_tokens[w].set()

    async def long_prompts() -> list[Result]:
        await asyncio.wait_for(asyncio.gather(*[e.wait() for e in first_tokens]), timeout_s)
        out = []
        for req in long_reqs:
            await asyncio.sleep(SETTLE_S)
            out.append(await client.complete(msgspec.structs.replace(req, request_id=f"{tag}-{req.request_id}"),
                                             timeout_s))
        await asyncio.sleep(SETTLE_S)
        done.set()
        return out

    start = time.perf_counter()
    workers = [asyncio.ensure_future(stream(w)) for w in range(streams)]
    try:
        long = await long_prompts()
        await asyncio.gather(*workers)
    finally:
        done.set()
    return LongPromptRun(RunResult(LoadPoint("closed", streams), results, time.perf_counter() - start), long)


def summarize_long_prompt(lp: LongPromptRun) -> dict:
    windows = [(r.start, r.chunk_times[0]) for r in lp.long if r.chunk_times]
    gaps, during, quiet = [], [], []
    for r in lp.run.results:
        t = r.chunk_times
        for a, b in zip(t, t[1:]):
            gaps.append(b - a)
            (during if any(a < w1 and b > w0 for w0, w1 in windows) else quiet).append(b - a)
    ms = lambda xs, p: round(float(np.percentile(np.asarray(xs) * 1000.0, p)), 3) if xs else None  # noqa: E731
    p50 = ms(quiet, 50)
    p99 = ms(during, 99)
    ttfts = [w1 - w0 for w0, w1 in windows]
    return {
        "streams": int(lp.run.point.load),
        "stream_requests": len(lp.run.results),
        "stream_itl_p50_ms": ms(gaps, 50),
        "stream_itl_quiet_p50_ms": p50,
        "stream_itl_p99_ms": ms(gaps, 99),
        "stream_itl_prefill_gaps": len(during),
        "stream_itl_prefill_p99_ms": p99,
        "stream_itl_prefill_max_ms": ms(during, 100),
        "stream_itl_prefill_p99_over_p50": round(p99 / p50, 3) if p99 and p50 else None,
        "long_prompts": len(lp.long),
        "long_ttft_p50_ms": ms(ttfts, 50),
        "long_ttft_max_ms": ms(ttfts, 100),
        "long_errors": sum(1 for r in lp.long if not r.ok),
    }
