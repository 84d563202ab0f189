"""Operator metrics: Prometheus counters equal the per-request stats summed over a run; the endpoint serves
valid Prometheus text; the stats message carries the same figures (real server process, real sockets)."""

from __future__ import annotations

import asyncio
import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from specstep.loadgen.client import Client
from specstep.loadgen.server import ServerProcess
from specstep.scheduler.server.metrics import ServerMetrics
from specstep.scheduler.server.protocol import EngineStats, ErrorCode, GenerateRequest


def complete_all(address: str, reqs: list[GenerateRequest]):
    """Send every request at once, wait for their FINALs and the server to go idle; (results, stats)."""
    async def go():
        client = Client(address)
        try:
            results = await asyncio.gather(*(client.complete(r, timeout_s=120) for r in reqs))
            await client.wait_idle()
            return results, await client.stats()
        finally:
            client.close()
    return asyncio.run(go())


def test_counters_match_final_stats_and_endpoint_is_valid(tiny_target):
    args = ["--model", str(tiny_target), "--spec", "draft_model", "--draft", str(tiny_target),
            "--num-spec-tokens", "3", "--spec-policy", "fixed", "--device", "cpu", "--kv-cache-tokens", "4096",
            "--metrics-port", "0"]
    reqs = [GenerateRequest(request_id=f"m{i}", prompt_token_ids=[5 + i, 9, 11, 3][: 2 + i % 3],
                            max_tokens=10 + 3 * i, temperature=0.0, ignore_eos=True, stream=i % 2 == 0)
            for i in range(6)]
    bad = GenerateRequest(request_id="bad", prompt_token_ids=[1], max_tokens=0)
    with ServerProcess(args) as srv:
        results, stats = complete_all(srv.start(), reqs + [bad])
        assert results.pop().error.code == ErrorCode.INVALID_PARAMS
        port = int(re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", srv.log()).group(1))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    finals = [r.final for r in results]
    assert all(f is not None for f in finals)
    m = stats.metrics
    assert m["specstep_generation_tokens_total"] == sum(f.usage.completion_tokens for f in finals)
    assert m["specstep_prompt_tokens_total"] == sum(f.usage.prompt_tokens for f in finals)
    assert m["specstep_spec_decode_num_draft_tokens_total"] == sum(f.spec.drafted_tokens for f in finals)
    assert m["specstep_spec_decode_num_accepted_tokens_total"] == sum(f.spec.accepted_tokens for f in finals)
    assert m["specstep_spec_decode_num_drafts_total"] == sum(f.spec.spec_steps for f in finals)
    per_pos = [sum(f.spec.accepted_per_position[j] for f in finals if j < len(f.spec.accepted_per_position))
               for j in range(3)]
    assert [m[f'specstep_spec_decode_num_accepted_tokens_per_pos_total{{position="{j}"}}'] for j in range(3)] == per_pos
    assert m['specstep_requests_total{finish_reason="length"}'] == 6  # FINALs only: the error is counted apart
    assert m['specstep_errors_total{code="INVALID_PARAMS"}'] == 1
    assert m["specstep_time_to_first_token_seconds_count"] == 6
    assert m["specstep_num_requests_running"] == 0
    assert stats.engine is not None and stats.engine.spec_policy == "fixed"

    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["specstep_generation_tokens"].type == "counter"
    itl = families["specstep_inter_token_latency_seconds"]
    assert itl.type == "histogram" and "stream or not" in itl.documentation  # stream=false requests count too
    steps = sum(f.usage.completion_tokens for f in finals) - len(finals)  # at most one sample per later token
    assert 0 < m["specstep_inter_token_latency_seconds_count"] <= steps
    assert families["specstep_spec_decode_tokens_per_step"].type == "histogram"
    gen = next(s for s in families["specstep_generation_tokens"].samples if s.name.endswith("_total"))
    assert gen.value == m["specstep_generation_tokens_total"]


def engine_vs_counters(engine: EngineStats, samples: dict[str, float]) -> tuple[tuple, tuple]:
    """The scheduler's totals and the frontend's counters for the same quantities, in the same order."""
    finished = sum(v for k, v in samples.items() if k.startswith("specstep_requests_total{"))
    return ((engine.num_finished, engine.num_output_tokens, engine.drafted_tokens, engine.accepted_tokens),
            (finished, samples["specstep_generation_tokens_total"],
             samples["specstep_spec_decode_num_draft_tokens_total"],
             samples["specstep_spec_decode_num_accepted_tokens_total"]))


def test_stats_and_counters_agree_after_the_last_reply(tiny_target):
    """Finished requests, output tokens, drafted and accepted tokens: the STATS reply asked right after the last
    reply carries the scheduler's totals, and its counters and /metrics hold the same numbers, also with a request
    a stop string ended in the frontend and one the client aborted mid-stream (both aborted in the scheduler, which
    may have run steps for them that no client saw)."""
    args = ["--model", str(tiny_target), "--spec", "draft_model", "--draft", str(tiny_target),
            "--num-spec-tokens", "3", "--spec-policy", "fixed", "--device", "cpu", "--kv-cache-tokens", "4096",
            "--max-tokens-limit", "2000", "--metrics-port", "0"]
    prompt = [5, 9, 11, 3]
    plain = [GenerateRequest(request_id=f"s{i}", prompt_token_ids=[7 + i, *prompt], max_tokens=12 + 5 * i,
                             temperature=0.0, ignore_eos=True, stream=i % 2 == 0) for i in range(4)]

    async def go(address: str):
        client = Client(address)
        try:
            probe = await client.complete(GenerateRequest(request_id="probe", prompt_token_ids=prompt, max_tokens=40,
                                                          temperature=0.0, ignore_eos=True), timeout_s=120)
            stop = probe.text[20:24]
            cut = GenerateRequest(request_id="cut", prompt_token_ids=prompt, max_tokens=400, temperature=0.0,
                                  ignore_eos=True, stop=[stop])

            async def aborted() -> list:
                events = []
                async for msg in client.generate(GenerateRequest(request_id="gone", prompt_token_ids=prompt,
                                                                 max_tokens=400, temperature=0.0, ignore_eos=True)):
                    events.append(msg)
                    if len(events) == 1:
                        client.abort("gone")
                return events

            results = await asyncio.gather(*(client.complete(r, timeout_s=120) for r in [*plain, cut]), aborted())
            right_after = await client.stats()  # no wait: the last reply has just arrived
            idle = await client.wait_idle()
            return probe, stop, results, right_after, idle
        finally:
            client.close()

    with ServerProcess(args) as srv:
        probe, stop, results, right_after, idle = asyncio.run(go(srv.start()))
        port = int(re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", srv.log()).group(1))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    *finished, gone = results
    assert stop.strip() and all(r.final is not None for r in finished), (stop, finished)
    assert finished[-1].final.finish_reason == "stop" and gone[-1].finish_reason == "abort"
    scraped = {s.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())) + "}" if s.labels else ""):
               s.value for f in text_string_to_metric_families(text) for s in f.samples}
    for reply in (right_after, idle):
        engine, counters = engine_vs_counters(reply.engine, reply.metrics)
        assert engine == counters
        assert engine[0] == 1 + len(plain) + 2  # every request ended once: the probe, the plain ones, cut, gone
    assert engine_vs_counters(idle.engine, scraped)[1] == engine_vs_counters(idle.engine, idle.metrics)[0]
    assert idle.engine.drafted_tokens >= idle.engine.accepted_tokens > 0
    assert idle.engine.num_output_tokens >= sum(r.final.usage.completion_tokens for r in finished) + 40


