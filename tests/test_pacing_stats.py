"""The chunked-prefill pacer's figures where an operator sees them (real server process, real sockets): the ready
line states the ITL target and the compute-efficient size, STATS carries the budget at the current batch, the ITL
target, the efficient size and the share of mixed steps, and the Prometheus gauges equal them."""

from __future__ import annotations

import asyncio

from specstep.loadgen.client import Client
from specstep.loadgen.server import ServerProcess
from specstep.scheduler.server.protocol import GenerateRequest


def test_pacer_figures_in_the_ready_line_stats_and_gauges(tiny_target):
    args = ["--model", str(tiny_target), "--spec", "ngram", "--num-spec-tokens", "3", "--spec-policy", "fixed",
            "--device", "cpu", "--kv-cache-tokens", "8192"]  # serve's default: chunked prefill, calibrated

    async def go(address: str):
        client = Client(address)
        try:
            # streams first, then prompts arriving while they decode: mixed steps
            streams = [asyncio.create_task(client.complete(GenerateRequest(
                request_id=f"s{i}", prompt_token_ids=[5 + i, 9, 11, 3] * 4, max_tokens=120, temperature=0.0,
                ignore_eos=True), timeout_s=120)) for i in range(3)]
            await asyncio.sleep(0.5)
            mid = await client.stats()
            late = [await client.complete(GenerateRequest(
                request_id=f"p{i}", prompt_token_ids=list(range(10, 200)), max_tokens=2, temperature=0.0,
                ignore_eos=True), timeout_s=120) for i in range(2)]
            results = await asyncio.gather(*streams)
            await client.wait_idle()
            return results + late, mid, await client.stats()
        finally:
            client.close()

    with ServerProcess(args) as srv:
        results, mid, stats = asyncio.run(go(srv.start()))
        ready = next(line for line in srv.log().splitlines() if line.startswith("specstep serve: ready"))
    assert all(r.final is not None for r in results)
    assert "ITL target of 3 x the running streams' decode step" in ready and "compute-efficient" in ready
    eng, m = stats.engine, stats.metrics
    assert 0 < eng.mixed_step_share < 1  # the late prompts mixed with the streams' steps; the rest decoded alone
    assert eng.prefill_efficient_tokens >= 16 and eng.prefill_budget_tokens >= 1
    assert mid.engine.prefill_itl_target_ms > 0  # streams were running: their target
    assert m["specstep_mixed_step_share"] == eng.mixed_step_share
    assert m["specstep_prefill_efficient_tokens"] == eng.prefill_efficient_tokens
    assert m["specstep_prefill_budget_tokens"] == eng.prefill_budget_tokens
    assert m["specstep_prefill_itl_target_seconds"] == eng.prefill_itl_target_ms / 1e3
