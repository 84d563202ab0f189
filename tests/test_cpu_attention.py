"""The C++ attention kernel (`engine/kernels/cpu_attention.cpp`): SDPA's results to fp32 rounding on ragged
paged batches, and every row's bits independent of the lanes and rows beside it, the page table's width and the
threads; in both of its forms (AVX2, and AVX-512 for heads of 64 and 128 where the host has it)."""

from __future__ import annotations

import pytest
import torch

import specstep.engine.batch_builder as bb
from specstep.engine.attention import cpu_attention as kernel
from specstep.engine.attention.torch_backend import TorchAttention

pytestmark = pytest.mark.skipif(bool(kernel.unavailable()), reason=f"kernel unavailable: {kernel.unavailable()}")

HEADS, KV_HEADS, D, PAGE = 9, 3, 64, 16


def _use_avx512(on: bool) -> bool:
    return bool(kernel._build()[0].cpu_attention_use_avx512(int(on)))


@pytest.fixture(params=["avx2", "avx512"], autouse=True)
def form(request):
    """Every test here runs on each form of the kernel this host can run (the host's default restored after)."""
    if request.param == "avx512" and not _use_avx512(True):
        pytest.skip("no AVX-512 on this host")
    _use_avx512(request.param == "avx512")
    yield request.param
    _use_avx512(True)


def paged(q_lens, starts, seed=0, spare_pages=0, kv_heads=KV_HEADS, heads=HEADS, d=D):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-(s + q) // PAGE) + spare_pages for s, q in zip(starts, q_lens)]
    k_cache = torch.randn((sum(pages) + 1) * PAGE, kv_heads, d, generator=g)
    v_cache = torch.randn_like(k_cache)
    tables, nxt = [], 1
    for n in pages:
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    q = torch.randn(sum(q_lens), heads * d, generator=g)
    return q, k_cache, v_cache, tables


# SmolLM2's heads; 128-wide heads in groups of 7 (the AVX-512 form's values take 5 and then 2 heads of 64, 2 at
# a time of 128); one query head a KV head
SHAPES = [(9, 3, 64), (14, 2, 128), (7, 1, 64), (4, 4, 128), (6, 2, 32)]


@pytest.mark.parametrize("heads, kv_heads, d", SHAPES)
def test_kernel_is_sdpa_to_fp32_rounding(heads, kv_heads, d):
    q_lens, starts = [5, 1, 17, 3], [60, 17, 300, 0]
    q, kc, vc, tables = paged(q_lens, starts, kv_heads=kv_heads, heads=heads, d=d)
    fb = bb.build_forward_batch([[0] * n for n in q_lens], starts, tables, PAGE, "cpu")
    scale = d ** -0.5
    got = TorchAttention(batch_invariant=True).forward(q, kc, vc, fb.attn, heads, scale)  # ragged: in parts
    ref = TorchAttention().forward(q, kc, vc, fb.attn, heads, scale)  # SDPA
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6)


