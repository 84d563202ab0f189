"""The C++ attention kernel (`engine/attention/cpu_attention.cpp`): SDPA's results to fp32 rounding on ragged
paged batches, and every row's bits independent of the lanes and rows beside it, the page table's width and the
threads."""

from __future__ import annotations

import pytest
import torch

import specstep.engine.batch_builder as bb
from specstep.engine.attention import cpu_attention as kernel
from specstep.engine.attention.torch_backend import TorchAttention

pytestmark = pytest.mark.skipif(bool(kernel.unavailable()), reason=f"kernel unavailable: {kernel.unavailable()}")

HEADS, KV_HEADS, D, PAGE = 9, 3, 64, 16


def paged(q_lens, starts, seed=0, spare_pages=0):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-(s + q) // PAGE) + spare_pages for s, q in zip(starts, q_lens)]
    k_cache = torch.randn((sum(pages) + 1) * PAGE, KV_HEADS, D, generator=g)
    v_cache = torch.randn_like(k_cache)
    tables, nxt = [], 1
    for n in pages:
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    q = torch.randn(sum(q_lens), HEADS * D, generator=g)
    return q, k_cache, v_cache, tables


def test_kernel_is_sdpa_to_fp32_rounding():
    q_lens, starts = [5, 1, 17, 3], [60, 17, 300, 0]
    q, kc, vc, tables = paged(q_lens, starts)
    fb = bb.build_forward_batch([[0] * n for n in q_lens], starts, tables, PAGE, "cpu")
    got = TorchAttention(batch_invariant=True).forward(q, kc, vc, fb.attn, HEADS, 0.125)  # ragged: in parts
    ref = TorchAttention().forward(q, kc, vc, fb.attn, HEADS, 0.125)  # SDPA
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6)


def test_a_rows_bits_do_not_depend_on_its_step(monkeypatch):
    """A lane's rows alone, with a longer page table, beside other lanes, and on 1 or 2 threads: the same bits;
    a verify step's row i equals the decode step at that position."""
    q_lens, starts = [5, 3, 4], [60, 17, 200]
    q, kc, vc, tables = paged(q_lens, starts, seed=1, spare_pages=2)
    monkeypatch.setattr(bb, "PAD_LIMIT", float("inf"))
    fb = bb.build_forward_batch([[0] * n for n in q_lens], starts, tables, PAGE, "cpu")
    assert not hasattr(fb.attn, "parts")  # one padded batch: every lane beside the others
    batch = {th: kernel.cpu_attention(q, kc, vc, fb.attn, HEADS, 0.125, threads=th) for th in (1, 2)}
    assert torch.equal(batch[1], batch[2])
    alone = bb.build_forward_batch([[0] * 5], [60], [tables[0][:-2]], PAGE, "cpu")  # the table without spares
    assert torch.equal(kernel.cpu_attention(q[:5], kc, vc, alone.attn, HEADS, 0.125), batch[1][:5])
    for i in range(5):  # row i of the verify step = a decode step at position 60 + i over the same cache
        one = bb.build_forward_batch([[0]], [60 + i], [tables[0]], PAGE, "cpu")
        assert torch.equal(kernel.cpu_attention(q[i: i + 1], kc, vc, one.attn, HEADS, 0.125), batch[1][i: i + 1])
