"""FlashInfer paged attention (CUDA only, optional): prefill, decode and multi-token verify.

Importing this module never fails; `AVAILABLE` says whether flashinfer is importable. Written against the
FlashInfer >= 0.2 wrapper API (constructor buffers, `plan(...)` then `run(q, (k_cache, v_cache))`); keyword
arguments a version does not know are dropped (`_call`).

Fit with our KV layout. `KVPool` stores per layer K and V as [num_pages * page_size, kv_heads, head_dim];
`.view(num_pages, page_size, kv_heads, head_dim)` is FlashInfer's NHD paged layout, passed as the (k, v)
tuple. New K/V are still written by `store_kv` (the model's slot_mapping); FlashInfer only reads. Queries
are our flat token order (request-major), which is FlashInfer's ragged `qo_indptr` order; query head h uses
KV head h // group in both. RoPE is applied by the model before the K/V write, so FlashInfer's is off.

How the engine uses it (`scheduler.build.install_attention`, `StepEngine`): one instance per model (target,
draft model or MTP head: separate pools and head counts), installed as the model's `attention`. Every forward
names its plan in `AttentionMetadata.slot`: "prefill", "verify", "draft.1" .. "draft.{k-1}", "refill".
Before a forward runs, the step engine calls `plan(slot, q_lens, kv_lens, page_tables, lanes)` with that
forward's host lengths; `forward` then runs the wrapper last planned for the slot. A step plans all its slots
before any of its kernels are enqueued (a graph replays them all at once).

Graph mode. `lanes` set means "this forward is a graph replay over `lanes` lanes": the plan goes into a
`use_cuda_graph=True` wrapper with fixed-size device buffers, one per (slot, lanes, q), so a graph captured
after `plan_padding` keeps reading buffers that later plans rewrite in place. Padding lanes attend their own
q tokens on the dummy page (kv_len = q), as the GraphRunner pads them. Eager forwards share one ordinary
wrapper per (slot, decode or prefill kernels).

Exact lengths only. While step N runs, step N+1's KV lengths depend on how many tokens N accepts. FlashInfer
splits KV into chunks planned from the lengths and reads the actual lengths from device buffers; a length
shorter than planned can fall before a planned chunk start (decode.cuh: chunk_size = chunk_end - chunk_start,
unsigned), so planning with an upper bound and patching lengths on the device is not safe. The engine
therefore builds step N+1 while N runs as usual, then waits for N's accepted lengths (a second, early host
sync; traced as `wait_accepted`), plans with the exact lengths (`plan`, tens of microseconds) and launches.
The device idles for the plan and the launch. (Next refinement: read the accepted lengths right after N's
accept stage, so the plan hides behind N's refill.)

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
import functools
import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specstep.engine.config import ModelConfig
from specstep.engine.errors import ConfigError
from specstep.engine.forward_batch import AttentionMetadata
from specstep.engine.kv_cache import DUMMY_PAGE

try:
    import flashinfer
except ImportError:  # CPU machines, or CUDA machines without the wheel
    flashinfer = None

AVAILABLE = flashinfer is not None
WORKSPACE_BYTES = 256 << 20
INT_WORKSPACE_BYTES = 8 << 20
KV_DTYPES = (torch.float16, torch.bfloat16)  # FlashInfer's kernels have no float32 variant


def check_usable(device: torch.device) -> None:
    """FlashInfer's kernels need the package and a CUDA device (the CPU tests replace this check)."""
    if not AVAILABLE:
        raise ConfigError("attention backend flashinfer: the flashinfer package is not installed "
                          "(pip install specstep[cuda], or bring its wheel)")
    if device.type != "cuda":
        raise ConfigError(f"attention backend flashinfer needs a CUDA device, not {device}")


@functools.cache
def _accepted_keywords(fn) -> frozenset[str] | None:
    """Keyword names `fn` accepts (None: any, it takes **kwargs); cached, plan() runs every step."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(params)


def _call(fn, *args: Any, **kwargs: Any) -> Any:
    """Call with the keyword arguments this FlashInfer version accepts (the API grew over releases)."""
    accepted = _accepted_keywords(getattr(fn, "__func__", fn))
    if accepted is not None:
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
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
    Wrappers of one slot at different buckets share the pair: one step plans a slot once."""

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


