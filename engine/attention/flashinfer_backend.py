"""FlashInfer paged attention (CUDA only, optional): prefill, decode and multi-token verify.

Importing this module never fails; `AVAILABLE` says whether flashinfer is importable. Tested against the
FlashInfer >= 0.2 wrapper API (constructor buffers, `plan(...)` then `run(q, (k_cache, v_cache))`).

Fit with our KV layout. `KVPool` stores per layer K and V as [num_pages * page_size, kv_heads, head_dim];
`.view(num_pages, page_size, kv_heads, head_dim)` is FlashInfer's NHD paged layout, passed as the (k, v)
tuple. New K/V are still written by `store_kv` (the model's slot_mapping); FlashInfer only reads. Queries
are our flat token order (request-major), which is FlashInfer's ragged `qo_indptr` order; query head h uses
KV head h // group in both.

How the model selects it (the lead wires this). `forward` has the signature of
`engine.attention.torch_backend.paged_attention`; give `LlamaAttention` an `attention` attribute defaulting
to `paged_attention` and call `self.attention(q, k_cache, v_cache, batch.attn, num_heads, scale)`. Per model
(target, draft, MTP head: separate pools and head counts) build one `FlashInferAttention` and point every
layer's `attention` at its `forward`. The AttentionMetadata mask is then unused (derive may skip it).

Life of a step (host work in the scheduler's batch preparation, all async to the device):

    prepare(slot, q_lens, page_tables, lanes)   BUILD_BATCH: pad to the graph bucket, stage page tables
    plan(prepared, kv_lens, stream)             PLAN: lengths -> indptr / indices / last_page_len, wrapper.plan()
    select(slot, lanes, q)  inside the step fn  which planned wrapper the layers' forward calls use
    model forward / graph replay                kernels read the wrapper's device buffers

`slot` names one attention use in a step: "prefill", "decode", "verify", "refill", "draft.0", "draft.1", ...
(each draft-loop iteration has its own lengths, hence its own plan). Lanes in `graph_lanes` get a
`use_cuda_graph=True` wrapper with fixed-size device buffers, one per (slot, lanes), so a graph captured
after a plan keeps reading buffers that later plans rewrite in place; other lane counts share one ordinary
wrapper per slot (eager steps, ragged prefill).

Upper-bound lengths. While step N runs, step N+1's start (hence its KV lengths) depends on how many tokens
N accepts. `prepare` needs no lengths and runs during batch preparation; `plan` needs them. FlashInfer's
kernels split KV into chunks planned from the lengths and read the actual lengths from the device buffers;
a length shorter than planned can fall before a planned chunk start (decode.cuh: chunk_size = chunk_end -
chunk_start, unsigned), so planning with an upper bound and patching lengths on the device is not safe.
Instead: plan with upper bounds (base + k + 1) when the step is built, so buffers, staging and work split
are checked early, and when N's accepted lengths arrive (PATCH) call `plan` again with the exact lengths; the
re-plan (tens of microseconds of CPU) is hidden behind N's refill. If every draft was accepted the upper
bound is exact and the second plan is skipped (`Prepared.planned_lens`).

Staging and syncs (the one place that knows these FlashInfer details):
  * `plan` writes its schedule into a pinned host buffer (`_pin_memory_int_workspace_buffer`) and copies it
    to the device asynchronously on the current stream; our indptr/last_page_len arrays are pinned too. So
    every slot has two pinned staging sets used alternately, swapped into the wrapper before each plan, and
    an event recorded after each plan; before a set is reused its event is synchronised (the copy from an
    earlier step, normally long done).
  * `plan` is issued on the device stream, so its device copies are ordered after the step still running.
  * Page indices are passed as a device tensor: FlashInfer copies host indices with non_blocking=False, which
    would stall the host until the device stream drains.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.config import ModelConfig
from engine.forward_batch import AttentionMetadata
from engine.kv_cache import DUMMY_PAGE

try:
    import flashinfer
except ImportError:  # CPU machines, or CUDA machines without the wheel
    flashinfer = None

AVAILABLE = flashinfer is not None
WORKSPACE_BYTES = 256 << 20
INT_WORKSPACE_BYTES = 8 << 20


def _call(fn, *args: Any, **kwargs: Any) -> Any:
    """Call with the keyword arguments this FlashInfer version accepts (the API grew over releases)."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


