"""GraphRunner on the CPU stand-in: replay == eager for every step kind and bucket, padding lanes stay on the
dummy page, speculative greedy decoding over graph steps, buckets (the contract checks: test_graph_contract.py)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from specstep.cuda_graphs import GraphConfig, GraphContractError, GraphKey, GraphRunner, StepKind
from specstep.cuda_graphs.buckets import bucket_for, default_buckets, plan_buckets
from specstep.engine.batch_builder import build_forward_batch, build_layout
from specstep.engine.forward_batch import ForwardBatch, uniform_layout
from specstep.engine.kv_cache import DUMMY_PAGE, KVPool
from specstep.engine.model_loader import load_model
from specstep.engine.models.mtp_head import MTPHead
from tests.graph_reference_steps import (
    draft_model_step,
    mtp_draft_step,
    mtp_inputs,
    mtp_refill_step,
    target_inputs,
    target_step,
)
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


def build_setup(checkpoint, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Setup:
    """Target (from a checkpoint), a random MTP head, their pools filled with random 'existing context'."""
    torch.manual_seed(0)
    target = load_model(checkpoint, device, str(dtype).replace("torch.", ""))
    cfg = dataclasses.replace(target.cfg, architecture="mtp", num_layers=1)
    head = MTPHead(cfg).to(device=device, dtype=dtype).eval()
    head.rotary.build_tables(device)
    pool = KVPool(target.cfg, target.cfg.num_layers, NUM_PAGES, PAGE, dtype, device)
    head_pool = KVPool(cfg, 1, NUM_PAGES, PAGE, dtype, device)
    for t in pool.k + pool.v + head_pool.k + head_pool.v:
        t.normal_()
    return Setup(target, head, pool, head_pool)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    return build_setup(make_checkpoint(tmp_path_factory.mktemp("graph_target"), seed=3))


def make_runner(s: Setup, device: str = "cpu", **cfg) -> GraphRunner:
    cfg.setdefault("buckets", BUCKETS)
    cfg.setdefault("max_batch", max(BUCKETS))
    cfg.setdefault("deep_check_replays", None)
    runner = GraphRunner(device, GraphConfig(**cfg))
    d, dtype = s.target.cfg.hidden_size, s.pool.k[0].dtype
    runner.register(StepKind("decode", target_step(s.target, s.pool), target_inputs(MAX_PAGES), (1,)))
    runner.register(StepKind("verify", target_step(s.target, s.pool), target_inputs(MAX_PAGES), (K + 1,)))
    runner.register(StepKind("draft", mtp_draft_step(s.head, s.target, s.head_pool, K),
                             mtp_inputs(MAX_PAGES, d, dtype), (1,)))
    runner.register(StepKind("refill", mtp_refill_step(s.head, s.target, s.head_pool),
                             mtp_inputs(MAX_PAGES, d, dtype), (K + 1,)))
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
        inp["hidden"] = torch.randn(batch * q, s.target.cfg.hidden_size, generator=g).to(s.pool.k[0].dtype)
    return {n: t.to(s.pool.k[0].device) for n, t in inp.items()}


KINDS = [("decode", 1), ("verify", K + 1), ("draft", 1), ("refill", K + 1)]


@pytest.fixture(scope="module")
def runner(setup) -> GraphRunner:
    r = make_runner(setup)
    info = r.capture()
    assert info.buckets == BUCKETS and info.graphs == len(BUCKETS) * len(KINDS) and info.backend == "cpu-standin"
    return r


def check_replay_matches_eager(s: Setup, runner: GraphRunner, kind: str, q: int, batch: int, tol: float) -> None:
    step = runner._kinds[kind].fn
    inp = live_inputs(s, kind, q, batch, seed=batch)
    with torch.inference_mode():
        expected = {n: t.clone() for n, t in step(dict(inp), GraphKey(kind, batch, q)).items()}
    assert runner.has_graph(kind, q, batch)
    got = runner.run(kind, q, inp, batch)
    assert got.keys() == expected.keys()
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=tol, atol=tol)
    # outputs are the graph's static outputs (sliced), not fresh tensors
    graph = runner._graphs[GraphKey(kind, runner.bucket_for(batch), q)]
    assert all(got[n].data_ptr() == graph.outputs[n].data_ptr() for n in got)


@pytest.mark.parametrize("kind,q", KINDS)
@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_replay_matches_eager(setup, runner, kind, q, batch):
    check_replay_matches_eager(setup, runner, kind, q, batch, tol=1e-5)


def _written_slots(inp: dict[str, torch.Tensor], q: int) -> torch.Tensor:
    pos = inp["start"].unsqueeze(1) + torch.arange(q, device=inp["start"].device)
    return (inp["page_table"].gather(1, pos // PAGE) * PAGE + pos % PAGE).flatten()


def check_padding(s: Setup, runner: GraphRunner, kind: str, q: int, tol: float) -> None:
    """Batch of 3 in bucket 4: real lanes match eager, the padding lane writes only the dummy page."""
    inp = live_inputs(s, kind, q, 3, seed=7)
    pool = s.pool
    before = [t.clone() for t in pool.k + pool.v]
    with torch.inference_mode():
        expected = runner._kinds[kind].fn(dict(inp), GraphKey(kind, 3, q))["logits"].clone()
    after_eager = [t.clone() for t in pool.k + pool.v]
    for t, b in zip(pool.k + pool.v, before):
        b[:PAGE] = 7.0  # a sentinel in the dummy page: the padding lane must overwrite it (masked for real lanes)
        t.copy_(b)
    got = runner.run(kind, q, inp, 3)
    assert runner.bucket_for(3) == 4
    torch.testing.assert_close(got["logits"], expected, rtol=tol, atol=tol)
    written = _written_slots(inp, q)
    keep = torch.ones(NUM_PAGES * PAGE, dtype=torch.bool, device=written.device)
    keep[written] = False
    keep[DUMMY_PAGE * PAGE:(DUMMY_PAGE + 1) * PAGE] = False
    dummy_changed = False
    for t, b, e in zip(pool.k + pool.v, before, after_eager):
        assert torch.equal(t[keep], b[keep]), "the padding lane wrote outside the dummy page"
        torch.testing.assert_close(t[written], e[written])  # real lanes wrote what eager wrote
        dummy_changed |= not torch.equal(t[:PAGE], b[:PAGE])
    assert dummy_changed, "the padding lane should have written its KV into the dummy page"


@pytest.mark.parametrize("kind,q", [("decode", 1), ("verify", K + 1)])
def test_padding_lane_touches_only_the_dummy_page(setup, runner, kind, q):
    check_padding(setup, runner, kind, q, tol=1e-5)


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


# ---- speculative greedy decoding over graph steps ---------------------------------------------------------

def spec_runner(target, pool, draft, draft_pool, k: int, device: str = "cpu", **cfg) -> GraphRunner:
    """decode (q = 1), verify (q = k + 1) and a draft-model loop of k + 1 steps (the last one only writes the
    draft's KV for d_k, needed when every draft is accepted)."""
    cfg.setdefault("buckets", BUCKETS)
    cfg.setdefault("max_batch", max(BUCKETS))
    r = GraphRunner(device, GraphConfig(**cfg))
    r.register(StepKind("decode", target_step(target, pool), target_inputs(MAX_PAGES), (1,)))
    r.register(StepKind("verify", target_step(target, pool), target_inputs(MAX_PAGES), (k + 1,)))
    r.register(StepKind("draft", draft_model_step(draft, draft_pool, k + 1), target_inputs(MAX_PAGES), (1,)))
    r.capture()
    return r


@torch.inference_mode()
def greedy_generate(runner: GraphRunner, target, pool, draft, draft_pool, prompts: list[list[int]], n_new: int,
                    k: int) -> list[list[int]]:
    """Greedy decoding through `runner`; k > 0 speculates (draft loop, verify, accept while d_j == argmax).

    Request b owns pages 1 + 6b .. 6 + 6b; the KV holds every token but the last, which each step feeds.
    """
    dev = pool.k[0].device
    b = len(prompts)
    tables = [list(range(1 + MAX_PAGES * i, 1 + MAX_PAGES * (i + 1))) for i in range(b)]
    pt = torch.tensor(tables, device=dev)
    fb = build_forward_batch([p[:-1] for p in prompts], [0] * b, tables, PAGE, dev)
    target(fb, pool)
    draft(fb, draft_pool)
    seqs = [list(p) for p in prompts]
    while min(len(s) - len(p) for s, p in zip(seqs, prompts)) < n_new:
        inp = {"start": torch.tensor([len(s) - 1 for s in seqs], device=dev),
               "input_ids": torch.tensor([s[-1] for s in seqs], device=dev), "page_table": pt}
        if k == 0:
            for s, t in zip(seqs, runner.run("decode", 1, inp, b)["logits"].argmax(-1).tolist()):
                s.append(t)
            continue
        # A static output: the next replay may overwrite it (on CUDA, any graph of the shared pool), and the
        # acceptance below reads it after the verify replay.
        drafts = runner.run("draft", 1, inp, b)["drafts"][:, :k].clone()
        ids = torch.cat([inp["input_ids"][:, None], drafts], dim=1).reshape(-1)
        logits = runner.run("verify", k + 1, {**inp, "input_ids": ids}, b)["logits"]
        best = logits.argmax(-1).view(b, k + 1)
        accepted = (drafts == best[:, :k]).long().cumprod(dim=1).sum(dim=1)
        for s, d, g, a in zip(seqs, drafts.tolist(), best.tolist(), accepted.tolist()):
            s.extend(d[:a] + [g[a]])
    return [s[len(p): len(p) + n_new] for s, p in zip(seqs, prompts)]


PROMPTS = [[5, 17, 42, 7], [9, 3], [100, 200, 50, 25, 60, 1]]  # three requests: bucket 4 has a padding lane


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("graph_draft"), seed=1, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model = load_model(path, "cpu", "float32")
    return model, KVPool(model.cfg, 1, NUM_PAGES, PAGE, torch.float32, "cpu")


@pytest.mark.parametrize("which", ["small", "self"])
def test_speculative_greedy_equals_plain_with_graphs(setup, small_draft, which):
    """Lossless: speculative output == plain greedy output, through graph replays (and == eager plain).
    'self' drafts with the target itself, so every draft is accepted (the bonus-token path)."""
    target, pool = setup.target, setup.pool
    if which == "small":
        draft, draft_pool = small_draft
    else:
        draft, draft_pool = target, KVPool(target.cfg, target.cfg.num_layers, NUM_PAGES, PAGE, torch.float32, "cpu")
    k, n_new = 2, 10
    eager = spec_runner(target, pool, draft, draft_pool, k, enabled=False)
    graphs = spec_runner(target, pool, draft, draft_pool, k)
    plain = greedy_generate(eager, target, pool, draft, draft_pool, PROMPTS, n_new, 0)
    assert greedy_generate(graphs, target, pool, draft, draft_pool, PROMPTS, n_new, 0) == plain
    assert greedy_generate(graphs, target, pool, draft, draft_pool, PROMPTS, n_new, k) == plain
    assert greedy_generate(graphs, target, pool, draft, draft_pool, PROMPTS[:1], n_new, k) == plain[:1]


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
