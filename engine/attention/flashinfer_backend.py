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
`use_cuda_graph=True` wrapper with fixed-size device buffers (its slot's, see "Workspaces"), one wrapper per
(slot, lanes, q), so a graph captured after `plan_padding` keeps reading buffers that later plans rewrite in
place. Padding lanes attend their own
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

Workspaces: what may be shared, and what may not. A FlashInfer wrapper works in two device buffers:
  * the float workspace is scratch for one kernel launch (split-KV partial outputs and their log-sum-exps;
    `plan` only picks offsets into it). Kernels on one stream run one after another, so every wrapper of
    every model shares one (`workspace`, handed from the target's instance to the proposer's).
  * the int workspace holds the plan: `plan` writes the schedule into a pinned mirror, copies it into the int
    workspace, and the kernels read it there (a graph at the address it was captured with). Wrappers whose
    plans coexist cannot share one, and all slots of a step are planned before any of its kernels run: one
    int workspace per slot (per instance). The wrappers of one slot can share it: a step plans a slot once,
    into one wrapper; the next step's plan copies are stream-ordered after this step's kernels; a graph
    replay is always preceded by a plan of its slot into the same buffer, at the same offsets (FlashInfer
    lays a graph-mode schedule out from the wrapper's fixed sizes, not from the lengths).
The rest of a slot's plan state shares the same way (`_Slot`): FlashInfer's kv-length buffer, the graph-mode
indptr / indices / last-page buffers (views of the slot's largest set, sized lanes x max_pages, the most a
replay may attend) and the device copy of each plan's page indices. FlashInfer's constructor still allocates
a wrapper's own 8 MiB int workspace and 8 MiB pinned mirror: the slot's first wrapper donates its int
workspace, the rest are dropped before any use (their blocks go back to torch's caching allocators, which hand
them to the next wrapper's constructor). Default MTP configuration (counted on the CPU with the fake after
start-up and a few requests: 94 wrappers, 88 of them graph-mode, over 7 slots): device int workspaces
94 x 8 MiB = 752 MiB when each wrapper kept its own, now 7 x 8 MiB = 56 MiB; pinned mirrors stay at most two
per slot (see below), 12 x 8 MiB = 96 MiB here.

Staging and syncs (the one place that knows these FlashInfer details):
  * `plan` writes its schedule into the pinned mirror (`_pin_memory_int_workspace_buffer`) and copies it to
    the device asynchronously on the current stream; our indptr/last_page_len arrays are pinned too. So every
    slot has two pinned staging sets used alternately (`flashinfer_staging.PinnedStaging`), the set's mirror
    swapped into the wrapper before each plan, and an event recorded after each plan. A set is rewritten, or
    regrown (its old arrays freed), only once its event has completed: FlashInfer's copy is its own
    cudaMemcpyAsync, which torch's pinned allocator does not track, so a block freed earlier could be handed
    out and overwritten under the pending copy. (The wait is for a copy from an earlier step, normally done.)
  * `plan` is issued on the device stream, so its device copies are ordered after the step still running.
  * Page indices are passed as a device tensor: FlashInfer copies host indices with non_blocking=False, which
    would stall the host until the device stream drains.
  * Host work per plan is O(rows + pages in use) (`flashinfer_staging.paged_kv_layout`), never rows x
    max_pages: a long maximum context costs nothing until requests use it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from specstep.engine.attention.flashinfer_staging import Event, PinnedStaging, capacity, paged_kv_layout
from specstep.engine.config import ModelConfig
from specstep.engine.errors import ConfigError
from specstep.engine.forward_batch import AttentionMetadata

try:
    import flashinfer
except ImportError:  # CPU machines, or CUDA machines without the wheel
    flashinfer = None

AVAILABLE = flashinfer is not None
WORKSPACE_BYTES = 256 << 20  # the float workspace, shared by every wrapper (see "Workspaces")
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


def _record_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


class _Slot:
    """One slot's plan state, shared by all its wrappers (module docstring, "Workspaces"): FlashInfer's int
    workspace and kv-length buffer, the graph-mode buffers, the device page indices, and the pinned staging."""

    def __init__(self, device: torch.device, max_pages: int) -> None:
        self.device, self.max_pages = device, max_pages
        self.int_workspace: torch.Tensor | None = None
        self.kv_lens: torch.Tensor | None = None
        self.staging: PinnedStaging | None = None
        self._graph: dict[str, torch.Tensor] = {}
        self._graph_rows = 0
        self._indices = torch.zeros(0, dtype=torch.int32, device=device)

    def adopt(self, w: Any) -> None:
        """Point a new wrapper at the slot's buffers; the ones its constructor made are dropped unused, so no
        copy can be pending on them. The slot's first wrapper donates its own."""
        if self.int_workspace is None:
            self.int_workspace = w._int_workspace_buffer
            nbytes = self.int_workspace.numel() * self.int_workspace.element_size()
            self.staging = PinnedStaging(nbytes, pinned=self.device.type == "cuda")
        w._int_workspace_buffer = self.int_workspace
        lens = getattr(w, "_kv_lens_buffer", None)
        if isinstance(lens, torch.Tensor):  # prefill wrappers: kv lengths copied in by plan
            self.kv_lens = lens if self.kv_lens is None else self.kv_lens
            w._kv_lens_buffer = self.kv_lens

    def graph_buffers(self, rows: int, decode: bool) -> dict[str, torch.Tensor]:
        """The fixed device buffers a graph-mode wrapper of `rows` lanes is built with: views of the slot's
        largest set. Growing makes a new set; wrappers built earlier keep theirs (only this slot uses them)."""
        if rows > self._graph_rows:
            z = functools.partial(torch.zeros, dtype=torch.int32, device=self.device)
            self._graph = dict(qo=z(rows + 1), indptr=z(rows + 1), indices=z(rows * self.max_pages), last=z(rows))
            self._graph_rows = rows
        g = self._graph
        indptr, indices, last = g["indptr"][: rows + 1], g["indices"][: rows * self.max_pages], g["last"][:rows]
        if decode:
            return dict(paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
                        paged_kv_last_page_len_buffer=last)
        return dict(qo_indptr_buf=g["qo"][: rows + 1], paged_kv_indptr_buf=indptr, paged_kv_indices_buf=indices,
                    paged_kv_last_page_len_buf=last)

    def indices(self, n: int) -> torch.Tensor:
        """Device page indices for one plan (a host tensor would be copied with a blocking copy): eager wrappers
        read them at run, graph wrappers copy them into their own buffer at plan. A grown-out tensor is freed in
        stream order (only this stream used it)."""
        if n > self._indices.numel():
            self._indices = torch.zeros(capacity(n), dtype=torch.int32, device=self.device)
        return self._indices[:n]


def _make_wrapper(decode: bool, lanes: int | None, slot: _Slot, ws: torch.Tensor, group: int) -> Any:
    """A FlashInfer wrapper on the slot's buffers; graph mode (`lanes` set) gets fixed-size device buffers."""
    graph = lanes is not None
    extra = slot.graph_buffers(lanes, decode) if lanes is not None else {}
    if decode:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=graph,
                                                          use_tensor_cores=group >= 4, **extra)
    else:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=graph, **extra)
    slot.adopt(w)
    return w


