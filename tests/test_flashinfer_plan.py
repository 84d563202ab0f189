"""The FlashInfer backend's host logic on CPU, against a stand-in `flashinfer` module that implements the
wrappers' documented semantics in torch (ragged paged KV from indptr / indices / last_page_len; causal
attention aligned to the end of each request's keys). Checks the index arithmetic, padding lanes, the
upper-bound-then-exact plan and wrapper selection; tests/test_gpu.py checks the real kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.attention import flashinfer_backend as fib
from engine.attention.torch_backend import paged_attention
from engine.batch_builder import build_layout
from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVPool

PS, MAX_PAGES = 4, 6
CFG = ModelConfig(architecture="llama", vocab_size=32, hidden_size=64, intermediate_size=32, num_layers=1,
                  num_heads=8, num_kv_heads=2, head_dim=8)


class _FakeWrapper:
    decode = False

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, **buffers):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.graph = use_cuda_graph
        self.buffers = buffers
        self._pin_memory_int_workspace_buffer = None
        if use_cuda_graph:  # the real wrappers insist on these buffers in graph mode
            names = ({"paged_kv_indptr_buffer", "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer"}
                     if self.decode else
                     {"qo_indptr_buf", "paged_kv_indptr_buf", "paged_kv_indices_buf", "paged_kv_last_page_len_buf"})
            assert names <= buffers.keys(), buffers.keys()
            self.lanes = len(buffers["paged_kv_indptr_buffer" if self.decode else "paged_kv_indptr_buf"]) - 1

    def _plan(self, qo_indptr, indptr, indices, last, hq, hkv, d, ps, sm_scale=None, q_data_type=None,
              kv_data_type=None, non_blocking=True):
        assert self._pin_memory_int_workspace_buffer is not None, "staging buffer not swapped in"
        assert indptr.dtype == indices.dtype == last.dtype == torch.int32
        if self.graph:
            assert len(indptr) == self.lanes + 1, "graph-mode wrappers have a fixed batch size"
        self.plan_args = dict(qo=qo_indptr.clone(), indptr=indptr.clone(), indices=indices.clone(),
                              last=last.clone(), hq=hq, hkv=hkv, ps=ps, scale=sm_scale)

    def run(self, q, paged_kv_cache):
        a = self.plan_args
        k_cache, v_cache = paged_kv_cache  # [pages, ps, hkv, d]
        out = torch.empty_like(q)
        group = a["hq"] // a["hkv"]
        for b in range(len(a["indptr"]) - 1):
            pages = a["indices"][a["indptr"][b]: a["indptr"][b + 1]].long()
            kv_len = (len(pages) - 1) * a["ps"] + int(a["last"][b])
            k = k_cache[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, dim=1)  # [kv, hq, d]
            v = v_cache[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, dim=1)
            q0, q1 = int(a["qo"][b]), int(a["qo"][b + 1])
            s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k.float()) * a["scale"]
            i = torch.arange(q1 - q0).unsqueeze(1)
            s = s.masked_fill(torch.arange(kv_len) > kv_len - (q1 - q0) + i, float("-inf"))
            out[q0:q1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v.float()).to(q.dtype)
        return out


class _FakeDecode(_FakeWrapper):
    decode = True

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 **buffers):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, **buffers)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", **kw):
        b = len(indptr) - 1
        self._plan(torch.arange(b + 1, dtype=torch.int32), indptr, indices, last_page_len, num_qo_heads,
                   num_kv_heads, head_dim, page_size, **kw)


class _FakePrefill(_FakeWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, causal=False, **kw):
        assert causal
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                   num_kv_heads, head_dim_qk, page_size, **kw)


class _FakeFlashInfer:
    BatchDecodeWithPagedKVCacheWrapper = _FakeDecode
    BatchPrefillWithPagedKVCacheWrapper = _FakePrefill


@pytest.fixture
def fi(monkeypatch):
    monkeypatch.setattr(fib, "flashinfer", _FakeFlashInfer)
    monkeypatch.setattr(fib, "AVAILABLE", True)
    monkeypatch.setattr(fib, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(fib, "INT_WORKSPACE_BYTES", 1024)
    return fib.FlashInferAttention(CFG, PS, torch.float32, torch.device("cpu"), MAX_PAGES, graph_lanes=(4,))


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
    ("prefill", [5, 1, 7], [5, 4, 20]),
])
def test_plan_matches_torch_backend(fi, slot, q_lens, kv_lens):
    pool, q, ref, pt, meta = _problem(q_lens, kv_lens)
    prep = fi.prepare(slot, np.array(q_lens), pt)
    fi.plan(prep, np.array(kv_lens) + 2)  # upper bounds while the previous step runs ...
    fi.plan(prep, np.array(kv_lens))  # ... exact lengths at PATCH
    fi.select(slot, len(q_lens), max(q_lens))
    assert isinstance(fi._active.w, _FakeDecode) == (slot == "decode")
    out = fi.forward(q, pool.k[0], pool.v[0], meta, CFG.num_heads, CFG.head_dim**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slot,q", [("decode", 1), ("verify", 3)])
def test_graph_lanes_pad_on_the_dummy_page(fi, slot, q):
    fi.plan_padding(slot, 4, q)  # what a graph would be captured with
    w = fi._wrappers[(slot, 4, q)]
    assert w.w.graph and w.w.plan_args["indices"].tolist() == [0] * 4 * -(-q // PS)
    pool, qs, ref, pt, meta = _problem([q] * 3, [q + 5, 11, 20])
    prep = fi.prepare(slot, np.full(3, q), pt, lanes=4)
    fi.plan(prep, np.array([q + 5, 11, 20]))
    a, n = w.w.plan_args, -(-q // PS)
    assert a["indices"][-n:].tolist() == [0] * n and int(a["last"][3]) == q  # the padding lane
    fi.select(slot, 4, q)
    out = fi.forward(torch.cat([qs, torch.zeros(q, CFG.q_size)]), pool.k[0], pool.v[0], None, CFG.num_heads,
                     CFG.head_dim**-0.5)
    torch.testing.assert_close(out[: 3 * q], ref, rtol=1e-5, atol=1e-5)


def test_exact_plan_is_skipped_when_the_upper_bound_was_exact(fi):
    pool, q, ref, pt, meta = _problem([1, 1], [6, 9])
    prep = fi.prepare("decode", np.ones(2), pt)
    fi.plan(prep, np.array([6, 9]))
    staged = fi._wrappers[("decode", None, True)].w.plan_args
    fi.plan(prep, np.array([6, 9]))
    assert fi._wrappers[("decode", None, True)].w.plan_args is staged


def test_errors(fi):
    with pytest.raises(RuntimeError, match="never planned"):
        fi.select("verify", 2, 3)
    prep = fi.prepare("decode", np.ones(1), np.ones((1, MAX_PAGES), np.int32))
    with pytest.raises(ValueError, match="pages"):
        fi.plan(prep, np.array([MAX_PAGES * PS + 1]))
