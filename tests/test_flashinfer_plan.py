"""The FlashInfer backend's host logic on CPU, against tests/fake_flashinfer.py (the wrappers' documented
semantics in torch). Checks the index arithmetic, padding lanes, which wrapper a slot's forward uses, and the
errors; tests/test_flashinfer_engine.py runs whole engines on it, tests/test_gpu.py checks the real kernels."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specstep.engine.attention import flashinfer_backend as fib
from specstep.engine.attention.torch_backend import paged_attention
from specstep.engine.batch_builder import build_layout
from specstep.engine.config import ModelConfig
from specstep.engine.forward_batch import ForwardBatch
from specstep.engine.kv_cache import KVPool
from tests import fake_flashinfer
from tests.fake_flashinfer import _FakeDecode

PS, MAX_PAGES = 4, 6
CFG = ModelConfig(architecture="llama", vocab_size=32, hidden_size=64, intermediate_size=32, num_layers=1,
                  num_heads=8, num_kv_heads=2, head_dim=8)


@pytest.fixture
def fi(monkeypatch):
    fake_flashinfer.install(monkeypatch)
    return fib.FlashInferAttention(CFG, PS, torch.float32, torch.device("cpu"), MAX_PAGES)


def _meta(slot):
    return SimpleNamespace(slot=slot)


def _problem(q_lens, kv_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(CFG, 1, 40, PS, torch.float32, "cpu")
    pool.k[0].normal_(generator=g)
    pool.v[0].normal_(generator=g)
    perm = (torch.randperm(39, generator=g) + 1).tolist()
    tables = [perm[MAX_PAGES * i: MAX_PAGES * i + -(-kv // PS)] for i, kv in enumerate(kv_lens)]
    q = torch.randn(int(sum(q_lens)), CFG.q_size, generator=g)
    layout = build_layout(q_lens, tables, PS, "cpu", max_kv_len=MAX_PAGES * PS)
    meta = ForwardBatch.derive(layout, torch.tensor(np.subtract(kv_lens, q_lens)),
                               torch.zeros(len(q), dtype=torch.long)).attn
    ref = paged_attention(q, pool.k[0], pool.v[0], meta, CFG.num_heads, CFG.head_dim**-0.5)
    pt = np.zeros((len(tables), MAX_PAGES), np.int32)
    for i, t in enumerate(tables):
        pt[i, : len(t)] = t
    return pool, q, ref, pt, meta


@pytest.mark.parametrize("slot,q_lens,kv_lens", [
    ("decode", [1, 1, 1], [1, 9, 21]),
    ("verify", [3, 3, 3], [3, 8, 22]),
    ("verify", [1, 4, 2], [1, 8, 22]),  # ragged verify (requests drafting different counts)
    ("prefill", [5, 1, 7], [5, 4, 20]),
])
def test_plan_matches_torch_backend(fi, slot, q_lens, kv_lens):
    pool, q, ref, pt, meta = _problem(q_lens, kv_lens)
    fi.plan(slot, np.array(q_lens), np.array(kv_lens), pt)
    assert isinstance(fi._planned[slot], _FakeDecode) == (max(q_lens) == 1 and slot != "prefill")
    meta.slot = slot
    out = fi.forward(q, pool.k[0], pool.v[0], meta, CFG.num_heads, CFG.head_dim**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slot,q", [("decode", 1), ("verify", 3)])
def test_graph_lanes_pad_on_the_dummy_page(fi, slot, q):
    fi.plan_padding(slot, 4, q)  # what a graph would be captured with
    w = fi._wrappers[(slot, 4, q)]
    assert w.graph and w.plan_args["indices"].tolist() == [0] * 4 * -(-q // PS)
    pool, qs, ref, pt, meta = _problem([q] * 3, [q + 5, 11, 20])
    fi.plan(slot, np.full(3, q), np.array([q + 5, 11, 20]), pt, lanes=4)
    assert fi._planned[slot] is w  # the wrapper the graph captured, rewritten in place
    a, n = w.plan_args, -(-q // PS)
    assert a["indices"][-n:].tolist() == [0] * n and int(a["last"][3]) == q  # the padding lane
    assert a["uniform"] == (None if slot == "decode" else q)  # graph lanes: tiles sized for q query rows
    out = fi.forward(torch.cat([qs, torch.zeros(q, CFG.q_size)]), pool.k[0], pool.v[0], _meta(slot),
                     CFG.num_heads, CFG.head_dim**-0.5)
    torch.testing.assert_close(out[: 3 * q], ref, rtol=1e-5, atol=1e-5)


def test_eager_and_graph_plans_of_a_slot_use_different_wrappers(fi):
    _, _, _, pt, _ = _problem([1, 1], [6, 9])
    fi.plan("verify", np.array([2, 3]), np.array([6, 9]), pt)
    eager = fi._planned["verify"]
    assert eager.plan_args["uniform"] is None
    fi.plan("verify", np.array([3, 3]), np.array([6, 9]), pt, lanes=2)
    assert fi._planned["verify"] is not eager and fi._planned["verify"].graph and not eager.graph


def test_errors(fi):
    with pytest.raises(RuntimeError, match="never planned"):
        fi.forward(torch.zeros(1, CFG.q_size), torch.zeros(8, 2, 8), torch.zeros(8, 2, 8), _meta("verify"),
                   CFG.num_heads, CFG.head_dim**-0.5)
    with pytest.raises(ValueError, match="same number of tokens"):
        fi.plan("verify", np.array([2, 3]), np.array([6, 9]), np.ones((2, MAX_PAGES), np.int32), lanes=2)
    with pytest.raises(ValueError, match="pages"):
        fi.plan("decode", np.ones(1), np.array([MAX_PAGES * PS + 1]), np.ones((1, MAX_PAGES), np.int32))


def test_without_flashinfer_or_cuda_the_choice_is_a_typed_error(monkeypatch):
    from specstep.engine.attention import resolve_backend
    from specstep.engine.errors import ConfigError

    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    monkeypatch.setattr(fib, "AVAILABLE", False)
    with pytest.raises(ConfigError, match="not installed"):
        fib.FlashInferAttention(CFG, PS, torch.float32, torch.device("cpu"), MAX_PAGES)
    monkeypatch.setattr(fib, "AVAILABLE", True)
    with pytest.raises(ConfigError, match="CUDA"):
        fib.FlashInferAttention(CFG, PS, torch.float32, torch.device("cpu"), MAX_PAGES)
    monkeypatch.setattr(fib, "check_usable", lambda device: None)
    with pytest.raises(ConfigError, match="bfloat16"):  # FlashInfer has no float32 kernels
        fib.FlashInferAttention(CFG, PS, torch.float32, torch.device("cpu"), MAX_PAGES)
    with pytest.raises(ConfigError, match="--attention"):
        resolve_backend("flash", torch.device("cpu"))
