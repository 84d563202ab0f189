"""`specstep loadgen`: a tiny sweep across two server settings end to end, plus the runner and metrics alone;
several replicas: the router's policy alone, then loadgen and the router against two real servers."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from specstep.engine.sampling_params import SamplingParams
from specstep.loadgen.cli import parse_addresses
from specstep.loadgen.client import CLIENT_TIMEOUT, Client, Result
from specstep.loadgen.metrics import per_address, summarize
from specstep.loadgen.router import NO_REPLICA, Router
from specstep.loadgen.runner import LoadPoint, RunResult, run_point
from specstep.loadgen.server import ServerProcess
from specstep.loadgen.workloads import Workload, build_requests
from specstep.scheduler.server.protocol import Error, ErrorCode, Final, GenerateRequest, SpecStats, Timings, Usage
from tests.helpers import make_core, run_to_completion

ROOT = Path(__file__).resolve().parent.parent


def test_sweep_across_settings_end_to_end(tiny_target, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "specstep.scheduler.cli", "loadgen", "--model", str(tiny_target), "--setting", "off",
           "--setting", "ngram=--spec ngram --num-spec-tokens 3 --spec-policy fixed",
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


# ---- several replicas (loadgen/router.py) --------------------------------------------------------------------------
class FakeReplica:
    """A replica behind the Router: answers after `delay` s; with `error`, ends every request in that error."""

    def __init__(self, address: str, delay: float = 0.0, error: int | None = None) -> None:
        self.address, self.delay, self.error = address, delay, error
        self.sent: list[str] = []

    async def complete(self, req: GenerateRequest, timeout_s=None) -> Result:
        self.sent.append(req.request_id)
        await asyncio.sleep(self.delay)
        if self.error is not None:
            return Result(req.request_id, address=self.address, error=Error(self.error, "x", req.request_id))
        return Result(req.request_id, address=self.address, token_ids=[1, 2],
                      final=Final(req.request_id, "length", [], "", Usage(1, 2), SpecStats(), Timings()))

    def close(self) -> None:
        pass


def fake_router(*replicas: FakeReplica) -> Router:
    by_address = {r.address: r for r in replicas}
    return Router(list(by_address), make_client=lambda address, _ctx: by_address[address])


async def test_router_least_outstanding_ties_round_robin():
    a, b, c = FakeReplica("A"), FakeReplica("B"), FakeReplica("C")
    router = fake_router(a, b, c)
    try:
        for i in range(6):  # one at a time: always a tie, so round-robin
            assert (await router.complete(GenerateRequest(str(i), prompt_token_ids=[1]))).ok
        assert (a.sent, b.sent, c.sent) == (["0", "3"], ["1", "4"], ["2", "5"])
        a.delay = 0.3
        slow = asyncio.ensure_future(router.complete(GenerateRequest("slow", prompt_token_ids=[1])))  # to A
        await asyncio.sleep(0.01)
        done = [await router.complete(GenerateRequest(f"q{i}", prompt_token_ids=[1])) for i in range(4)]
        assert a.sent[-1] == "slow" and "q0" not in a.sent  # A holds one outstanding: B and C take the rest
        assert [r.address for r in done] == ["B", "C", "B", "C"]
        assert (await slow).address == "A"
        a.delay = 0.0  # equals again: three workers over three replicas, each keeps one outstanding on each
        run = await run_point(router, LoadPoint("closed", 3), [GenerateRequest(str(i), prompt_token_ids=[1])
                                                                for i in range(9)], "t")
        per = summarize(run, router.addresses)["per_address"]
        assert {k: v["num_requests"] for k, v in per.items()} == {"A": 3, "B": 3, "C": 3}
    finally:
        router.close()


async def test_router_skips_a_replica_that_timed_out_and_reports_it():
    a, b = FakeReplica("A", error=CLIENT_TIMEOUT), FakeReplica("B")
    router = fake_router(a, b)
    try:
        run = await run_point(router, LoadPoint("closed", 1), [GenerateRequest(str(i), prompt_token_ids=[1])
                                                                for i in range(5)], "t")
        assert len(a.sent) == 1 and len(b.sent) == 4  # A's timeout took it out of the rotation
        assert router.down == {"A": "CLIENT_TIMEOUT: x"} and router.live == ["B"]
        s = summarize(run, router.addresses)
        assert s["errors"] == {"0": 1} and s["num_ok"] == 4
        assert s["per_address"]["A"]["errors"] == {"0": 1} and s["per_address"]["B"]["num_ok"] == 4
        b.error = ErrorCode.SHUTTING_DOWN
        await router.complete(GenerateRequest("last", prompt_token_ids=[1]))
        none_left = await router.complete(GenerateRequest("none", prompt_token_ids=[1]))
        assert none_left.error.code == NO_REPLICA and none_left.address == ""  # at once, not after a timeout
        assert "unrouted" in per_address([none_left], router.addresses)
    finally:
        router.close()


def test_parse_addresses():
    assert parse_addresses(["tcp://a:1,tcp://b:2", " tcp://c:3 "]) == ["tcp://a:1", "tcp://b:2", "tcp://c:3"]
    with pytest.raises(ValueError, match="twice"):
        parse_addresses(["tcp://a:1", "tcp://a:1"])


@pytest.fixture(scope="module")
def two_servers(tiny_target):
    servers = [ServerProcess(["--model", str(tiny_target), "--device", "cpu", "--kv-cache-tokens", "2048"])
               for _ in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(120), servers))
        yield servers
    finally:
        codes = [s.stop() for s in servers]
    assert codes == [0, 0], [s.log()[-2000:] for s in servers]


async def served(address: str) -> tuple[int, int]:
    """(requests ended with a FINAL, output tokens delivered) so far, from the server's own STATS."""
    client = Client(address)
    try:
        m = (await client.stats()).metrics
    finally:
        client.close()
    return (int(sum(v for k, v in m.items() if k.startswith("specstep_requests_total{"))),
            int(m["specstep_generation_tokens_total"]))