class FlashInferAttention:
    """Paged attention for one model's layers via FlashInfer; see the module docstring."""

    name = "flashinfer"
    needs_plan = True

    def __init__(self, cfg: ModelConfig, page_size: int, dtype: torch.dtype, device: torch.device,
                 max_pages_per_request: int, workspace: torch.Tensor | None = None) -> None:
        check_usable(torch.device(device))
        if dtype not in KV_DTYPES:
            raise ConfigError(f"attention backend flashinfer needs a float16 or bfloat16 model, not {dtype} "
                              "(pass --dtype bfloat16)")
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.page_size, self.dtype, self.device = page_size, dtype, torch.device(device)
        self.max_pages = max_pages_per_request
        # One float workspace for every wrapper (and model, if passed in): kernels run in stream order.
        self.workspace = workspace if workspace is not None else torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8,
                                                                            device=device)
        self._wrappers: dict[tuple[str, int | None, int | bool], _Wrapper] = {}
        self._staging: dict[str, _StagingPair] = {}
        self._planned: dict[str, _Wrapper] = {}  # slot -> the wrapper its last plan went into

    def _wrapper(self, slot: str, lanes: int | None, q: int, decode: bool) -> _Wrapper:
        """Graph-mode wrappers are fixed in lanes and rows: one per (slot, lanes, q). Ordinary wrappers: one
        per slot and kernel family (`decode`: decode kernels, else prefill kernels)."""
        key = (slot, lanes, q) if lanes is not None else (slot, None, decode)
        w = self._wrappers.get(key)
        if w is None:
            w = self._wrappers[key] = _Wrapper(decode, lanes, self.max_pages, self.workspace,
                                               self.num_heads // self.num_kv_heads)
        return w

    def plan_padding(self, slot: str, lanes: int, q: int, stream: torch.cuda.Stream | None = None) -> None:
        """Plan every lane as a padding lane: what a graph is captured with (GraphRunner pads the same way)."""
        self.plan(slot, np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros((0, 1), np.int32), lanes, stream,
                  q_pad=q)

    def plan(self, slot: str, q_lens: np.ndarray, kv_lens: np.ndarray, page_tables: np.ndarray,
             lanes: int | None = None, stream: torch.cuda.Stream | None = None, q_pad: int | None = None) -> None:
        """Plan `slot` for live lanes with q_lens[b] new tokens and kv_lens[b] keys (new ones included) over
        page_tables [B, >= pages] (host); `lanes`: a graph replay at that many lanes (padding the rest)."""
        q_lens = np.asarray(q_lens, dtype=np.int32)
        live = len(q_lens)
        rows = lanes or live
        q = int(q_lens.max(initial=q_pad or 1))
        q_all = np.concatenate([q_lens, np.full(rows - live, q, np.int32)])
        if lanes is not None and (q_all != q).any():
            raise ValueError(f"{slot}: a graph replay feeds the same number of tokens to every lane, got {q_lens}")
        kv = np.concatenate([np.asarray(kv_lens, dtype=np.int32), q_all[live:]])
        ps = self.page_size
        n_pages = np.maximum((kv + ps - 1) // ps, 1)
        if int(n_pages.max(initial=1)) > self.max_pages:
            raise ValueError(f"{slot}: a request needs {int(n_pages.max())} pages, max {self.max_pages}")
        pt = np.full((rows, self.max_pages), DUMMY_PAGE, dtype=np.int32)
        width = min(page_tables.shape[1], self.max_pages)
        pt[:live, :width] = page_tables[:live, :width]
        decode = q == 1 and slot != "prefill"  # one new token per lane: the decode kernels
        w = self._wrapper(slot, lanes, q, decode)
        cuda = self.device.type == "cuda"  # False only in the CPU tests of the host logic (fake flashinfer)
        s = self._staging.setdefault(slot, _StagingPair(self.max_pages, cuda)).next(rows)
        total = int(n_pages.sum())
        s.kv_indptr[0] = 0
        s.kv_indptr[1: rows + 1] = torch.from_numpy(np.cumsum(n_pages, dtype=np.int32))
        s.kv_indices[:total] = torch.from_numpy(pt[np.arange(self.max_pages) < n_pages[:, None]])
        s.last_page_len[:rows] = torch.from_numpy(kv - (n_pages - 1) * ps)
        s.qo_indptr[0] = 0
        s.qo_indptr[1: rows + 1] = torch.from_numpy(np.cumsum(q_all, dtype=np.int32))
        if cuda:
            stream = stream or torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            indices = w.indices(total)
            indices.copy_(s.kv_indices[:total], non_blocking=True)
            w.w._pin_memory_int_workspace_buffer = s.int_workspace  # FlashInfer's own pinned staging
            common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale, non_blocking=True)
            args = (s.kv_indptr[: rows + 1], indices, s.last_page_len[:rows], self.num_heads, self.num_kv_heads,
                    self.head_dim, ps)
            if decode:
                _call(w.w.plan, *args, pos_encoding_mode="NONE", **common)
            else:
                # A graph's lanes all feed q tokens: saying so lets FlashInfer size its query tiles for q rows
                # instead of a ragged worst case (and it must be said on every plan of that wrapper).
                _call(w.w.plan, s.qo_indptr[: rows + 1], *args, causal=True,
                      uniform_q_len=q if lanes is not None else None, **common)
            if cuda:
                s.event = torch.cuda.Event()
                s.event.record(stream)
        self._planned[slot] = w

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                num_heads: int, scale: float) -> torch.Tensor:
        """Same contract as torch_backend.paged_attention: q [T, H * D] -> [T, H * D], with the plan of
        `meta.slot` (under capture the graph keeps that wrapper's buffers)."""
        w = self._planned.get(meta.slot)
        if w is None:
            raise RuntimeError(f"attention slot {meta.slot!r} was never planned")
        if num_heads != self.num_heads or scale != self.scale:
            raise ValueError("FlashInferAttention was built for another model's heads / scale")
        t = q.shape[0]
        ps, hkv, d = self.page_size, k_cache.shape[1], k_cache.shape[2]
        kv = (k_cache.view(-1, ps, hkv, d), v_cache.view(-1, ps, hkv, d))
        return w.w.run(q.view(t, num_heads, d), kv).reshape(t, num_heads * d)
