"""A stand-in `flashinfer` module for CPU tests: the wrappers' documented semantics in plain torch (ragged
paged KV from indptr / indices / last_page_len; causal attention aligned to the end of each request's keys;
graph-mode wrappers with fixed batch sizes and required buffers). It checks our host logic (index arithmetic,
padding lanes, which plan a forward uses, when plans happen), not FlashInfer's kernels: tests/test_gpu.py runs
the real ones.

Workspaces as in FlashInfer: each wrapper's constructor allocates its own int workspace and pinned mirror
(`INT_WORKSPACE_BYTES` each; FlashInfer's are 8 MiB) and, for prefill, a kv-length buffer; plan() writes the
schedule into the pinned mirror and copies it into the int workspace, where run() reads it. Here the schedule
stored there is a stamp (wrapper, plan number): run() fails if another wrapper's plan overwrote this one's int
workspace (or kv lengths) between its plan and its run, which is what sharing them between wrappers planned
together does.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from specstep.engine.attention import flashinfer_backend as fib

INT_WORKSPACE_BYTES = 1024  # what a fake wrapper's constructor allocates (FlashInfer's: 8 << 20)


class _FakeWrapper:
    """A wrapper: plan() keeps the host schedule, run() attends by it (an opaque kernel, unseen by probes)."""

    decode = False

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, **buffers):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.graph = use_cuda_graph
        self.buffers = buffers
        self._float_workspace_buffer = float_workspace_buffer
        self._int_workspace_buffer = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8,
                                                 device=float_workspace_buffer.device)
        self._pin_memory_int_workspace_buffer = self._own_pinned = torch.empty(INT_WORKSPACE_BYTES,
                                                                               dtype=torch.uint8)
        self._kv_lens_buffer = None if self.decode else torch.zeros(64, dtype=torch.int32)
        self.plans = 0
        if use_cuda_graph:  # the real wrappers insist on these buffers in graph mode
            names = ({"paged_kv_indptr_buffer", "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer"}
                     if self.decode else
                     {"qo_indptr_buf", "paged_kv_indptr_buf", "paged_kv_indices_buf", "paged_kv_last_page_len_buf"})
            assert names <= buffers.keys(), buffers.keys()
            self.lanes = len(buffers["paged_kv_indptr_buffer" if self.decode else "paged_kv_indptr_buf"]) - 1

    def _plan(self, qo_indptr, indptr, indices, last, hq, hkv, d, ps, sm_scale=None, q_data_type=None,
              kv_data_type=None, non_blocking=True, uniform_q_len=None):
        if uniform_q_len is not None:  # the real wrapper warns and falls back; our graph plans are uniform
            assert (qo_indptr.diff() == uniform_q_len).all(), "uniform_q_len given for a ragged batch"
        assert self._pin_memory_int_workspace_buffer is not self._own_pinned, "staging buffer not swapped in"
        assert indptr.dtype == indices.dtype == last.dtype == torch.int32
        if self.graph:
            assert len(indptr) == self.lanes + 1, "graph-mode wrappers have a fixed batch size"
        self.plans += 1
        # The schedule: written on the host into the pinned mirror, then copied into the int workspace.
        stamp = self._pin_memory_int_workspace_buffer[:16].view(torch.int64)
        stamp[0], stamp[1] = id(self), self.plans
        self._int_workspace_buffer[:16].copy_(self._pin_memory_int_workspace_buffer[:16])
        self.kv_lens = (indptr.diff() - 1) * ps + last
        if self._kv_lens_buffer is not None:
            if len(last) > len(self._kv_lens_buffer):  # as FlashInfer: this wrapper gets a larger one
                self._kv_lens_buffer = torch.zeros(len(last), dtype=torch.int32)
            self._kv_lens_buffer[: len(last)] = self.kv_lens
        self.plan_args = dict(qo=qo_indptr.clone(), indptr=indptr.clone(), indices=indices.clone(),
                              last=last.clone(), hq=hq, hkv=hkv, ps=ps, scale=sm_scale,
                              uniform=uniform_q_len)

    def run(self, q, paged_kv_cache):
        # Like a real kernel, invisible to dispatch-level probes (the CPU graph stand-in): the schedule it
        # follows comes from plan(), not from Python re-run at replay.
        with _disable_current_modes():
            return self._attend(q, paged_kv_cache)

    def _attend(self, q, paged_kv_cache):
        stamp = self._int_workspace_buffer[:16].view(torch.int64).tolist()
        assert stamp == [id(self), self.plans], "another wrapper's plan overwrote this wrapper's int workspace"
        if self._kv_lens_buffer is not None:
            assert self._kv_lens_buffer[: len(self.kv_lens)].equal(self.kv_lens), "kv lengths overwritten"
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


class FakeEvent:
    """A CUDA event for the staging sets: done once the host waits on it (a real one completes on its own
    when the stream gets there, which a CPU test cannot wait for; this one lets a test see who waited)."""

    def __init__(self) -> None:
        self.done = False

    def synchronize(self) -> None:
        self.done = True

    def query(self) -> bool:
        return self.done


class FakeEvents:
    """`FlashInferAttention.record_event` for CPU tests: the events recorded after each plan, in order."""

    def __init__(self) -> None:
        self.recorded: list[FakeEvent] = []

    def record(self, stream) -> FakeEvent:
        self.recorded.append(FakeEvent())
        return self.recorded[-1]


class FakeFlashInfer:
    BatchDecodeWithPagedKVCacheWrapper = _FakeDecode
    BatchPrefillWithPagedKVCacheWrapper = _FakePrefill


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make engine.attention.flashinfer_backend use the fake on the CPU, with small workspaces."""
    monkeypatch.setattr(fib, "flashinfer", FakeFlashInfer)
    monkeypatch.setattr(fib, "AVAILABLE", True)
    monkeypatch.setattr(fib, "check_usable", lambda device: None)
    monkeypatch.setattr(fib, "KV_DTYPES", (torch.float16, torch.bfloat16, torch.float32))  # CPU tests run fp32
    monkeypatch.setattr(fib, "WORKSPACE_BYTES", 1024)
