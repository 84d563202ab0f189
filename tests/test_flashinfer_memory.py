"""The FlashInfer backend's memory and host work on CPU, against tests/fake_flashinfer.py: which workspaces its
wrappers share (one int workspace per slot, one float workspace for all), that a plan's host work follows the
pages in use and not max_pages, and that a pinned staging set outlives the copies reading it."""

from __future__ import annotations

import tracemalloc
import weakref
from collections import defaultdict

import numpy as np
import pytest
import torch

from specstep.engine.attention import flashinfer_backend as fib
from specstep.engine.attention.flashinfer_staging import paged_kv_layout
from specstep.engine.kv_cache import DUMMY_PAGE
from tests import fake_flashinfer
from tests.fake_flashinfer import FakeEvents, _FakeWrapper
from tests.test_flashinfer_plan import CFG, MAX_PAGES, PS, _meta, _problem

SCALE = CFG.head_dim**-0.5


@pytest.fixture
def fi(monkeypatch):
    fake_flashinfer.install(monkeypatch)
    return fib.FlashInferAttention(CFG, PS, torch.float32, torch.device("cpu"), MAX_PAGES)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_step_plans_every_slot_then_runs_them_on_shared_workspaces(fi):
    """Start-up plans graph wrappers per (slot, lanes, q) as capture does; each step then plans all its slots
    before running any (graph and eager steps). The fake's kernels read their schedule from the int workspace,
    so a workspace shared between slots fails here; one not shared within a slot fails the counts below."""
    for lanes in (4, 2, 1):  # largest first, as the GraphRunner captures
        for slot, q in (("verify", 3), ("verify", 1), ("draft.1", 1), ("refill", 3)):
            fi.plan_padding(slot, lanes, q)
    graph_step = {"verify": ([3] * 3, [8, 11, 20]), "draft.1": ([1] * 3, [6, 9, 18]),
                  "refill": ([3] * 3, [8, 11, 20])}
    eager_step = {"verify": ([1, 4, 2], [1, 8, 22]), "draft.1": ([1, 1, 1], [1, 9, 21]),
                  "prefill": ([5, 1, 7], [5, 4, 20])}
    for lanes, step in ((4, graph_step), (None, eager_step)):
        problems = {slot: _problem(qs, kvs, seed=i) for i, (slot, (qs, kvs)) in enumerate(step.items())}
        for slot, (qs, kvs) in step.items():
            fi.plan(slot, np.array(qs), np.array(kvs), problems[slot][3], lanes=lanes)
        for slot, (pool, q, ref, _, _) in problems.items():
            qs = step[slot][0]
            pad = torch.zeros((lanes - len(qs)) * qs[0] if lanes else 0, CFG.q_size)  # graph padding lanes
            out = fi.forward(torch.cat([q, pad]), pool.k[0], pool.v[0], _meta(slot), CFG.num_heads, SCALE)
            torch.testing.assert_close(out[: len(q)], ref, rtol=1e-5, atol=1e-5)

    int_ws, indices, kv_lens = defaultdict(set), defaultdict(set), defaultdict(set)
    for (slot, lanes, _), w in fi._wrappers.items():
        int_ws[slot].add(_storage(w._int_workspace_buffer))
        if w._kv_lens_buffer is not None:
            kv_lens[slot].add(_storage(w._kv_lens_buffer))
        if lanes is not None:
            indices[slot].add(_storage(w.buffers.get("paged_kv_indices_buf", w.buffers.get(
                "paged_kv_indices_buffer"))))
    assert len(fi._wrappers) == 15 and set(int_ws) == set(fi._slots) == {"verify", "draft.1", "refill", "prefill"}
    assert all(len(v) == 1 for v in int_ws.values()), "one int workspace per slot, whatever its wrapper count"
    assert len(set.union(*int_ws.values())) == len(int_ws), "slots planned together never share one"
    assert all(len(v) == 1 for v in kv_lens.values()) and all(len(v) == 1 for v in indices.values())
    assert len({_storage(w._float_workspace_buffer) for w in fi._wrappers.values()}) == 1