@dataclass(slots=True)
class _Staging:
    """One pinned host set: what plan() reads on the host and copies to the device asynchronously."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    int_workspace: torch.Tensor  # swapped in as FlashInfer's own pinned staging buffer
    event: torch.cuda.Event | None = None


class _StagingPair:
    """Two pinned sets per slot, used alternately. Plans of different slots (all made before a step's kernels
    are enqueued) never share a set, so the event wait below only ever waits for a copy from an earlier step.
    Wrappers of one slot at different buckets share the pair: one step plans a slot once (twice with the
    upper-bound plan), never at two buckets."""

    def __init__(self, max_pages: int, pinned: bool) -> None:
        self._max_pages = max_pages
        self._pinned = pinned
        self._sets: list[_Staging] = []
        self._lanes = 0
        self._turn = 0

    def next(self, lanes: int) -> _Staging:
        if lanes > self._lanes:  # grow; pinned blocks still read by in-flight copies stay alive until done
            pin = dict(dtype=torch.int32, pin_memory=self._pinned)
            self._sets = [_Staging(torch.empty(lanes + 1, **pin), torch.empty(lanes + 1, **pin),
                                   torch.empty(lanes * self._max_pages, **pin), torch.empty(lanes, **pin),
                                   torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=self._pinned))
                          for _ in range(2)]
            self._lanes = lanes
        self._turn ^= 1
        s = self._sets[self._turn]
        if s.event is not None:
            s.event.synchronize()  # guard: never overwrite pinned memory an async copy has not read yet
        return s


class _Wrapper:
    """A FlashInfer wrapper; graph mode (`lanes` set) gets fixed-size device buffers, as capture needs."""

    def __init__(self, decode: bool, lanes: int | None, max_pages: int, ws: torch.Tensor, group: int) -> None:
        dev = ws.device
        graph = lanes is not None
        rows = lanes or 1
        extra: dict[str, torch.Tensor] = {}
        if graph:
            indptr = torch.zeros(rows + 1, dtype=torch.int32, device=dev)
            indices = torch.zeros(rows * max_pages, dtype=torch.int32, device=dev)
            last = torch.zeros(rows, dtype=torch.int32, device=dev)
            extra = (dict(paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
                          paged_kv_last_page_len_buffer=last) if decode else
                     dict(qo_indptr_buf=torch.arange(rows + 1, dtype=torch.int32, device=dev),
                          paged_kv_indptr_buf=indptr, paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=last))
        if decode:
            self.w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=graph,
                                                                   use_tensor_cores=group >= 4, **extra)
        else:
            self.w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=graph, **extra)
        # Page indices go to FlashInfer as a device tensor (a host one is copied with a blocking copy). One
        # per wrapper is enough: the next plan's copy into it is stream-ordered after the kernels reading it.
        self.dev_indices = torch.zeros(rows * max_pages, dtype=torch.int32, device=dev)

    def indices(self, n: int) -> torch.Tensor:
        if n > self.dev_indices.numel():  # ordinary wrappers only; the old tensor is freed in stream order
            self.dev_indices = torch.zeros(n, dtype=torch.int32, device=self.dev_indices.device)
        return self.dev_indices[:n]


@dataclass(slots=True)
class Prepared:
    """A step's attention plan in the making: host arrays staged, lengths still to come."""

    slot: str
    lanes: int  # planned lanes (the graph bucket, or the live batch)
    q_lens: np.ndarray  # [lanes] int32 (padding lanes: q)
    page_tables: np.ndarray  # [lanes, P] int32 (padding lanes: the dummy page)
    live: int
    planned_lens: np.ndarray | None = None  # kv lengths of the last plan() (None: not planned yet)


