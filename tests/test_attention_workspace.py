"""The torch attention backend's memory follows its workspace, not max_batch_size x max_model_len.

A step that fits attends in one block, as before; a larger one in lane, query-row or key blocks (online
softmax), with the same result. The memory plan's estimate (`engine.memory_probe.step_peak_bytes`) follows the
new peak: measured here with the tensors' own sizes (`tests.memory_meter.LiveBytes`), never timed.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from specstep.engine import batch_builder
from specstep.engine.attention.torch_backend import (
    DEFAULT_WORKSPACE,
    TorchAttention,
    attention_blocks,
    paged_attention,
    whole_prompts,
)
from specstep.engine.memory_probe import largest_steps, measure_cpu, step_peak_bytes, warm_up
from specstep.engine.model_loader import load_model
from tests.helpers import make_checkpoint
from tests.memory_meter import LiveBytes

HEADS, KV_HEADS, D, PAGE = 6, 2, 16, 4
MiB = 1 << 20


def random_batch(q_lens, starts, seed=0):
    """Queries, a KV cache and the metadata of lanes with `q_lens` new tokens from `starts` (own pages each)."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-(s + q) // PAGE) for s, q in zip(starts, q_lens)]
    k_cache = torch.randn((sum(pages) + 1) * PAGE, KV_HEADS, D, generator=g)
    v_cache = torch.randn(k_cache.shape, generator=g)
    tables, nxt = [], 1  # page 0 is the dummy page
    for n in pages:
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    with mock.patch.object(batch_builder, "PAD_LIMIT", float("inf")):  # one padded batch, not split parts
        fb = batch_builder.build_forward_batch([[0] * q for q in q_lens], starts, tables, PAGE, "cpu")
    return torch.randn(sum(q_lens), HEADS * D, generator=g), k_cache, v_cache, fb.attn


