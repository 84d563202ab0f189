"""GraphRunner on the CPU stand-in: replay == eager for every step kind and bucket, padding lanes stay on the
dummy page, and step functions that would break under a real CUDA graph are caught."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from cuda_graphs import BufferSpec, GraphConfig, GraphContractError, GraphKey, GraphRunner, StepKind
from cuda_graphs.buckets import bucket_for, default_buckets, plan_buckets
from cuda_graphs.steps import mtp_draft_step, mtp_inputs, mtp_refill_step, target_inputs, target_step, uniform_layout
from engine.batch_builder import build_layout
from engine.forward_batch import ForwardBatch
from engine.kv_cache import DUMMY_PAGE, KVPool
from engine.model_loader import load_model
from engine.models.mtp_head import MTPHead
from tests.helpers import make_checkpoint

PAGE, MAX_PAGES, NUM_PAGES = 4, 6, 40
K = 2  # drafts per step: verify / refill run q = K + 1
BUCKETS = (1, 2, 4)


@dataclasses.dataclass
class Setup:
    target: torch.nn.Module
    head: MTPHead
    pool: KVPool
    head_pool: KVPool


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    torch.manual_seed(0)
    target = load_model(make_checkpoint(tmp_path_factory.mktemp("graph_target"), seed=3), "cpu", "float32")
    cfg = dataclasses.replace(target.cfg, architecture="mtp", num_layers=1)
    head = MTPHead(cfg).eval()
    pool = KVPool(target.cfg, target.cfg.num_layers, NUM_PAGES, PAGE, torch.float32, "cpu")
    head_pool = KVPool(cfg, 1, NUM_PAGES, PAGE, torch.float32, "cpu")
    for t in pool.k + pool.v + head_pool.k + head_pool.v:  # existing context: random keys/values
        t.normal_()
    return Setup(target, head, pool, head_pool)


def make_runner(s: Setup, **cfg) -> GraphRunner:
    cfg.setdefault("buckets", BUCKETS)
    cfg.setdefault("max_batch", max(BUCKETS))
    cfg.setdefault("deep_check_replays", None)
    runner = GraphRunner("cpu", GraphConfig(**cfg))
    d = s.target.cfg.hidden_size
    runner.register(StepKind("decode", target_step(s.target, s.pool), target_inputs(MAX_PAGES), (1,)))
    runner.register(StepKind("verify", target_step(s.target, s.pool), target_inputs(MAX_PAGES), (K + 1,)))
    runner.register(StepKind("draft", mtp_draft_step(s.head, s.target, s.head_pool, K),
                             mtp_inputs(MAX_PAGES, d, torch.float32), (1,)))
    runner.register(StepKind("refill", mtp_refill_step(s.head, s.target, s.head_pool),
                             mtp_inputs(MAX_PAGES, d, torch.float32), (K + 1,)))
    return runner


def live_inputs(s: Setup, kind: str, q: int, batch: int, seed: int) -> dict[str, torch.Tensor]:
    """`batch` requests with disjoint pages (1 + 5b ...), contexts of 3..12 tokens."""
    g = torch.Generator().manual_seed(seed)
    pt = torch.full((batch, MAX_PAGES), DUMMY_PAGE, dtype=torch.long)
    for b in range(batch):
        pt[b, :5] = torch.arange(1 + 5 * b, 6 + 5 * b)
    inp = {"start": torch.randint(3, 13, (batch,), generator=g), "page_table": pt,
           "input_ids": torch.randint(0, s.target.cfg.vocab_size, (batch * q,), generator=g)}
    if kind in ("draft", "refill"):
        inp["hidden"] = torch.randn(batch * q, s.target.cfg.hidden_size, generator=g)
    return inp


KINDS = [("decode", 1), ("verify", K + 1), ("draft", 1), ("refill", K + 1)]


@pytest.fixture(scope="module")
def runner(setup) -> GraphRunner:
    r = make_runner(setup)
    info = r.capture()
    assert info.buckets == BUCKETS and info.graphs == len(BUCKETS) * len(KINDS) and info.backend == "cpu-standin"
    return r


@pytest.mark.parametrize("kind,q", KINDS)
@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_replay_matches_eager(setup, runner, kind, q, batch):
    step = runner._kinds[kind].fn
    inp = live_inputs(setup, kind, q, batch, seed=batch)
    expected = {n: t.clone() for n, t in step(dict(inp), GraphKey(kind, batch, q)).items()}
    assert runner.has_graph(kind, q, batch)
    got = runner.run(kind, q, inp, batch)
    assert got.keys() == expected.keys()
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-5, atol=1e-5)
    # outputs are the graph's static outputs (sliced), not fresh tensors
    graph = runner._graphs[GraphKey(kind, runner.bucket_for(batch), q)]
    assert all(got[n].data_ptr() == graph.outputs[n].data_ptr() for n in got)


def _written_slots(inp: dict[str, torch.Tensor], q: int) -> torch.Tensor:
    pos = inp["start"].unsqueeze(1) + torch.arange(q)
    return (inp["page_table"].gather(1, pos // PAGE) * PAGE + pos % PAGE).flatten()


@pytest.mark.parametrize("kind,q", [("decode", 1), ("verify", K + 1)])
def test_padding_lane_touches_only_the_dummy_page(setup, runner, kind, q):
    inp = live_inputs(setup, kind, q, 3, seed=7)
    pool = setup.pool
    before = [t.clone() for t in pool.k + pool.v]
    expected = runner._kinds[kind].fn(dict(inp), GraphKey(kind, 3, q))["logits"].clone()
    after_eager = [t.clone() for t in pool.k + pool.v]
    for t, b in zip(pool.k + pool.v, before):
        b[:PAGE] = 7.0  # a sentinel in the dummy page: the padding lane must overwrite it (masked for real lanes)
        t.copy_(b)
    got = runner.run(kind, q, inp, 3)  # bucket 4: one padding lane
    assert runner.bucket_for(3) == 4
    torch.testing.assert_close(got["logits"], expected, rtol=1e-5, atol=1e-5)
    written = _written_slots(inp, q)
    keep = torch.ones(NUM_PAGES * PAGE, dtype=torch.bool)
    keep[written] = False
    keep[DUMMY_PAGE * PAGE:(DUMMY_PAGE + 1) * PAGE] = False
    dummy_changed = False
    for t, b, e in zip(pool.k + pool.v, before, after_eager):
        assert torch.equal(t[keep], b[keep]), "the padding lane wrote outside the dummy page"
        torch.testing.assert_close(t[written], e[written])  # real lanes wrote what eager wrote
        dummy_changed |= not torch.equal(t[:PAGE], b[:PAGE])
    assert dummy_changed, "the padding lane should have written its KV into the dummy page"


def test_larger_batches_and_disabled_graphs_run_eagerly(setup, runner):
    inp = live_inputs(setup, "decode", 1, 5, seed=11)
    assert runner.bucket_for(5) is None and not runner.has_graph("decode", 1, 5)
    out = runner.run("decode", 1, inp, 5)
    ref = runner._kinds["decode"].fn(dict(inp), GraphKey("decode", 5, 1))
    torch.testing.assert_close(out["logits"], ref["logits"])
    off = make_runner(setup, enabled=False)
    assert off.capture().graphs == 0 and not off.has_graph("decode", 1, 1)
    torch.testing.assert_close(off.run("decode", 1, live_inputs(setup, "decode", 1, 2, 3), 2)["logits"],
                               runner.run("decode", 1, live_inputs(setup, "decode", 1, 2, 3), 2)["logits"],
                               rtol=1e-5, atol=1e-5)


def test_live_input_with_wrong_shape_is_rejected(setup, runner):
    inp = live_inputs(setup, "verify", K + 1, 2, seed=1)
    inp["input_ids"] = inp["input_ids"][:-1]
    with pytest.raises(GraphContractError, match="input 'input_ids'"):
        runner.run("verify", K + 1, inp, 2)


def test_uniform_layout_matches_host_layout():
    pt = torch.tensor([[3, 4, 0], [5, 6, 7]])
    dev = uniform_layout(pt, 3, PAGE)
    host = build_layout([3, 3], [[3, 4], [5, 6, 7]], PAGE, "cpu", max_kv_len=3 * PAGE)
    for f in ("q_lens", "token_req", "token_offset", "q_index", "out_index", "page_table"):
        assert torch.equal(getattr(dev, f), getattr(host, f)), f
    start, ids = torch.tensor([2, 5]), torch.arange(6)
    a, b = ForwardBatch.derive(dev, start, ids), ForwardBatch.derive(host, start, ids)
    assert torch.equal(a.slot_mapping, b.slot_mapping) and torch.equal(a.attn.mask, b.attn.mask)


# ---- contract-breaking step functions ------------------------------------------------------------------------

SPECS = lambda q: {"x": BufferSpec(rows=q, trailing=(4,), dtype=torch.float32)}  # noqa: E731


def capture_one(fn, replays: int = 2) -> GraphRunner:
    r = GraphRunner("cpu", GraphConfig(buckets=(2,), max_batch=2, deep_check_replays=None, warmup_runs=0))
    r.register(StepKind("s", fn, SPECS, (1,)))
    r.capture()
    for i in range(replays):
        r.run("s", 1, {"x": torch.full((2, 4), float(i))}, 2)
    return r


def test_well_behaved_step_passes_and_reads_static_outputs():
    state = torch.zeros(2, 4)

    def fn(inp, key):
        state.add_(inp["x"])  # state written in place: fine under a graph
        return {"y": inp["x"] * 2 + 1, "state": state}

    r = capture_one(fn)
    out = r.run("s", 1, {"x": torch.ones(2, 4)}, 2)
    assert torch.equal(out["y"], torch.full((2, 4), 3.0)) and out["state"].data_ptr() == state.data_ptr()


BREAKERS = {
    "rebinds an input": (lambda inp, key: inp.__setitem__("x", inp["x"] + 1) or {"y": inp["x"]},
                         "rebound input 'x'"),
    "reallocates an input": (lambda inp, key: {"y": inp["x"].set_(inp["x"].clone()) * 1},
                             "static input 'x' changed by the step"),
    "resizes an input": (lambda inp, key: {"y": inp["x"].resize_(1, 4) * 1}, "static input 'x' changed"),
    "syncs with the host": (lambda inp, key: {"y": inp["x"] * inp["x"].sum().item()}, "synchronises"),
    "masks with a bool tensor": (lambda inp, key: {"y": inp["x"][inp["x"] > 0]}, "synchronises"),
    "bakes host data in": (lambda inp, key: {"y": inp["x"] + torch.tensor([1.0, 2.0, 3.0, 4.0])},
                           "built from host data"),
}


@pytest.mark.parametrize("name", list(BREAKERS))
def test_contract_breakers_fail_at_capture(name):
    fn, message = BREAKERS[name]
    with pytest.raises(GraphContractError, match=message):
        capture_one(fn)


def test_escaping_allocation_is_caught():
    class Proposer:
        last = None

        def step(self, inp, key):
            y = inp["x"] * 2
            self.last = y + 1  # state rebound to a fresh tensor: stale under replay
            return {"y": y}

    with pytest.raises(GraphContractError, match="alive after it returned"):
        capture_one(Proposer().step)


def test_host_state_steering_the_work_is_caught():
    calls = []

    def shape_changes(inp, key):
        calls.append(1)
        return {"y": inp["x"][: 1 + len(calls) % 2]}  # a view: the output shape follows host state

    with pytest.raises(GraphContractError, match="output 'y' is"):
        capture_one(shape_changes)

    bufs = [torch.zeros(2, 4), torch.zeros(2, 4)]

    def picks_buffer(inp, key):
        calls.append(1)
        out = bufs[len(calls) % 2]
        out.copy_(inp["x"])
        return {"y": out}

    with pytest.raises(GraphContractError, match="storage differs"):
        capture_one(picks_buffer)

    def scalar_changes(inp, key):
        calls.append(1)
        return {"y": inp["x"] * float(len(calls))}

    with pytest.raises(GraphContractError, match="device work changed"):
        capture_one(scalar_changes)


def test_static_buffers_rebound_outside_the_step_are_caught():
    r = capture_one(lambda inp, key: {"y": inp["x"] + 1}, replays=0)
    graph = r._graphs[GraphKey("s", 2, 1)]
    graph.inputs["x"].set_(torch.zeros(2, 4))  # someone re-pointed the static buffer
    with pytest.raises(GraphContractError, match="before the step ran"):
        r.run("s", 1, {"x": torch.ones(2, 4)}, 2)


# ---- buckets -------------------------------------------------------------------------------------------------

def test_buckets():
    assert default_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert default_buckets(6) == (1, 2, 4, 6)
    assert bucket_for((1, 2, 4), 3) == 4 and bucket_for((1, 2, 4), 5) is None
    # 2 graphs per bucket, 10 B/lane each + 100 B per graph: buckets (1, 2, 4) cost 220 + 240 + 280
    assert plan_buckets([1, 2, 4], [10, 10], None, 100) == (1, 2, 4)
    assert plan_buckets([4, 2, 1], [10, 10], 740, 100) == (1, 2, 4)
    assert plan_buckets([1, 2, 4], [10, 10], 739, 100) == (1, 2)
    assert plan_buckets([1, 2, 4], [10, 10], 100, 100) == ()


def test_memory_budget_drops_largest_buckets(setup, caplog):
    vocab, d = setup.target.cfg.vocab_size, setup.target.cfg.hidden_size
    # static output bytes per lane: decode 1 and verify / refill 3 tokens of (logits V + hidden d) in fp32,
    # draft K int64 tokens + hidden d
    per_lane = 4 * 7 * (vocab + d) + 8 * K + 4 * d
    r = make_runner(setup, memory_budget=3 * per_lane + 8 * 10, overhead_per_graph=10)  # fits buckets 1, 2
    with caplog.at_level(logging.INFO, logger="specstep.graphs"):
        info = r.capture()
    assert info.buckets == (1, 2) and info.graphs == 8
    assert any("keeps buckets" in m for m in caplog.messages)
    assert any("captured" in m and "MiB" in m for m in caplog.messages)
    assert r.bucket_for(3) is None