class FlashInferAttention:
    """Paged attention for one model's layers via FlashInfer; see the module docstring."""

    def __init__(self, cfg: ModelConfig, page_size: int, dtype: torch.dtype, device: torch.device,
                 max_pages_per_request: int, graph_lanes: tuple[int, ...] = (),
                 workspace: torch.Tensor | None = None) -> None:
        if not AVAILABLE:
            raise RuntimeError("flashinfer is not installed (pip install flashinfer-python, or its wheel)")
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.page_size, self.dtype, self.device = page_size, dtype, torch.device(device)
        self.max_pages = max_pages_per_request
        self.graph_lanes = tuple(sorted(graph_lanes))
        # One float workspace for every wrapper (and model, if passed in): kernels run in stream order.
        self.workspace = workspace if workspace is not None else torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8,
                                                                            device=device)
        self._wrappers: dict[tuple[str, int | None, int | bool], _Wrapper] = {}
        self._staging: dict[str, _StagingPair] = {}
        self._active: _Wrapper | None = None

    def _key(self, slot: str, lanes: int, q: int) -> tuple[str, int | None, int | bool]:
        """Graph-mode wrappers are fixed in lanes and rows: one per (slot, lanes, q). Ordinary wrappers: one
        per slot and wrapper type (decode kernels for q = 1, prefill kernels otherwise)."""
        decode = q == 1 and slot != "prefill"
        return (slot, lanes, q) if lanes in self.graph_lanes else (slot, None, decode)

    def _wrapper(self, key: tuple[str, int | None, int | bool], decode: bool) -> _Wrapper:
        w = self._wrappers.get(key)
        if w is None:
            w = self._wrappers[key] = _Wrapper(decode, key[1], self.max_pages, self.workspace,
                                               self.num_heads // self.num_kv_heads)
        return w

    def prepare(self, slot: str, q_lens: np.ndarray, page_tables: np.ndarray, lanes: int | None = None) -> Prepared:
        """Stage a step's page tables and query lengths, padded to `lanes` (the graph bucket)."""
        q_lens = np.asarray(q_lens, dtype=np.int32)
        live = len(q_lens)
        lanes = lanes or live
        q = int(q_lens.max(initial=1))
        pt = np.full((lanes, self.max_pages), DUMMY_PAGE, dtype=np.int32)
        width = min(page_tables.shape[1], self.max_pages) if live else 0
        pt[:live, :width] = page_tables[:, :width]
        return Prepared(slot, lanes, np.concatenate([q_lens, np.full(lanes - live, q, np.int32)]), pt, live)

    def plan_padding(self, slot: str, lanes: int, q: int, stream: torch.cuda.Stream | None = None) -> None:
        """Plan every lane as a padding lane: what a graph is captured with (GraphRunner pads the same way)."""
        prep = Prepared(slot, lanes, np.full(lanes, q, np.int32),
                        np.full((lanes, self.max_pages), DUMMY_PAGE, np.int32), live=0)
        self.plan(prep, np.zeros(0, np.int32), stream)

    def plan(self, prep: Prepared, kv_lens: np.ndarray, stream: torch.cuda.Stream | None = None) -> None:
        """Plan with these KV lengths (live lanes; upper bounds or exact), on `stream` (the device stream).

        Padding lanes attend their own q tokens on the dummy page (kv_len = q), as the GraphRunner pads them.
        """
        kv = np.concatenate([np.asarray(kv_lens, dtype=np.int32), prep.q_lens[prep.live:]])
        if prep.planned_lens is not None and np.array_equal(prep.planned_lens, kv):
            return
        ps = self.page_size
        n_pages = np.maximum((kv + ps - 1) // ps, 1)
        if int(n_pages.max()) > self.max_pages:
            raise ValueError(f"{prep.slot}: a request needs {int(n_pages.max())} pages, max {self.max_pages}")
        q = int(prep.q_lens.max())
        key = self._key(prep.slot, prep.lanes, q)
        decode = q == 1 and prep.slot != "prefill"
        w = self._wrapper(key, decode)
        cuda = self.device.type == "cuda"  # False only in the CPU tests of the host logic (fake flashinfer)
        s = self._staging.setdefault(prep.slot, _StagingPair(self.max_pages, cuda)).next(prep.lanes)
        b, total = prep.lanes, int(n_pages.sum())
        s.kv_indptr[0] = 0
        s.kv_indptr[1: b + 1] = torch.from_numpy(np.cumsum(n_pages, dtype=np.int32))
        s.kv_indices[:total] = torch.from_numpy(prep.page_tables[np.arange(self.max_pages) < n_pages[:, None]])
        s.last_page_len[:b] = torch.from_numpy(kv - (n_pages - 1) * ps)
        s.qo_indptr[0] = 0
        s.qo_indptr[1: b + 1] = torch.from_numpy(np.cumsum(prep.q_lens, dtype=np.int32))
        if cuda:
            stream = stream or torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            indices = w.indices(total)
            indices.copy_(s.kv_indices[:total], non_blocking=True)
            w.w._pin_memory_int_workspace_buffer = s.int_workspace  # FlashInfer's own pinned staging
            common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale, non_blocking=True)
            args = (s.kv_indptr[: b + 1], indices, s.last_page_len[:b], self.num_heads, self.num_kv_heads,
                    self.head_dim, ps)
            if decode:
                _call(w.w.plan, *args, pos_encoding_mode="NONE", **common)
            else:
                _call(w.w.plan, s.qo_indptr[: b + 1], *args, causal=True, **common)
            if cuda:
                s.event = torch.cuda.Event()
                s.event.record(stream)
        prep.planned_lens = kv

    def select(self, slot: str, lanes: int, q: int) -> None:
        """Make the wrapper planned for (slot, lanes, q tokens per lane) the one `forward` uses; call it in
        the step function (under capture it runs once and the graph keeps that wrapper's buffers)."""
        key = self._key(slot, lanes, q)
        if key not in self._wrappers:
            raise RuntimeError(f"attention slot {slot!r} at {lanes} lanes, q={q} was never planned")
        self._active = self._wrappers[key]

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                num_heads: int, scale: float) -> torch.Tensor:
        """Same contract as torch_backend.paged_attention: q [T, H * D] -> [T, H * D]."""
        if self._active is None:
            raise RuntimeError("FlashInferAttention.forward before select()")
        if num_heads != self.num_heads or scale != self.scale:
            raise ValueError("FlashInferAttention was built for another model's heads / scale")
        t = q.shape[0]
        ps, hkv, d = self.page_size, k_cache.shape[1], k_cache.shape[2]
        kv = (k_cache.view(-1, ps, hkv, d), v_cache.view(-1, ps, hkv, d))
        return self._active.w.run(q.view(t, num_heads, d), kv).reshape(t, num_heads * d)