def run_loadgen(tiny_target, out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "specstep.scheduler.cli", "loadgen", "--model", str(tiny_target), *args,
           "--prompt-tokens", "16", "--max-tokens", "8", "--warmup", "0", "--output-dir", str(out), "--quiet",
           "--no-plots"]
    return subprocess.run(cmd, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"), cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


async def test_loadgen_spreads_requests_over_two_servers(two_servers, tiny_target, tmp_path):
    a, b = (s.address for s in two_servers)
    before = {x: await served(x) for x in (a, b)}
    proc = await asyncio.to_thread(run_loadgen, tiny_target, tmp_path, "--address", a, "--address", b,
                                   "--concurrency", "2", "--num-requests", "6", "--workload", "mix")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads((tmp_path / "results.json").read_text())["settings"]["server"]
    (p,) = s["points"]
    assert p["num_ok"] == p["num_requests"] == 6 and p["output_tokens"] == 6 * 8 and p["errors"] == {}
    per = p["per_address"]
    assert list(per) == [a, b] and {x: r["down"] for x, r in s["replicas"].items()} == {a: None, b: None}
    for x in (a, b):
        after = await served(x)
        # The server's own count, not only loadgen's bookkeeping: both got requests, and exactly these.
        assert (after[0] - before[x][0], after[1] - before[x][1]) == (per[x]["num_ok"], per[x]["output_tokens"])
        assert per[x]["num_ok"] == per[x]["num_requests"] >= 2 and per[x]["errors"] == {}
        assert per[x]["output_tokens"] == 8 * per[x]["num_ok"] and per[x]["latency_p99_ms"] > 0
        assert s["replicas"][x]["health"]["address"] == x and s["replicas"][x]["server_stats"]["engine"]["integrity_ok"]
    assert sum(r["num_requests"] for r in per.values()) == p["num_requests"]
    assert sum(r["output_tokens"] for r in per.values()) == p["output_tokens"]
    assert "per address" in proc.stdout + proc.stderr


async def test_router_outputs_match_offline_greedy(two_servers, tiny_target):
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 320) for _ in range(rng.randrange(4, 20))] for _ in range(6)]
    core = make_core(tiny_target, kv_cache_tokens=2048)
    want = [r.output_token_ids for r in run_to_completion(core, prompts, SamplingParams(temperature=0.0,
                                                                                        max_tokens=10))]
    router = Router([s.address for s in two_servers])
    try:
        await router.connect(30)
        results = await asyncio.gather(*(router.complete(GenerateRequest(f"g{i}", prompt_token_ids=p, max_tokens=10,
                                                                          temperature=0.0, ignore_eos=True), 60)
                                         for i, p in enumerate(prompts)))
    finally:
        router.close()
    assert [r.token_ids for r in results] == [w[:10] for w in want]
    assert {r.address for r in results} == {s.address for s in two_servers}


