"""The torch backend attends a batch of very different lengths in parts (`attention_parts`): a decode row
beside a long prompt chunk is not padded to the chunk's [q, keys] block. Split and unsplit attention agree."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specstep.engine.batch_builder as bb
from specstep.engine.attention.invariant_attention import MAX_QUERY_ROWS
from specstep.engine.attention.torch_backend import TorchAttention
from specstep.engine.forward_batch import SplitAttention


def test_parts_bound_the_padding():
    q = np.array([1, 1, 1, 256, 1, 3], np.int64)
    kv = np.array([40, 90, 17, 3900, 33, 60], np.int64)
    parts = bb.attention_parts(q, kv, page_size=16)
    keys = -(-kv // 16) * 16
    assert parts[0] == (0, 3)  # the decode rows before the chunk are not padded to it
    assert [p[0] for p in parts] + [6] == [0] + [p[1] for p in parts]  # consecutive, covering every row
    for r0, r1 in parts:
        padded = (r1 - r0) * q[r0:r1].max() * keys[r0:r1].max()
        assert padded <= bb.PAD_LIMIT * (q[r0:r1] * keys[r0:r1]).sum()
    assert bb.attention_parts(np.full(8, 5), np.full(8, 100), 16) == [(0, 8)]  # alike: one batch
    for r0, r1 in parts:  # a prompt-sized request is a part of its own
        assert r1 - r0 == 1 or (q[r0:r1] <= MAX_QUERY_ROWS).all()


def test_a_decode_row_beside_a_chunk_past_the_kernel_keeps_a_decode_steps_bits():
    """A decode row whose keys make padding it to a long chunk cheap (300 keys beside a fresh 600-token chunk) would
    share the chunk's part, which attends with SDPA past the kernel's prompt sizes: its row must still be a decode
    step's, bitwise."""
    import specstep.engine.attention.torch_backend as tb

    heads, kv_heads, d, page_size = 6, 2, 64, 16
    if not tb.kernel.runs(torch.zeros(1), torch.zeros(1, 1, d)):
        pytest.skip(f"the CPU attention kernel does not run here: {tb.kernel.unavailable()}")
    g = torch.Generator().manual_seed(2)
    q_lens, starts = [1, 600], [299, 0]
    pages_per = [-(-(s + n) // page_size) for s, n in zip(starts, q_lens)]
    k_cache = torch.randn((sum(pages_per) + 1) * page_size, kv_heads, d, generator=g)
    v_cache = torch.randn_like(k_cache)
    tables = [list(range(1, 1 + pages_per[0])), list(range(1 + pages_per[0], 1 + sum(pages_per)))]
    q = torch.randn(sum(q_lens), heads * d, generator=g)
    assert not tb.kernel.takes_prompt(600, 608, heads // kv_heads)  # the chunk's part takes SDPA
    mixed = bb.build_forward_batch([[0] * n for n in q_lens], starts, tables, page_size, "cpu", slot=tb.PROMPT_SLOT)
    attn = TorchAttention(batch_invariant=True)
    out = attn.forward(q, k_cache, v_cache, mixed.attn, heads, 0.125)
    alone = bb.build_forward_batch([[0]], starts[:1], tables[:1], page_size, "cpu")
    assert torch.equal(out[:1], attn.forward(q[:1], k_cache, v_cache, alone.attn, heads, 0.125))


@pytest.mark.parametrize("page_size", [4, 16])
def test_split_attention_equals_one_padded_batch(page_size, monkeypatch):
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d = 6, 2, 8
    q_lens = [1, 1, 37, 1, 5]
    starts = [9, 70, 100, 3, 0]
    pages_per = [-(-(s + q) // page_size) for s, q in zip(starts, q_lens)]
    num_slots = (sum(pages_per) + 1) * page_size
    k_cache = torch.randn(num_slots, kv_heads, d, generator=g)
    v_cache = torch.randn(num_slots, kv_heads, d, generator=g)
    tables, nxt = [], 1  # page 0 is the dummy page
    for n in pages_per:
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    ids = [[0] * q for q in q_lens]
    q = torch.randn(sum(q_lens), heads * d, generator=g)
    split = bb.build_forward_batch(ids, starts, tables, page_size, "cpu")
    assert isinstance(split.attn, SplitAttention) and len(split.attn.parts) > 1
    monkeypatch.setattr(bb, "PAD_LIMIT", float("inf"))
    whole = bb.build_forward_batch(ids, starts, tables, page_size, "cpu")
    assert not isinstance(whole.attn, SplitAttention)
    torch.testing.assert_close(split.positions, whole.positions)
    torch.testing.assert_close(split.slot_mapping, whole.slot_mapping)
    a = TorchAttention().forward(q, k_cache, v_cache, split.attn, heads, 0.3)
    b = TorchAttention().forward(q, k_cache, v_cache, whole.attn, heads, 0.3)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _take_path(monkeypatch, path: str):
    """The attention backend's module with its invariant path pinned: "kernel" (the C++ kernel; skipped where it
    cannot run) or "torch" (the torch ops)."""
    import specstep.engine.attention.torch_backend as tb

    if path == "kernel" and not tb.kernel.runs(torch.zeros(1), torch.zeros(1, 1, 16)):
        pytest.skip(f"the CPU attention kernel does not run here: {tb.kernel.unavailable()}")
    if path == "torch":
        monkeypatch.setattr(tb.kernel, "runs", lambda *a: False)
    return tb


def _paged(q_lens, starts, page_size, kv_heads, d, g):
    """A KV cache holding every request's pages (page 0 the dummy), and each request's page table."""
    pages_per = [-(-(s + n) // page_size) for s, n in zip(starts, q_lens)]
    k_cache = torch.randn((sum(pages_per) + 1) * page_size, kv_heads, d, generator=g)
    tables, nxt = [], 1
    for n in pages_per:
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    return k_cache, torch.randn_like(k_cache), tables


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_every_request_attends_as_it_would_alone(monkeypatch, path):
    """A forward of several prompts and chunks (fresh prompts of 24-600 tokens, late chunks of 12 and 40, decode
    rows) attends each request bitwise as a forward of that request alone: prefill batching and a mixed step's
    company never change a prompt's bits (with int8 activations a rounding difference there became other tokens).
    Both invariant paths: the C++ kernel (SDPA past its prompt sizes) and the torch ops."""
    tb = _take_path(monkeypatch, path)
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, page_size = 6, 2, 16, 16
    q_lens = [1, 105, 83, 1, 12, 600, 24, 3, 40]
    starts = [40, 0, 0, 90, 900, 0, 0, 17, 300]
    k_cache, v_cache, tables = _paged(q_lens, starts, page_size, kv_heads, d, g)
    q = torch.randn(sum(q_lens), heads * d, generator=g)
    attn = TorchAttention(batch_invariant=True, kernel_group=heads // kv_heads if path == "kernel" else None)
    together = bb.build_forward_batch([[0] * n for n in q_lens], starts, tables, page_size, "cpu", attn,
                                      tb.PROMPT_SLOT)
    assert isinstance(together.attn, SplitAttention)
    out = attn.forward(q, k_cache, v_cache, together.attn, heads, 0.25)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    for i, n in enumerate(q_lens):
        alone = bb.build_forward_batch([[0] * n], starts[i:i + 1], tables[i:i + 1], page_size, "cpu", attn,
                                       tb.PROMPT_SLOT)
        ref = attn.forward(q[cu[i]:cu[i + 1]], k_cache, v_cache, alone.attn, heads, 0.25)
        assert torch.equal(out[cu[i]:cu[i + 1]], ref), f"request {i} ({n} rows at {starts[i]})"


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_a_fused_mixed_steps_verify_rows_keep_a_verify_steps_bits(monkeypatch, path):
    """A fused mixed step's one batch (`StepEngine.run_mixed`): a decode step's verify rows (3 positions a lane)
    beside prompt chunks attend bitwise as the verify step alone, and each chunk as it would alone. Where the C++
    kernel takes the padded shape the whole step is one part (the C++ layers' one call a step)."""
    tb = _take_path(monkeypatch, path)
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, page_size = 6, 2, 16, 16
    q_lens, starts = [3, 3, 12, 64], [40, 90, 900, 0]  # two verify lanes, then a late chunk and a fresh one
    k_cache, v_cache, tables = _paged(q_lens, starts, page_size, kv_heads, d, g)
    q = torch.randn(sum(q_lens), heads * d, generator=g)
    attn = TorchAttention(batch_invariant=True, kernel_group=heads // kv_heads if path == "kernel" else None)
    verify = bb.build_forward_batch([[0] * 3] * 2, starts[:2], tables[:2], page_size, "cpu", attn, "verify")
    mixed = bb.build_forward_batch([[0] * n for n in q_lens], starts, tables, page_size, "cpu", attn,
                                   tb.PROMPT_SLOT)
    assert isinstance(mixed.attn, SplitAttention) == (path == "torch")  # the kernel takes the step as one part
    out = attn.forward(q, k_cache, v_cache, mixed.attn, heads, 0.25)
    assert torch.equal(out[:6], attn.forward(q[:6], k_cache, v_cache, verify.attn, heads, 0.25))
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    for i in (2, 3):
        alone = bb.build_forward_batch([[0] * q_lens[i]], starts[i:i + 1], tables[i:i + 1], page_size, "cpu", attn,
                                       tb.PROMPT_SLOT)
        ref = attn.forward(q[cu[i]:cu[i + 1]], k_cache, v_cache, alone.attn, heads, 0.25)
        assert torch.equal(out[cu[i]:cu[i + 1]], ref), f"chunk {i}"


def test_lanes_join_only_where_the_kernel_takes_their_page_tables_width(monkeypatch):
    """A part attends over its widest page table's keys, and a table may run past the keys in use (pages
    reserved for a step's later positions). A 256-row chunk over 5,440 keys is inside the kernel's prompt sizes
    (3 query heads a KV head), but beside a verify lane whose table holds one page more it is not: the two must
    not join, or both fall to padded SDPA and lose their own bits."""
    tb = _take_path(monkeypatch, "kernel")
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, d, page_size = 6, 2, 16, 16
    q_lens, starts = [3, 256], [40, 5184]
    k_cache, v_cache, tables = _paged(q_lens, starts, page_size, kv_heads, d, g)
    tables[0] = tables[0] + list(range(1, 1 + 341 - len(tables[0])))  # reserved far ahead: 341 pages
    assert len(tables[1]) == 340 and tb.kernel.takes_prompt(256, 340 * page_size, 3)
    assert not tb.kernel.takes_prompt(256, 341 * page_size, 3)
    q = torch.randn(sum(q_lens), heads * d, generator=g)
    attn = TorchAttention(batch_invariant=True, kernel_group=heads // kv_heads)
    both = bb.build_forward_batch([[0] * n for n in q_lens], starts, tables, page_size, "cpu", attn, tb.PROMPT_SLOT)
    assert isinstance(both.attn, SplitAttention)
    out = attn.forward(q, k_cache, v_cache, both.attn, heads, 0.25)
    for i, (t0, t1) in enumerate([(0, 3), (3, 259)]):
        alone = bb.build_forward_batch([[0] * q_lens[i]], starts[i:i + 1], tables[i:i + 1], page_size, "cpu", attn,
                                       tb.PROMPT_SLOT)
        assert torch.equal(out[t0:t1], attn.forward(q[t0:t1], k_cache, v_cache, alone.attn, heads, 0.25)), i