class FlashInferAttention:
    """Paged attention for one model's layers via FlashInfer; see the module docstring."""

    name = "flashinfer"
    needs_plan = True

    def prompts_join(self, rows: int, keys: int) -> bool:
        return True  # ragged batches as they are: never split

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
        self._wrappers: dict[tuple[str, int | None, int | bool], Any] = {}  # FlashInfer wrappers
        self._slots: dict[str, _Slot] = {}
        self._planned: dict[str, Any] = {}  # slot -> the wrapper its last plan went into
        # Event recorded after each plan, guarding its pinned set (CPU tests pass a fake; None: no async copies).
        self.record_event: Callable[[Any], Event] | None = _record_event if self.device.type == "cuda" else None

    def _wrapper(self, slot: _Slot, name: str, lanes: int | None, q: int, decode: bool) -> Any:
        """Graph-mode wrappers are fixed in lanes and rows: one per (slot, lanes, q). Ordinary wrappers: one
        per slot and kernel family (`decode`: decode kernels, else prefill kernels)."""
        key = (name, lanes, q) if lanes is not None else (name, None, decode)
        w = self._wrappers.get(key)
        if w is None:
            w = self._wrappers[key] = _make_wrapper(decode, lanes, slot, self.workspace,
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
        if len(kv) and int(kv.max()) > self.max_pages * ps:
            raise ValueError(f"{slot}: a request needs {-(-int(kv.max()) // ps)} pages, max {self.max_pages}")
        kv_indptr, kv_indices, last_page_len = paged_kv_layout(kv, page_tables[:live], ps)
        decode = q == 1 and slot != "prefill"  # one new token per lane: the decode kernels
        st = self._slots.get(slot)
        if st is None:
            st = self._slots[slot] = _Slot(self.device, self.max_pages)
        w = self._wrapper(st, slot, lanes, q, decode)
        qo_indptr = np.zeros(rows + 1, np.int32)
        np.cumsum(q_all, out=qo_indptr[1:])
        assert st.staging is not None  # made with the slot's first wrapper, sized by its int workspace
        s = st.staging.stage(qo_indptr, kv_indptr, kv_indices, last_page_len)
        total = len(kv_indices)
        cuda = self.device.type == "cuda"  # False only in the CPU tests of the host logic (fake flashinfer)
        if cuda:
            stream = stream or torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            indices = st.indices(total)
            indices.copy_(s.kv_indices[:total], non_blocking=True)
            w._pin_memory_int_workspace_buffer = s.int_workspace  # FlashInfer's own pinned staging
            common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale, non_blocking=True)
            args = (s.kv_indptr[: rows + 1], indices, s.last_page_len[:rows], self.num_heads, self.num_kv_heads,
                    self.head_dim, ps)
            if decode:
                _call(w.plan, *args, pos_encoding_mode="NONE", **common)
            else:
                # A graph's lanes all feed q tokens: saying so lets FlashInfer size its query tiles for q rows
                # instead of a ragged worst case (and it must be said on every plan of that wrapper).
                _call(w.plan, s.qo_indptr[: rows + 1], *args, causal=True,
                      uniform_q_len=q if lanes is not None else None, **common)
            if self.record_event is not None:
                s.event = self.record_event(stream)
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
        return w.run(q.view(t, num_heads, d), kv).reshape(t, num_heads * d)