def test_the_two_forms_agree_to_fp32_rounding(form):
    if form == "avx2" or not _use_avx512(True):
        pytest.skip("compared once, where both forms run")
    q_lens, starts = [5, 1, 3], [60, 17, 200]
    q, kc, vc, tables = paged(q_lens, starts, seed=2)
    fb = bb.build_forward_batch([[0] * n for n in q_lens], starts, tables, PAGE, "cpu")
    attend = TorchAttention(batch_invariant=True)  # ragged: in parts
    wide = attend.forward(q, kc, vc, fb.attn, HEADS, 0.125)
    _use_avx512(False)
    narrow = attend.forward(q, kc, vc, fb.attn, HEADS, 0.125)
    assert not torch.equal(wide, narrow)  # two forms ran
    torch.testing.assert_close(wide, narrow, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("heads, kv_heads, d", SHAPES)
def test_a_rows_bits_do_not_depend_on_its_step(monkeypatch, heads, kv_heads, d):
    """A lane's rows alone, with a longer page table, beside other lanes, and on 1 or 2 threads: the same bits;
    a verify step's row i equals the decode step at that position."""
    q_lens, starts = [5, 3, 4], [60, 17, 200]
    q, kc, vc, tables = paged(q_lens, starts, seed=1, spare_pages=2, kv_heads=kv_heads, heads=heads, d=d)
    monkeypatch.setattr(bb, "PAD_LIMIT", float("inf"))
    fb = bb.build_forward_batch([[0] * n for n in q_lens], starts, tables, PAGE, "cpu")
    assert not hasattr(fb.attn, "parts")  # one padded batch: every lane beside the others
    batch = {th: kernel.cpu_attention(q, kc, vc, fb.attn, heads, 0.125, threads=th) for th in (1, 2)}
    assert torch.equal(batch[1], batch[2])
    alone = bb.build_forward_batch([[0] * 5], [60], [tables[0][:-2]], PAGE, "cpu")  # the table without spares
    assert torch.equal(kernel.cpu_attention(q[:5], kc, vc, alone.attn, heads, 0.125), batch[1][:5])
    for i in range(5):  # row i of the verify step = a decode step at position 60 + i over the same cache
        one = bb.build_forward_batch([[0]], [60 + i], [tables[0]], PAGE, "cpu")
        assert torch.equal(kernel.cpu_attention(q[i: i + 1], kc, vc, one.attn, heads, 0.125), batch[1][i: i + 1])


@pytest.mark.parametrize(("q_lens", "starts"), [([40, 40], [0, 0]), ([37], [50]), ([40, 23], [0, 9])])
def test_prompts_take_the_kernel_and_their_rows_are_decode_steps_bits(monkeypatch, q_lens, starts):
    """Forwards of more positions than a verify step's, up to PROMPT_ROWS (fresh prompts, a prompt after cached
    keys, ragged lanes), attend in the kernel, not SDPA: SDPA's results to fp32 rounding, and each prompt row the
    bits of a decode step at its position over the same cache. Past PROMPT_ROWS, SDPA."""
    q, kc, vc, tables = paged(q_lens, starts, seed=3)
    monkeypatch.setattr(bb, "PAD_LIMIT", float("inf"))  # one forward (split ones attend part by part)
    fb = bb.build_forward_batch([[0] * n for n in q_lens], starts, tables, PAGE, "cpu")
    calls = []
    real = kernel.cpu_attention
    monkeypatch.setattr(kernel, "cpu_attention", lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
    attend = TorchAttention(batch_invariant=True)
    got = attend.forward(q, kc, vc, fb.attn, HEADS, 0.125)
    assert calls == [fb.attn]
    for threads in (1, 2, 3):  # the threads' shares of the causal rows (split by their keys) change no bits
        assert torch.equal(real(q, kc, vc, fb.attn, HEADS, 0.125, threads=threads), got)
    torch.testing.assert_close(got, TorchAttention().forward(q, kc, vc, fb.attn, HEADS, 0.125), rtol=1e-5, atol=2e-6)
    t = 0
    for lane, (n, s) in enumerate(zip(q_lens, starts)):
        for i in range(0, n, 7):  # every 7th row of each lane: a decode step at its position
            one = bb.build_forward_batch([[0]], [s + i], [tables[lane]], PAGE, "cpu")
            assert torch.equal(real(q[t + i: t + i + 1], kc, vc, one.attn, HEADS, 0.125), got[t + i: t + i + 1])
        t += n
    monkeypatch.setattr(kernel, "PROMPT_ROWS", min(q_lens) - 1)
    calls.clear()
    sdpa = attend.forward(q, kc, vc, fb.attn, HEADS, 0.125)
    assert calls == [] and torch.equal(sdpa, TorchAttention().forward(q, kc, vc, fb.attn, HEADS, 0.125))


def test_a_prompt_whose_scores_would_pass_the_bound_takes_sdpa(monkeypatch):
    assert kernel.takes_prompt(kernel.PROMPT_ROWS, 1000, 3)
    assert not kernel.takes_prompt(kernel.PROMPT_ROWS + 1, 1000, 3)
    assert not kernel.takes_prompt(kernel.PROMPT_ROWS, kernel.PROMPT_SCORES // (3 * kernel.PROMPT_ROWS), 3)
    q, kc, vc, tables = paged([40], [0], seed=4)
    fb = bb.build_forward_batch([[0] * 40], [0], tables, PAGE, "cpu")
    attend = TorchAttention(batch_invariant=True)
    assert attend.runs_kernel(q, kc, fb.attn, HEADS)
    monkeypatch.setattr(kernel, "PROMPT_SCORES", (HEADS // KV_HEADS) * 40 * (fb.attn.keys + kernel.SCORE_PAD) - 1)
    assert not attend.runs_kernel(q, kc, fb.attn, HEADS)
    monkeypatch.setattr(kernel, "cpu_attention", lambda *a, **kw: pytest.fail("the kernel ran past its bound"))
    assert torch.equal(attend.forward(q, kc, vc, fb.attn, HEADS, 0.125),
                       TorchAttention().forward(q, kc, vc, fb.attn, HEADS, 0.125))


@pytest.mark.parametrize("heads, kv_heads, d", SHAPES)
def test_a_bf16_cache_gives_the_bits_of_its_values_in_fp32(monkeypatch, heads, kv_heads, d):
    """`--kv-cache-dtype bfloat16`: the kernel widens each cached bf16 to fp32 (exact) and runs the fp32 cache's
    arithmetic, so its output is bitwise the fp32 cache's holding the same values; decode and prompt rows alike."""
    monkeypatch.setattr(bb, "PAD_LIMIT", float("inf"))  # one call for the ragged lanes
    q_lens, starts = [5, 1, 17, 40], [60, 17, 300, 0]
    q, kc, vc, tables = paged(q_lens, starts, seed=4, kv_heads=kv_heads, heads=heads, d=d)
    kb, vb = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    for lens, st in ((q_lens[:3], starts[:3]), (q_lens[3:], starts[3:])):  # steps of few rows; a prompt
        lanes = tables[:3] if len(lens) == 3 else tables[3:]
        first = 0 if len(lens) == 3 else sum(q_lens[:3])
        rows = q[first:first + sum(lens)]
        fb = bb.build_forward_batch([[0] * n for n in lens], st, lanes, PAGE, "cpu")
        got = kernel.cpu_attention(rows, kb, vb, fb.attn, heads, d ** -0.5)
        assert torch.equal(got, kernel.cpu_attention(rows, kb.float(), vb.float(), fb.attn, heads, d ** -0.5))
        # and it read the bf16 values, not fp32 ones
        assert not torch.equal(got, kernel.cpu_attention(rows, kc, vc, fb.attn, heads, d ** -0.5))


def test_a_bf16_cache_takes_the_kernel_through_the_backend(monkeypatch):
    q_lens, starts = [5, 1], [60, 17]
    q, kc, vc, tables = paged(q_lens, starts, seed=5)
    kb, vb = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    fb = bb.build_forward_batch([[0] * n for n in q_lens], starts, tables, PAGE, "cpu")
    attend = TorchAttention(batch_invariant=True)
    assert attend.runs_kernel(q, kb, fb.attn, HEADS)
    got = attend.forward(q, kb, vb, fb.attn, HEADS, 0.125)
    assert torch.equal(got, attend.forward(q, kb.float(), vb.float(), fb.attn, HEADS, 0.125))
    # SDPA over the same bf16 cache (gathered to fp32) agrees to fp32 rounding
    torch.testing.assert_close(got, TorchAttention().forward(q, kb, vb, fb.attn, HEADS, 0.125), rtol=1e-5,
                               atol=2e-6)
    with pytest.raises(kernel.AttentionKernelError, match="one dtype"):
        kernel.cpu_attention(q, kb, vc, fb.attn, HEADS, 0.125)