def blocks_for(meta, workspace):
    b, qn = meta.q_index.shape
    return attention_blocks(b, qn, meta.keys, KV_HEADS, HEADS // KV_HEADS, D, 4, 4, PAGE, workspace)


# (q_lens, starts): decode, verify, a prompt; workspaces that force each way of cutting the attention.
# Query-row blocks happen where a lane's mask outweighs its keys: a long prompt (here past 128 rows of D = 16).
CASES = [([1] * 6, [3, 40, 77, 10, 0, 63]), ([5] * 4, [0, 21, 60, 33]), ([37], [50]), ([300], [9])]


@pytest.mark.parametrize(("q_lens", "starts"), CASES)
@pytest.mark.parametrize("regime", ["lanes", "rows", "keys"])
def test_blocked_attention_equals_one_block(q_lens, starts, regime):
    q, k_cache, v_cache, meta = random_batch(q_lens, starts)
    whole = blocks_for(meta, 1 << 40)
    per_key = 2 * KV_HEADS * D * 8
    workspace = {"lanes": whole.nbytes // 2, "rows": 2 * meta.keys * per_key, "keys": 40 * per_key}[regime]
    blk = blocks_for(meta, workspace)
    if regime == "lanes" and len(q_lens) > 1:
        assert blk.lanes < len(q_lens) and blk.keys == meta.keys
    if regime == "rows" and max(q_lens) > 128:
        assert blk.lanes == 1 and blk.rows < max(q_lens) and blk.keys == meta.keys
    if regime == "keys":
        assert blk.keys < meta.keys and blk.nbytes <= workspace
    ref = paged_attention(q, k_cache, v_cache, meta, HEADS, 0.25, 1 << 40)
    got = paged_attention(q, k_cache, v_cache, meta, HEADS, 0.25, workspace)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_step_that_fits_is_computed_exactly_as_one_sdpa():
    q, k_cache, v_cache, meta = random_batch(*CASES[1])
    assert blocks_for(meta, DEFAULT_WORKSPACE).whole(4, 5, meta.keys)
    assert torch.equal(TorchAttention().forward(q, k_cache, v_cache, meta, HEADS, 0.25),
                       paged_attention(q, k_cache, v_cache, meta, HEADS, 0.25, 1 << 40))


def reference_attention(q, k_cache, v_cache, meta, scale):
    """fp64 attention of every valid query row over the keys its position sees, from the pages directly."""
    b, qn = meta.q_index.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for lane in range(b):
        pages = meta.page_table[lane]
        slots = pages.repeat_interleave(PAGE) * PAGE + torch.arange(PAGE).repeat(len(pages))
        for i in range(qn):
            if not meta.q_valid[lane, i]:
                continue
            t, pos = int(meta.q_index[lane, i]), int(meta.q_pos[lane, i])
            k, v = k_cache[slots[: pos + 1]].double(), v_cache[slots[: pos + 1]].double()  # [keys, Hkv, D]
            for h in range(HEADS):
                qh = q[t, h * D:(h + 1) * D].double()
                p = torch.softmax((k[:, h // (HEADS // KV_HEADS)] @ qh) * scale, 0)
                out[t, h * D:(h + 1) * D] = p @ v[:, h // (HEADS // KV_HEADS)]
    return out


@pytest.mark.parametrize(("q_lens", "starts", "whole"), [([40, 40], [0, 0], True), ([300], [0], True),
                                                         ([37], [50], False), ([40, 30], [0, 0], False)])
def test_whole_prompts_attend_causally_and_others_by_mask(q_lens, starts, whole):
    """A batch of fresh prompts of one length takes causal SDPA (no mask built); a prompt after cached keys or
    lanes of other lengths take the masked path; both are the attention to fp32 rounding."""
    q, k_cache, v_cache, meta = random_batch(q_lens, starts)
    assert whole_prompts(meta) == whole
    got = paged_attention(q, k_cache, v_cache, meta, HEADS, 0.25, 1 << 40)
    rows = meta.q_index[meta.q_valid]
    torch.testing.assert_close(got[rows].double(), reference_attention(q, k_cache, v_cache, meta, 0.25)[rows],
                               rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def long_context_target(tmp_path_factory):
    """Random weights, a 32k context, grouped-query attention with head_dim 64 (its keys are what a long
    context makes large: 32 MiB of gathered K and V a lane a layer at the full length)."""
    folder = make_checkpoint(tmp_path_factory.mktemp("long") / "t", hidden_size=256, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=512, num_hidden_layers=2,
                             max_position_embeddings=32768)
    return load_model(folder, "cpu", "float32", "matmul")


def measured_peak(target, shape) -> int:
    with torch.inference_mode(), LiveBytes() as meter:
        warm_up(target, shape, PAGE, torch.device("cpu"))
    return meter.peak


def test_decode_at_batch_8_near_full_context_stays_within_the_estimate_and_the_workspace(long_context_target):
    """At batch 8 near 32k keys the old single gather held 8 lanes x 32 MiB at once; now at most the workspace."""
    target, cfg = long_context_target, long_context_target.rank_cfg
    decode, mixed = largest_steps(8, 4, 32768, 32768 + 8, PAGE, 4096, 256)
    peak = measured_peak(target, decode)
    estimate = step_peak_bytes(cfg, decode, 4)
    gathered = 8 * decode.width * 2 * cfg.kv_size * 4
    assert gathered > 2 * DEFAULT_WORKSPACE  # what one block would hold
    assert peak <= estimate <= DEFAULT_WORKSPACE + 32 * MiB, (peak, estimate)
    assert estimate <= 2 * peak  # the estimate follows the peak, not the limits


def test_the_cpu_plan_counts_the_largest_measured_step(long_context_target):
    """measure_cpu's activations cover the measured peak of every step shape the scheduler can form."""
    target = long_context_target
    shapes = largest_steps(8, 4, 32768, 32768 + 8, PAGE, 4096, 512)
    peaks = [measured_peak(target, s) for s in shapes]
    assert peaks[1] > peaks[0]  # the mixed step is the larger here: a min over shapes would undercount
    figures = measure_cpu(target, shapes, (target,), 8 << 30, None)
    assert max(peaks) <= figures.activations <= 2 * max(peaks), (peaks, figures.activations)