def test_policy_state_in_finals_stats_and_metrics(tiny_target, tiny_draft):
    """With a draft that is almost never right, the adaptive policy stops drafting: each FINAL says how long
    the request spent off and probing and its acceptance estimate; stats and Prometheus show the decisions."""
    args = ["--model", str(tiny_target), "--spec", "draft_model", "--draft", str(tiny_draft),
            "--num-spec-tokens", "3", "--spec-policy", "adaptive", "--device", "cpu", "--kv-cache-tokens", "4096"]
    reqs = [GenerateRequest(request_id=f"p{i}", prompt_token_ids=[5 + i, 9, 11, 3], max_tokens=80, temperature=0.0,
                            ignore_eos=True) for i in range(3)]
    with ServerProcess(args) as srv:
        results, stats = complete_all(srv.start(), reqs)
    for r in results:
        spec = r.final.spec
        decode_steps = spec.steps_off + spec.spec_steps
        assert spec.steps_off > spec.spec_steps, spec  # mostly off
        assert 0 < decode_steps <= r.final.usage.completion_tokens - 1
        assert spec.steps_probing <= spec.spec_steps
        assert 0.0 <= spec.acceptance_estimate < 0.5
    eng = stats.engine
    assert eng.spec_policy == "adaptive" and eng.spec_governor in ("on", "off")
    assert eng.spec_decisions.get("explore", 0) > 0 and sum(eng.spec_decisions.values()) > 0
    m = stats.metrics
    assert m['specstep_spec_decisions{reason="explore"}'] == eng.spec_decisions["explore"]
    assert m["specstep_spec_governor_on"] in (0.0, 1.0)


def test_gauges_follow_a_restarted_scheduler():
    """A new scheduler process counts from zero: a decision reason or a k it has not reported reads 0, not the
    dead process's last value."""
    metrics = ServerMetrics()
    metrics.update_engine(EngineStats(k_distribution={3: 2}, spec_decisions={"explore": 5, "model": 9}))
    metrics.update_engine(EngineStats(k_distribution={0: 1}, spec_decisions={"explore": 1}))
    m = metrics.snapshot()
    assert m['specstep_spec_decisions{reason="model"}'] == 0 and m['specstep_spec_decisions{reason="explore"}'] == 1
    assert m['specstep_spec_decode_k{k="3"}'] == 0 and m['specstep_spec_decode_k{k="0"}'] == 1
