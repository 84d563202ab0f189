"""The batch-invariant attention path (`engine.attention.invariant_attention`): SDPA's values, the bits a row gets
alone whatever the lanes, look-ahead pages or workspace blocks beside it, and memory within its estimate."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from specstep.engine import batch_builder
from specstep.engine.attention.invariant_attention import KEY_BLOCK, MAX_QUERY_ROWS, measure_min_rows
from specstep.engine.attention.torch_backend import DEFAULT_WORKSPACE, TorchAttention, attention_blocks, paged_attention
from specstep.engine.memory_probe import largest_steps, step_peak_bytes, warm_up
from specstep.engine.model_loader import load_model
from tests.helpers import make_checkpoint
from tests.memory_meter import LiveBytes

HEADS, KV_HEADS, D, PAGE = 6, 2, 16, 4
MiB = 1 << 20


def cache(pages: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(pages * PAGE, KV_HEADS, D, generator=g), torch.randn(pages * PAGE, KV_HEADS, D, generator=g))


def meta_for(q_lens, starts, tables):
    with mock.patch.object(batch_builder, "PAD_LIMIT", float("inf")):  # one padded batch, not split parts
        return batch_builder.build_forward_batch([[0] * q for q in q_lens], starts, tables, PAGE, "cpu").attn


def attend(q, kv, q_lens, starts, tables, workspace=DEFAULT_WORKSPACE, min_rows=None):
    rows = min_rows or measure_min_rows(HEADS // KV_HEADS, D, torch.float32)
    return paged_attention(q, *kv, meta_for(q_lens, starts, tables), HEADS, 0.25, workspace, rows)


def test_this_host_has_a_row_invariant_padding(monkeypatch):
    """If this fails, MKL here sums rows differently at every row count we can pad to: where the C++ kernel
    (`cpu_attention`) does not run either, the engine then falls back to SDPA and its ready line says it is not
    batch-invariant."""
    import specstep.engine.attention.torch_backend as tb

    monkeypatch.setattr(tb.kernel, "unavailable", lambda: "not here")  # the torch path's ready line
    rows = measure_min_rows(HEADS // KV_HEADS, D, torch.float32)
    assert rows is not None and 1 <= rows <= 2 * MAX_QUERY_ROWS
    att = TorchAttention(batch_invariant=True)
    assert att.min_rows(3, 64, torch.float32, torch.device("cpu")) is not None
    assert "batch-invariant (GEMMs padded to" in att.describe()


@pytest.mark.parametrize(("q_lens", "starts"), [([1] * 6, [3, 40, 77, 10, 0, 63]), ([5] * 4, [0, 21, 60, 33])])
def test_invariant_path_computes_what_sdpa_computes(q_lens, starts):
    kv = cache(60)
    tables, nxt = [], 1
    for s, q in zip(starts, q_lens):
        n = -(-(s + q) // PAGE)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    q = torch.randn(sum(q_lens), HEADS * D, generator=torch.Generator().manual_seed(1))
    sdpa = paged_attention(q, *kv, meta_for(q_lens, starts, tables), HEADS, 0.25)
    torch.testing.assert_close(attend(q, kv, q_lens, starts, tables), sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("workspace", [DEFAULT_WORKSPACE, 90_000], ids=["one_block", "lane_and_key_blocks"])
def test_a_verify_row_is_the_decode_row_whatever_shares_its_step(workspace):
    """5 verify rows from position 90 (page table with look-ahead, beside a lane 300 keys long) against the same
    rows decoded one at a time, alone; the small workspace attends in lane blocks and several key chunks."""
    kv = cache(120)
    mine, other = list(range(1, 30)), list(range(30, 110))
    q = torch.randn(6, HEADS * D, generator=torch.Generator().manual_seed(2))
    blk = attention_blocks(2, 5, len(mine) * PAGE, KV_HEADS, HEADS // KV_HEADS, D, 4, 4, PAGE, workspace, 10)
    if workspace != DEFAULT_WORKSPACE:
        assert blk.lanes == 1 and blk.keys < len(mine) * PAGE and blk.keys % KEY_BLOCK == 0
    verify = attend(q, kv, [5, 1], [90, 300], [mine, other], workspace)[:5]
    for i in range(5):
        alone = attend(q[i: i + 1], kv, [1], [90 + i], [mine[: -(-(91 + i) // PAGE)]], workspace)
        assert torch.equal(alone[0], verify[i]), i


@pytest.fixture(scope="module")
def long_context_target(tmp_path_factory):
    """A 32k context with grouped-query attention and head_dim 64, its attention batch-invariant."""
    folder = make_checkpoint(tmp_path_factory.mktemp("long") / "t", hidden_size=256, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=512, num_hidden_layers=2,
                             max_position_embeddings=32768)
    target = load_model(folder, "cpu", "float32", "onednn")
    target.attention = TorchAttention(batch_invariant=True)
    return target


def test_decode_at_batch_8_near_full_context_stays_within_the_estimate_and_the_workspace(long_context_target,
                                                                                         monkeypatch):
    """The torch-ops invariant path (the C++ kernel, where it runs, holds far less: a row's scores)."""
    import specstep.engine.attention.torch_backend as tb

    monkeypatch.setattr(tb.kernel, "runs", lambda *a: False)
    target, cfg = long_context_target, long_context_target.rank_cfg
    rows = target.attention.min_rows(cfg.num_heads // cfg.num_kv_heads, cfg.head_dim, torch.float32,
                                     torch.device("cpu"))
    decode, _ = largest_steps(8, 4, 32768, 32768 + 8, PAGE, 4096, 256)
    with torch.inference_mode(), LiveBytes() as meter:
        warm_up(target, decode, PAGE, torch.device("cpu"))
    estimate = step_peak_bytes(cfg, decode, 4, DEFAULT_WORKSPACE, rows)
    assert meter.peak <= estimate <= DEFAULT_WORKSPACE + 32 * MiB, (meter.peak, estimate)
    assert estimate <= 2 * meter.peak  # the estimate follows the peak, not the limits