async def test_loadgen_reports_a_dead_address_and_serves_on(two_servers, tiny_target, tmp_path):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    live = two_servers[0].address
    t0 = time.monotonic()
    proc = await asyncio.to_thread(run_loadgen, tiny_target, tmp_path, "--address", f"{live},{dead}",
                                   "--startup-timeout", "2", "--concurrency", "2", "--num-requests", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 120
    s = json.loads((tmp_path / "results.json").read_text())["settings"]["server"]
    assert "no HEALTH reply" in s["replicas"][dead]["down"] and s["replicas"][live]["down"] is None
    (p,) = s["points"]
    assert p["per_address"][dead]["num_requests"] == 0 and p["per_address"][live]["num_ok"] == 4 == p["num_ok"]
    assert f"replica {dead} is down, no requests go to it: HEALTH not ok within 2 s" in proc.stdout + proc.stderr
    client = Client(dead)  # a request to it ends in a typed client-side timeout, not a hang
    try:
        res = await client.complete(GenerateRequest("r", prompt_token_ids=[1]), timeout_s=0.2)
    finally:
        client.close()
    assert (res.error.code, res.address, res.ok) == (CLIENT_TIMEOUT, dead, False)


REQUESTS = 36


async def test_router_routes_around_a_replica_that_stops_answering(two_servers):
    """Last in the module: it freezes the second server (SIGSTOP) for a moment."""
    a, b = two_servers
    router = Router([a.address, b.address])
    try:
        await router.connect(30)
        b.signal(signal.SIGSTOP)
        try:
            # enough requests that a's share outlasts the stuck one's 0.5 s timeout on a fast host too (~45 ms a
            # request here: 11 of them once ended 0.03 s before it)
            reqs = [GenerateRequest(str(i), prompt_token_ids=[1, 2, 3], max_tokens=16, ignore_eos=True)
                    for i in range(REQUESTS)]
            t0 = time.monotonic()
            run = await run_point(router, LoadPoint("closed", 2), reqs, "stuck", timeout_s=0.5)
            elapsed = time.monotonic() - t0
            await router.refresh(10, health_timeout_s=0.5)
            assert router.down == {b.address: "no HEALTH reply within 0.5 s"}
        finally:
            b.signal(signal.SIGCONT)
        await router.refresh(10)  # answering again, on a fresh connection
        assert router.live == [a.address, b.address]
    finally:
        router.close()
    per = summarize(run, router.addresses)["per_address"]
    # One request waited out its timeout on the frozen server, which then left the rotation; the rest ran on a
    # (and some of them after that timeout, when b had fewer outstanding requests than a).
    assert per[b.address]["num_requests"] == 1 and per[b.address]["errors"] == {str(CLIENT_TIMEOUT): 1}
    assert per[a.address]["num_ok"] == REQUESTS - 1 and elapsed < 10
    (stuck,) = [r for r in run.results if r.address == b.address]
    assert max(r.end for r in run.results if r.address == a.address) > stuck.end
