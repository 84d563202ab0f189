"""`specstep loadgen`: a tiny sweep across two server settings end to end, plus the runner and metrics alone."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

from specstep.loadgen.client import Result
from specstep.loadgen.metrics import summarize
from specstep.loadgen.runner import LoadPoint, RunResult, run_point
from specstep.loadgen.workloads import Workload, build_requests
from specstep.scheduler.protocol import Final, GenerateRequest, SpecStats, Timings, Usage

ROOT = Path(__file__).resolve().parent.parent


def test_sweep_across_settings_end_to_end(tiny_target, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "specstep.scheduler.cli", "loadgen", "--model", str(tiny_target), "--setting", "off",
           "--setting", "ngram=--spec ngram --num-spec-tokens 3",
           "--server-args", "--device cpu --kv-cache-tokens 4096",
           "--concurrency", "1,3", "--num-requests", "4", "--workload", "mix", "--prompt-tokens", "24",
           "--max-tokens", "8", "--warmup", "1", "--output-dir", str(out), "--quiet"]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "results.json").read_text())
    assert list(data["settings"]) == ["off", "ngram"]
    for name, s in data["settings"].items():
        assert s["health"]["spec"] == ("none" if name == "off" else "ngram")
        assert [p["label"] for p in s["points"]] == ["c=1", "c=3"]
        for p in s["points"]:
            assert p["num_ok"] == p["num_requests"] == 4 and p["errors"] == {}
            assert p["output_tokens"] == 4 * 8 and p["output_tokens_per_s"] > 0
            assert p["ttft_p50_ms"] > 0 and p["itl_p99_ms"] >= p["itl_p50_ms"] > 0
        assert s["server_stats"]["engine"]["integrity_ok"]
    assert all(p["acceptance_rate"] is None for p in data["settings"]["off"]["points"])
    assert all(p["acceptance_rate"] is not None for p in data["settings"]["ngram"]["points"])
    assert data["settings"]["off"]["points"][0]["speedup_vs_baseline"] == 1.0
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [(r["setting"], r["load"]) for r in rows] == [("off", "1.0"), ("off", "3.0"), ("ngram", "1.0"),
                                                         ("ngram", "3.0")]
    for png in ("throughput_vs_p99_itl.png", "throughput_vs_load.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "specstep serve: ready" in (out / "server-ngram.log").read_text()


class FakeClient:
    """Answers every request after `delay` seconds with `n` tokens in one message; records concurrency."""

    def __init__(self, delay: float = 0.01, n: int = 4) -> None:
        self.delay, self.n = delay, n
        self.active = self.peak = 0
        self.sent: list[str] = []

    async def complete(self, req: GenerateRequest, timeout_s=None) -> Result:
        self.sent.append(req.request_id)
        self.active += 1
        self.peak = max(self.peak, self.active)
        res = Result(req.request_id, start=asyncio.get_running_loop().time())
        await asyncio.sleep(self.delay)
        res.chunk_times = [res.start + self.delay / 2, res.start + self.delay]
        res.token_ids = list(range(self.n))
        res.final = Final(req.request_id, "length", [], "", Usage(3, self.n), SpecStats(6, 3, 2, 0.5, 2.5, []),
                          Timings())
        res.end = res.start + self.delay
        self.active -= 1
        return res


async def test_closed_loop_holds_concurrency():
    client = FakeClient()
    reqs = [GenerateRequest(str(i), prompt_token_ids=[1]) for i in range(10)]
    run = await run_point(client, LoadPoint("closed", 3), reqs, "t")
    assert client.peak == 3 and sorted(client.sent) == sorted(f"t-{i}" for i in range(10))
    s = summarize(run)
    assert (s["num_ok"], s["output_tokens"], s["acceptance_rate"], s["mean_accepted_length"]) == (10, 40, 0.5, 2.5)
    assert s["itl_p50_ms"] == s["itl_p99_ms"] and s["label"] == "c=3"


async def test_open_loop_arrivals_do_not_wait_for_answers():
    client = FakeClient(delay=0.2)
    reqs = [GenerateRequest(str(i), prompt_token_ids=[1]) for i in range(8)]
    run = await run_point(client, LoadPoint("open", 200.0), reqs, "t")
    assert client.peak >= 4  # arrivals every ~5 ms while each answer takes 200 ms
    assert run.duration_s < 1.0 and summarize(run)["label"] == "rate=200/s"


def test_workloads(tiny_target):
    code = build_requests(Workload("code", prompt_tokens=16, max_tokens=5), 3, 320, str(tiny_target))
    assert all(r.temperature == 0.0 and r.ignore_eos and r.max_tokens == 5 for r in code)
    assert all(len(r.prompt_token_ids) == 16 for r in code) or all(r.prompt for r in code)
    rnd = build_requests(Workload("random", prompt_tokens=7), 3, 320, None)
    assert all(r.temperature == 1.0 and len(r.prompt_token_ids) == 7 and r.seed is not None for r in rnd)
    mix = build_requests(Workload("mix", prompt_tokens=16), 4, 320, None)
    assert [r.temperature for r in mix] == [0.0, 1.0, 0.0, 1.0]
    assert isinstance(mix[0].prompt, str) and len(mix[0].prompt) == 64  # text fallback without a tokenizer
    run = RunResult(LoadPoint("closed", 1), [Result("x", error=None)], 1.0)
    assert summarize(run)["num_ok"] == 0 and summarize(run)["ttft_p50_ms"] is None


def test_long_prompt_summary_counts_the_gaps_that_overlap_a_prefill():
    from specstep.loadgen.long_prompt import LongPromptRun, summarize_long_prompt

    def res(start: float, times: list[float]) -> Result:
        return Result("x", start=start, chunk_times=times)
    streams = [res(0.0, [0.1, 0.2, 0.3, 1.5, 1.6, 1.7]), res(0.0, [0.15, 0.25, 0.35, 0.45])]
    long = [res(0.4, [1.4, 1.45])]  # its prefill: 0.4 .. 1.4
    s = summarize_long_prompt(LongPromptRun(RunResult(LoadPoint("closed", 2), streams, 2.0), long))
    # Overlapping [0.4, 1.4]: 0.3 -> 1.5 (1.2 s) and 0.35 -> 0.45 (0.1 s).
    assert s["stream_itl_prefill_gaps"] == 2 and s["stream_itl_prefill_max_ms"] == 1200.0
    assert s["stream_itl_quiet_p50_ms"] == 100.0 and s["long_ttft_p50_ms"] == 1000.0
    assert s["stream_itl_prefill_p99_over_p50"] == round(s["stream_itl_prefill_p99_ms"] / 100.0, 3)


def test_long_prompt_workload_end_to_end(tiny_target, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "specstep.scheduler.cli", "loadgen", "--model", str(tiny_target),
           "--setting", "chunked=--max-num-batched-tokens 40 --max-batch-size 8 --spec ngram",
           "--server-args", "--device cpu --kv-cache-tokens 4096", "--workload", "long-prompt",
           "--concurrency", "2", "--long-prompts", "1", "--long-prompt-tokens", "300", "--prompt-tokens", "16",
           "--max-tokens", "24", "--warmup", "0", "--output-dir", str(out), "--quiet", "--no-plots"]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (p,) = json.loads((out / "results.json").read_text())["settings"]["chunked"]["points"]
    assert p["long_prompts"] == 1 and p["long_errors"] == 0 and p["long_ttft_p50_ms"] > 0
    assert p["stream_requests"] >= 2 and p["errors"] == {} and p["stream_itl_prefill_gaps"] > 0
    assert "streams while a long prompt is prefilled" in proc.stdout + proc.stderr
