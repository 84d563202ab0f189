"""Tensor parallelism end to end (gloo on CPU): greedy output at TP = 2 is token-identical to TP = 1 on several
checkpoint shapes, with no speculation and every proposer, through the engine (what `generate` drives), the
`generate` CLI and a server; seeded sampling without speculation equals TP = 1; a follower that cannot start
fails start-up at once; a killed follower fails the in-flight requests with a typed error and the group is
restarted."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specstep.engine.errors import ConfigError, ParallelError
from specstep.engine.sampling_params import SamplingParams
from specstep.loadgen.client import Client
from specstep.loadgen.server import ServerProcess
from specstep.scheduler.parallel import tp_group
from specstep.scheduler.server.protocol import Delta, Error, ErrorCode, GenerateRequest
from tests.fixtures_models import make_mtp_head
from tests.helpers import make_checkpoint, make_core, run_to_completion

PROMPTS = [[5, 9, 11, 3, 7] * 3, [4, 2] * 4, [8] * 11, [17, 4, 9, 21, 5, 6, 7]]
SHAPES = {  # name: make_checkpoint overrides
    "gqa": {},
    "mha": dict(num_key_value_heads=4),
    "tied": dict(tie_word_embeddings=True),
    "qwen2": dict(arch="qwen2"),
}
# "self": the target as its own draft model (every draft accepted: the leader's acceptance must reach the others)
CASES = [("gqa", "none"), ("gqa", "ngram"), ("gqa", "mtp"), ("gqa", "draft_model"), ("gqa", "self"), ("mha", "mtp"),
         ("mha", "draft_model"), ("tied", "none"), ("tied", "mtp"), ("qwen2", "ngram"), ("qwen2", "mtp")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    out = {}
    for name, kw in SHAPES.items():
        kw = dict(kw)
        target = make_checkpoint(tmp / name, seed=3, **kw)
        if kw.get("arch") == "qwen2":  # random biases: transformers saves zeros, which would hide a bias bug
            _randomise_biases(target)
        out[name] = (target, make_mtp_head(tmp / f"{name}-head", target))
    draft = make_checkpoint(tmp / "draft", seed=1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1)
    return out, draft


def _randomise_biases(folder: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(str(path))
    g = torch.Generator().manual_seed(0)
    for name, t in state.items():
        if name.endswith(".bias"):
            state[name] = torch.randn(t.shape, generator=g) * 0.5
    save_file(state, str(path), metadata={"format": "pt"})


def outputs(target, spec, draft, params, tp, spec_policy_override="fixed", **cfg):
    core = make_core(target, spec=spec, draft=draft, num_spec_tokens=3, spec_policy=spec_policy_override,
                     max_batch_size=4, tensor_parallel_size=tp, **cfg)
    reqs = run_to_completion(core, PROMPTS, params)
    drafted = sum(r.stats.drafted for r in reqs)
    core.close()
    return [r.output_token_ids for r in reqs], drafted


@pytest.mark.parametrize(("shape", "spec"), CASES)
def test_greedy_tp2_equals_tp1(checkpoints, shape, spec):
    shapes, draft_model = checkpoints
    target, head = shapes[shape]
    draft = {"mtp": str(head), "draft_model": str(draft_model), "self": str(target)}.get(spec)
    spec = "draft_model" if spec == "self" else spec
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    one, _ = outputs(target, spec, draft, params, 1)
    two, drafted = outputs(target, spec, draft, params, 2)
    assert two == one
    assert spec in ("none", "ngram") or drafted > 0  # the proposer really drafted (and verified) at TP = 2


@pytest.mark.parametrize("spec", ["mtp", "ngram", "self"])
def test_adaptive_policy_at_tp2(checkpoints, spec):
    """The adaptive policy drops the refill and catches up (an MTP catch-up is replayed on every rank, a draft
    model's is the leader's alone); the policy's step costs are the leader's, i.e. the group's."""
    target, head = checkpoints[0]["gqa"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    draft = {"mtp": str(head), "self": str(target)}.get(spec)
    spec = "draft_model" if spec == "self" else spec
    one = outputs(target, spec, draft, params, 1, spec_policy_override="adaptive")[0]
    assert outputs(target, spec, draft, params, 2, spec_policy_override="adaptive")[0] == one


def test_the_graph_standin_at_tp2_is_a_config_error(tiny_target):
    with pytest.raises(ConfigError, match="stand-in does not run with --tensor-parallel-size > 1"):
        make_core(tiny_target, tensor_parallel_size=2, graph_standin=True)


@pytest.mark.parametrize("overlap", [False, True])
def test_seeded_sampling_without_speculation_equals_tp1(checkpoints, overlap):
    target, _ = checkpoints[0]["gqa"]
    params = SamplingParams(temperature=1.0, top_k=20, max_tokens=24, ignore_eos=True)
    assert outputs(target, "none", None, params, 2, overlap=overlap)[0] == outputs(target, "none", None, params, 1)[0]


def test_generate_cli_at_tp2(checkpoints, tmp_path):
    target, head = checkpoints[0]["gqa"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in PROMPTS))
    results = []
    for tp in ("1", "2"):
        out = tmp_path / f"out{tp}.jsonl"
        proc = subprocess.run([sys.executable, "-m", "specstep.scheduler.cli", "generate", "--model", str(target),
                               "--spec", "mtp", "--draft", str(head), "--device", "cpu", "--kv-cache-tokens", "4096",
                               "--max-tokens", "16", "--temperature", "0", "--ignore-eos", "--prompts", str(prompts),
                               "--output", str(out), "--tensor-parallel-size", tp],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        results.append([json.loads(line)["token_ids"] for line in out.read_text().splitlines()])
    assert results[0] == results[1] and len(results[0]) == len(PROMPTS)


def test_a_follower_that_cannot_start_fails_start_up_at_once(tiny_target, monkeypatch):
    monkeypatch.setattr(tp_group, "module_command",
                        lambda *a: [sys.executable, "-c", "import sys; print('no device for me'); sys.exit(3)"])
    t0 = time.monotonic()
    with pytest.raises(ParallelError, match=r"rank\(s\) \[1\] .*exited \(rank 1, status 3"):
        make_core(tiny_target, tensor_parallel_size=2)
    assert time.monotonic() - t0 < 30


def test_heads_that_do_not_split_fail_start_up(tmp_path):
    target = make_checkpoint(tmp_path / "t", num_attention_heads=3, num_key_value_heads=1, hidden_size=48)
    with pytest.raises(ParallelError, match="3 attention heads do not split over tensor-parallel size 2"):
        make_core(target, tensor_parallel_size=2)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


async def test_a_killed_follower_fails_in_flight_requests_and_the_group_restarts(tiny_target):
    srv = ServerProcess(["--model", str(tiny_target), "--spec", "ngram", "--device", "cpu", "--kv-cache-tokens",
                         "4096", "--tensor-parallel-size", "2"])
    srv.start()
    c = Client(srv.address)
    try:
        stats = await c.stats()
        assert stats.engine.tensor_parallel_size == 2
        leader = stats.engine.pid
        followers = _children(leader)
        assert len(followers) == 1, followers
        before = await c.complete(GenerateRequest("before", prompt_token_ids=[2, 7, 1, 8] * 3, max_tokens=24,
                                                  temperature=0.0, ignore_eos=True), 60)
        # Served at TP = 2 == the engine alone at TP = 1.
        one = run_to_completion(make_core(tiny_target, spec="ngram"), [[2, 7, 1, 8] * 3],
                                SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        assert before.token_ids == one[0].output_token_ids
        streams = []
        for i in range(2):
            stream = c.generate(GenerateRequest(f"x{i}", prompt_token_ids=[3, 1, 4, 1, 5], max_tokens=400,
                                                temperature=0.0, ignore_eos=True))
            assert isinstance(await asyncio.wait_for(stream.__anext__(), 60), Delta)
            streams.append(stream)
        os.kill(followers[0], signal.SIGKILL)

        async def end(stream):
            async for msg in stream:
                if not isinstance(msg, Delta):
                    return msg
        ends = await asyncio.wait_for(asyncio.gather(*[end(s) for s in streams]), 60)
        assert all(isinstance(e, Error) and e.code == ErrorCode.ENGINE_DIED for e in ends), ends
        after = await c.complete(GenerateRequest("after", prompt_token_ids=[2, 7, 1, 8] * 3, max_tokens=24,
                                                 temperature=0.0, ignore_eos=True), 180)
        assert after.token_ids == before.token_ids
        stats = await c.wait_idle(30)
        assert stats.restarts == 1 and stats.engine.pid != leader and stats.engine.tensor_parallel_size == 2
        assert len(_children(stats.engine.pid)) == 1  # a new follower for the new leader
    finally:
        c.close()
        srv.stop()


def test_after_a_failure_the_leader_kills_its_followers(tiny_target):
    """A leader that failed mid-step must not send its stop message (a follower may be inside that step's
    collective, which the message would pair with): the followers are killed instead, at once."""
    core = make_core(tiny_target, tensor_parallel_size=2)
    procs = core.engine._group.procs
    t0 = time.monotonic()
    core.close(failed=True)
    assert [p.poll() for p in procs] == [-signal.SIGKILL] and time.monotonic() - t0 < 10  # killed, not stopped
    core.engine.tp.close()


WATCHDOG = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from tests.helpers import make_core
core = make_core({target!r}, tensor_parallel_size=2)
os.kill(core.engine._group.procs[0].pid, signal.SIGKILL)
time.sleep(60)  # idle: nothing would notice the dead follower but the watchdog
sys.exit(0)
"""


def test_a_dead_follower_ends_an_idle_leader(tiny_target):
    """NCCL does not report a dead peer inside one machine, so the leader watches its followers: one that exits
    ends the leader (status 70), which the supervisor then restarts."""
    root = str(Path(__file__).resolve().parents[1])
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", WATCHDOG.format(root=root, target=str(tiny_target))],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert proc.returncode == 70, proc.stderr[-2000:]
    assert "exiting so the group restarts" in proc.stderr and time.monotonic() - t0 < 60


@pytest.mark.parametrize("spec", ["mtp", "self"])
def test_chunked_prefill_and_preemption_at_tp2(checkpoints, spec):
    """Mixed steps (prompt chunks beside decoding rows) and preemption by recompute (an 80-token KV cache): the
    followers' mirrors follow re-prefilled requests, and the output equals TP = 1's."""
    target, head = checkpoints[0]["gqa"]
    draft = str(head) if spec == "mtp" else str(target)
    spec = "draft_model" if spec == "self" else spec
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs, preemptions = [], []
    for tp in (1, 2):
        core = make_core(target, spec=spec, draft=draft, num_spec_tokens=3, spec_policy="fixed", max_batch_size=4,
                         tensor_parallel_size=tp, page_size=4, kv_cache_tokens=80, max_num_batched_tokens=7)
        outs.append([r.output_token_ids for r in run_to_completion(core, PROMPTS, params)])
        preemptions.append(core.num_preemptions)
        core.close()
    assert outs[1] == outs[0] and preemptions[1] > 0