def _dense_layout(kv: np.ndarray, pt: np.ndarray, max_pages: int, ps: int):
    """The construction the backend used before: a rows x max_pages table and a mask gather."""
    n = np.maximum((kv + ps - 1) // ps, 1)
    dense = np.full((len(kv), max_pages), DUMMY_PAGE, dtype=np.int32)
    width = min(pt.shape[1], max_pages)
    dense[: len(pt), :width] = pt[:, :width]
    return (np.concatenate([[0], np.cumsum(n)]), dense[np.arange(max_pages) < n[:, None]], kv - (n - 1) * ps)


def test_paged_kv_layout_equals_the_dense_construction():
    rng = np.random.default_rng(0)
    for _ in range(200):
        ps, max_pages = int(rng.integers(1, 9)), int(rng.integers(1, 40))
        rows = int(rng.integers(1, 12))
        live = int(rng.integers(0, rows + 1))  # the rest: graph padding lanes (dummy page only)
        kv = rng.integers(0, max_pages * ps + 1, rows).astype(np.int32)
        width = int(rng.integers(1, max_pages + 1))  # tables may be narrower than a row's pages
        pt = rng.integers(1, 1000, (live, width)).astype(np.int64)
        for got, want in zip(paged_kv_layout(kv, pt, ps), _dense_layout(kv, pt, max_pages, ps), strict=True):
            np.testing.assert_array_equal(got, want)
            assert got.dtype == np.int32


def test_plan_host_work_follows_pages_in_use_not_max_pages(monkeypatch):
    """64 rows of a few pages each: the same plan at max_pages 512 and 32768, with no rows x max_pages array
    on the host (numpy allocations peak well below one such table) and staging sized by the pages in use."""
    fake_flashinfer.install(monkeypatch)
    rng = np.random.default_rng(1)
    kv = rng.integers(1, 8 * PS, 64)
    pt = rng.integers(1, 400, (64, 8)).astype(np.int64)
    plans, peaks = [], []
    for max_pages in (512, 32768):
        fi = fib.FlashInferAttention(CFG, PS, torch.float32, torch.device("cpu"), max_pages)
        fi.plan("decode", np.ones(64), kv, pt)  # the first plan builds the wrapper and staging
        tracemalloc.start()
        fi.plan("decode", np.ones(64), kv, pt)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        plans.append(fi._planned["decode"].plan_args)
        total = int(plans[-1]["indptr"][-1])
        staged = [s.kv_indices.numel() for s in fi._slots["decode"].staging._sets if s is not None]
        assert max(staged) < 2 * total, "pinned staging sized by the pages in use"
    for name in ("indptr", "indices", "last"):
        assert plans[0][name].equal(plans[1][name])
    assert max(peaks) < 64 * 512 * 4, peaks  # one int32 rows x max_pages table at the *smaller* max_pages


def test_a_staging_set_is_freed_or_rewritten_only_after_its_copy_is_done(fi, monkeypatch):
    """Eager plans of one slot at growing batch sizes regrow its pinned sets. FlashInfer's copy out of a set is
    its own cudaMemcpyAsync, untracked by torch's pinned allocator: a set's host arrays must stay alive (and
    unwritten) until the event recorded after its plan completes. The fake events complete only when waited on."""
    events = FakeEvents()
    staged: list[torch.Tensor] = []  # pinned host arrays the plan in progress was handed
    freed_after_copy: list[bool] = []  # for each staged array freed: had its plan's copy completed?

    original = _FakeWrapper._plan

    def spy(self, qo_indptr, indptr, indices, last, *args, **kwargs):
        staged.extend({id(b): b for t in (qo_indptr, indptr, last) if (b := t._base) is not None}.values())
        staged.append(self._pin_memory_int_workspace_buffer)
        return original(self, qo_indptr, indptr, indices, last, *args, **kwargs)

    def record(stream):
        event = events.record(stream)
        for t in staged:
            weakref.finalize(t, lambda e=event: freed_after_copy.append(e.done))
        staged.clear()
        return event

    monkeypatch.setattr(_FakeWrapper, "_plan", spy)
    fi.record_event = record
    _, _, _, pt, _ = _problem([1] * 9, [5] * 9)
    for rows in (2, 2, 3, 3, 9, 9, 2, 9):
        fi.plan("verify", np.ones(rows), np.full(rows, 5), pt[:rows])
        assert all(e.done for e in events.recorded[:-2]), "a set was reused before its copy completed"
    assert freed_after_copy and all(freed_after_copy), freed_after_copy
