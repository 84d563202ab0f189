"""Preemption by recompute through the server: a deliberately tiny KV pool and many long requests, with a
draft-model proposer (so both KV pools are paged); every output equals offline decoding with a large pool."""

from __future__ import annotations

import asyncio
import random

from specstep.engine.sampling_params import SamplingParams
from specstep.loadgen.client import Client
from specstep.loadgen.server import ServerProcess
from specstep.scheduler.server.protocol import GenerateRequest
from tests.helpers import make_core, run_to_completion

NUM_REQUESTS = 8
PROMPT_LEN = 20
MAX_TOKENS = 48
PAGE_SIZE = 8
NUM_PAGES = 20  # 19 usable pages = 152 tokens; the requests need ~8 x 70 at once


async def test_tiny_kv_pool_preempts_without_changing_outputs(tiny_target, tiny_draft):
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 320) for _ in range(PROMPT_LEN)] for _ in range(NUM_REQUESTS)]
    want = [r.output_token_ids for r in run_to_completion(
        make_core(tiny_target, kv_cache_tokens=8192), prompts,
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))]

    srv = ServerProcess(["--model", str(tiny_target), "--spec", "draft_model", "--draft", str(tiny_draft),
                         "--num-spec-tokens", "2", "--device", "cpu", "--page-size", str(PAGE_SIZE),
                         "--num-pages", str(NUM_PAGES)])
    srv.start()
    clients = [Client(srv.address) for _ in range(4)]
    try:
        results = await asyncio.gather(*[
            clients[i % 4].complete(GenerateRequest(f"p{i}", prompt_token_ids=p, max_tokens=MAX_TOKENS,
                                                    temperature=0.0, ignore_eos=True), 120)
            for i, p in enumerate(prompts)])
        got = [r.token_ids for r in results]
        diff = [(i, r.error, r.final and r.final.num_preemptions, g[:12], w[:12]) for i, (r, g, w) in
                enumerate(zip(results, got, want)) if g != w]
        assert not diff, f"{diff}\n{srv.log()[-3000:]}"
        assert all(r.final.finish_reason == "length" for r in results)
        assert sum(r.final.num_preemptions for r in results) > 0
        stats = await clients[0].wait_idle(10)  # integrity checked, every page free again
        assert stats.engine.num_preemptions > 0 and stats.engine.num_usable_pages == NUM_PAGES - 1
    finally:
        for c in clients:
            c.close()
        assert srv.stop() == 0
