"""Reference paged attention in plain torch: gather each request's pages, one masked SDPA for the batch.

One code path serves prefill (q = prompt), decode (q = 1) and verify (q = k + 1): they differ only in the
metadata (see `AttentionMetadata`). It is the numerical reference every other backend is checked against.
With `batch_invariant`, CPU steps of at most MAX_QUERY_ROWS positions (decode, verify, draft, refill) attend
batch-invariantly instead (the C++ kernel `cpu_attention`, else `invariant_attention`: a row's bits do not depend
on what shares its step, so speculative greedy output is plain greedy output bitwise). Prompts take the C++ kernel
too up to its prompt sizes (`cpu_attention.takes_prompt`), SDPA past them. A split forward (`SplitAttention`:
several prompts, a mixed step's decode rows beside chunks) attends each part exactly as it would attend alone, and
`attention_parts` puts a prompt-sized lane in a part with others only where that cannot change its bits (lanes of
its very shape, or a padded shape the C++ kernel takes, `prompts_join`): a prompt's bits never depend on what
shares its forward (int8 activations turn a rounding difference upstream into other tokens).

Every backend has the shape of `TorchAttention`: `plan(...)` takes a forward's host-known lengths before the
forward runs (this one needs none: its mask is derived on the device from the starts), and `forward(...)`
attends. A model holds one backend (`LlamaForCausalLM.attention`, `MTPHead.attention`) and hands it to its
layers; `AttentionMetadata.slot` names which plan a forward uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specstep.engine.attention import cpu_attention as kernel
from specstep.engine.attention.invariant_attention import (
    KEY_BLOCK,
    MAX_QUERY_ROWS,
    invariant_attention,
    invariant_bytes_per_key,
    measure_min_rows,
    padded_keys,
    padded_rows,
)
from specstep.engine.forward_batch import AttentionMetadata, SplitAttention


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write new keys/values in place (graph-safe: no reallocation of the cache)."""
    k_cache.index_copy_(0, slots, k.view(-1, *k_cache.shape[1:]).to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.view(-1, *v_cache.shape[1:]).to(v_cache.dtype))


# Bytes one layer's attention may hold at once beyond its queries and output (gathered keys and values, their
# cast, the mask block, scores where it computes them): a step's transient memory then follows this, not
# max_batch_size x max_model_len (at 64 lanes x 32k keys a single gather was 2 GiB a layer for a 0.5B model).
# Steps that fit attend in one block, exactly as before; larger ones in lane, query-row and key blocks.
DEFAULT_WORKSPACE = 128 << 20


@dataclass(frozen=True, slots=True)
class AttentionBlocks:
    """How a [lanes, rows, keys] attention is cut to fit a workspace; `nbytes`: one block's transient memory.

        lanes x rows x keys         when
        B     x Q    x K            everything fits: one SDPA (the common case)
        b<B   x Q    x K            one lane fits: SDPA per lane block
        1     x r<Q  x K            a lane's keys fit, its mask does not: SDPA per query-row block
        1     x r    x k<K          a lane's keys do not fit: online softmax over key blocks (log-sum-exp merge)
    """

    lanes: int
    rows: int
    keys: int  # a multiple of page_size unless it is K
    nbytes: int

    def whole(self, lanes: int, rows: int, keys: int) -> bool:
        return self.lanes >= lanes and self.rows >= rows and self.keys >= keys


def attention_blocks(lanes: int, rows: int, keys: int, kv_heads: int, group: int, head_dim: int, kv_elem: int,
                     q_elem: int, page_size: int, workspace: int = DEFAULT_WORKSPACE,
                     min_rows: int | None = None) -> AttentionBlocks:
    """The block shape `paged_attention` uses (and the memory plan counts: `engine.memory_probe`). `min_rows`:
    the batch-invariant path's row padding (None: SDPA only), which steps of few positions take."""
    if min_rows is not None and rows <= MAX_QUERY_ROWS:
        return invariant_blocks(lanes, rows, keys, kv_heads, group, head_dim, kv_elem, q_elem, workspace, min_rows)
    # A key costs its gathered K and V rows and one more copy of each (a cast to the query's dtype, or the
    # contiguous copy SDPA may make of the transposed gather); the mask a boolean per query row, and its copy
    # grouped for grouped-query attention.
    per_key = 2 * kv_heads * head_dim * (kv_elem + q_elem)
    mask_rows = rows * (1 + group) if group > 1 else rows
    lane = keys * (per_key + mask_rows)
    if lanes * lane <= workspace:
        return AttentionBlocks(lanes, rows, keys, lanes * lane)
    if lane <= workspace:
        n = workspace // lane
        return AttentionBlocks(n, rows, keys, n * lane)
    if keys * per_key <= workspace // 2:
        r = max(1, (workspace - keys * per_key) // ((1 + group) * keys))
        return AttentionBlocks(1, r, keys, keys * (per_key + (1 + group) * r))
    # Online softmax over key blocks: per key, its K and V with float32 copies, and per query row a mask byte
    # (and its grouped copy) and float32 scores and probabilities for every head. Rows shrink until a page fits.
    kv_part, row_part = 2 * kv_heads * head_dim * (kv_elem + 4), group * (2 + 8 * kv_heads)
    r = max(1, min(rows, 256, (workspace // page_size - kv_part) // row_part))
    per_key = kv_part + r * row_part
    k = max(page_size, workspace // per_key // page_size * page_size)
    return AttentionBlocks(1, r, k, k * per_key)


def invariant_blocks(lanes: int, rows: int, keys: int, kv_heads: int, group: int, head_dim: int, kv_elem: int,
                     q_elem: int, workspace: int, min_rows: int) -> AttentionBlocks:
    """Lanes a block and keys a chunk of the batch-invariant path. The chunk is sized for the most rows a step
    can have, so it is the same for every step of a model (where chunks merge must not follow the step)."""
    most = invariant_bytes_per_key(kv_heads, padded_rows(group * MAX_QUERY_ROWS, min_rows), head_dim, kv_elem, q_elem)
    chunk = max(KEY_BLOCK, workspace // most // KEY_BLOCK * KEY_BLOCK)
    keys = min(padded_keys(keys), chunk)
    lane = keys * invariant_bytes_per_key(kv_heads, padded_rows(group * rows, min_rows), head_dim, kv_elem, q_elem)
    n = max(1, min(lanes, workspace // lane))
    return AttentionBlocks(n, rows, keys, n * lane)


def _gather(cache: torch.Tensor, page_table: torch.Tensor, page_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[b, P] pages -> [b, Hkv, P * page_size, D]. Whole pages (page_size x Hkv x D contiguous values each): 1.7x
    faster than slot rows on CPU; index_select, since advanced indexing runs several times slower there."""
    b, p = page_table.shape
    _, hkv, d = cache.shape
    rows = cache.view(-1, page_size, hkv, d).index_select(0, page_table.reshape(-1))
    return rows.view(b, p * page_size, hkv, d).transpose(1, 2).to(dtype)


def _online_attention(qb: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      b0: int, i0: int, i1: int, group: int, block_pages: int, scale: float) -> torch.Tensor:
    """Lane b0's query rows [i0, i1) over its keys, `block_pages` pages at a time, in float32:
        m = running row max, l = running sum of exp(s - m), acc = running sum of exp(s - m) v;
        each block rescales them by exp(m_old - m_new). A row that has seen no key yet keeps m = -inf (its
        exponentials are taken against 0 instead, so no NaN); every row sees key 0 at least (padding rows too)."""
    ps, pages = meta.page_size, meta.page_table.shape[1]
    qf = qb.float()
    m = qf.new_full((*qf.shape[:-1], 1), float("-inf"))
    lsum = qf.new_zeros(m.shape)
    acc = torch.zeros_like(qf)
    for p0 in range(0, pages, block_pages):
        p1 = min(pages, p0 + block_pages)
        table = meta.page_table[b0:b0 + 1, p0:p1]
        kb, vb = _gather(k_cache, table, ps, torch.float32), _gather(v_cache, table, ps, torch.float32)
        s = torch.matmul(qf, kb.transpose(-1, -2)).mul_(scale)
        s.masked_fill_(~meta.mask_block(b0, b0 + 1, i0, i1, p0 * ps, p1 * ps, group, cache=False), float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        base = m_new.masked_fill(m_new == float("-inf"), 0.0)
        s = s.sub_(base).exp_()
        corr = (m - base).exp_()
        lsum = lsum.mul_(corr).add_(s.sum(-1, keepdim=True))
        acc = acc.mul_(corr).add_(torch.matmul(s, vb))
        m = m_new
    return acc.div_(lsum).to(qb.dtype)


def paged_attention(
    q: torch.Tensor,  # [T, H * D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    num_heads: int,
    scale: float,
    workspace: int = DEFAULT_WORKSPACE,
    min_rows: int | None = None,
) -> torch.Tensor:
    """`min_rows`: attend steps of few positions batch-invariantly with this row padding (None: SDPA)."""
    t = q.shape[0]
    _, hkv, d = k_cache.shape
    group = num_heads // hkv
    b, qn = meta.q_index.shape
    keys, ps = meta.keys, meta.page_size
    if qn > MAX_QUERY_ROWS and whole_prompts(meta):  # prompt-sized: never a captured step (it reads the host)
        return _causal_prompts(q, k_cache, v_cache, meta, num_heads, scale)
    qp = q.view(t, hkv, group, d)
    if not meta.dense:
        qp = qp.index_select(0, meta.q_index.view(-1))
    # Query heads h = kv_head * group + g (the layout Hugging Face's repeat_kv implies).
    qp = qp.view(b, qn, hkv, group, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, Q, D]
    blk = attention_blocks(b, qn, keys, hkv, group, d, k_cache.element_size(), q.element_size(), ps, workspace,
                           min_rows)
    if min_rows is not None and qn <= MAX_QUERY_ROWS:
        o = invariant_attention(qp, k_cache, v_cache, meta, scale, min_rows, blk.lanes, blk.keys)
    elif blk.whole(b, qn, keys):
        o = F.scaled_dot_product_attention(qp.reshape(b, hkv, group * qn, d), _gather(k_cache, meta.page_table, ps,
                                           q.dtype), _gather(v_cache, meta.page_table, ps, q.dtype),
                                           attn_mask=meta.mask_block(0, b, 0, qn, 0, keys, group), scale=scale)
        o = o.view(b, hkv, group, qn, d)
    else:
        o = qp.new_empty(b, hkv, group, qn, d)
        for b0 in range(0, b, blk.lanes):
            b1 = min(b, b0 + blk.lanes)
            kb = vb = None
            for i0 in range(0, qn, blk.rows):
                i1 = min(qn, i0 + blk.rows)
                qb = qp[b0:b1, :, :, i0:i1].reshape(b1 - b0, hkv, group * (i1 - i0), d)
                if blk.keys < keys:
                    ob = _online_attention(qb, k_cache, v_cache, meta, b0, i0, i1, group, blk.keys // ps, scale)
                else:
                    if kb is None:  # a lane block's keys serve all its query-row blocks
                        kb = _gather(k_cache, meta.page_table[b0:b1], ps, q.dtype)
                        vb = _gather(v_cache, meta.page_table[b0:b1], ps, q.dtype)
                    mask = meta.mask_block(b0, b1, i0, i1, 0, keys, group, cache=False)
                    ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
                o[b0:b1, :, :, i0:i1] = ob.view(b1 - b0, hkv, group, i1 - i0, d)
    o = o.permute(0, 3, 1, 2, 4).reshape(b * qn, num_heads * d)
    return o if meta.dense else o.index_select(0, meta.out_index)


def whole_prompts(meta: AttentionMetadata) -> bool:
    """Whether every lane of this (dense) forward is a whole prompt of the same length: queries at positions 0 to
    Q - 1 over exactly those keys, so causal attention is the mask (a batch of fresh prompts, the common prefill).
    Once per forward (every layer shares the answer). It reads the metadata on the host: asked only of forwards
    of more than MAX_QUERY_ROWS positions a lane, which no captured graph holds."""
    key = ("whole_prompts",)
    if key not in meta._blocks:
        qn = meta.q_index.shape[1]
        meta._blocks[key] = (meta.dense and qn > 1 and meta.keys >= qn and bool(meta.q_valid.all())
                             and bool((meta.kv_len == qn).all()))
    return meta._blocks[key]


def _causal_prompts(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    num_heads: int, scale: float) -> torch.Tensor:
    """`whole_prompts` forwards: SDPA with is_causal over each lane's own keys, every query head beside its KV
    head's keys: no [Q, K] mask built or read, and the kernel skips the key blocks above the diagonal."""
    b, qn = meta.q_index.shape
    _, hkv, d = k_cache.shape
    group = num_heads // hkv
    k, v = (_gather(c, meta.page_table, meta.page_size, q.dtype)[:, :, :qn] for c in (k_cache, v_cache))
    if group > 1:  # query head h = kv_head * group + g
        k, v = (t.unsqueeze(2).expand(b, hkv, group, qn, d).reshape(b, num_heads, qn, d) for t in (k, v))
    o = F.scaled_dot_product_attention(q.view(b, qn, num_heads, d).transpose(1, 2), k, v, is_causal=True,
                                       scale=scale)
    return o.transpose(1, 2).reshape(b * qn, num_heads * d)


PROMPT_SLOT = "prefill"  # the plan of whole prefills and mixed steps (`StepEngine.prefill`)


def _kernel_takes(meta: AttentionMetadata, num_heads: int, k_cache: torch.Tensor) -> bool:
    """Whether the C++ kernel takes this forward's shape: a step of few positions a lane, or a prompt of its sizes
    (`cpu_attention.takes_prompt`). Shapes only: no host read."""
    qn = meta.q_index.shape[1]
    return qn <= MAX_QUERY_ROWS or kernel.takes_prompt(qn, meta.keys, num_heads // k_cache.shape[1])


class TorchAttention:
    """The reference backend (CPU and CUDA): nothing to plan; every length comes from the device metadata.
    `workspace`: bytes a layer's attention may hold at once (see `DEFAULT_WORKSPACE`). `batch_invariant` (the
    engine's CPU default, `engine.model_loader.use_cpu_kernels`): on CPU, attend steps of few positions so that a
    row's bits do not depend on the step (`invariant_attention`); where this CPU's GEMMs allow no row padding
    for it (`measure_min_rows`), SDPA, and `describe` says so."""

    name = "torch"
    needs_plan = False

    def __init__(self, workspace: int = DEFAULT_WORKSPACE, batch_invariant: bool = False,
                 kernel_group: int | None = None) -> None:
        self.workspace = workspace
        self.batch_invariant = batch_invariant
        # The model's query heads a KV head where its prompts may take the C++ kernel (batch-invariant, CPU, fp32
        # activations: `prompts_join`); None: they never do
        self.kernel_group = kernel_group
        self._min_rows: dict[tuple, int | None] = {}  # measured once per (group, head_dim, dtype)

    def prompts_join(self, rows: int, keys: int) -> bool:
        """Whether prompt-sized requests padded to `rows` positions over `keys` keys may attend as one part
        (`batch_builder.attention_parts`): the C++ kernel takes that shape, and it attends each lane as it would
        alone. Elsewhere (SDPA) a lane's bits would depend on its company's padding: each attends apart."""
        return (self.batch_invariant and self.kernel_group is not None and not kernel.unavailable()
                and kernel.takes_prompt(rows, keys, self.kernel_group))

    def min_rows(self, group: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> int | None:
        """The invariant path's row padding for this shape, or None where it does not run (CUDA, off, or no
        padding makes this CPU's GEMMs row-invariant)."""
        if not self.batch_invariant or device.type != "cpu":
            return None
        key = (group, head_dim, dtype)
        if key not in self._min_rows:
            self._min_rows[key] = measure_min_rows(group, head_dim, dtype)
        return self._min_rows[key]

    def describe(self) -> str:
        """For the ready line: how steps of few positions attend."""
        if not self.batch_invariant:
            return "attention: SDPA (batch invariance off)"
        if not kernel.unavailable():
            return (f"attention: batch-invariant C++ kernel for fp32 steps of <= {MAX_QUERY_ROWS} positions "
                    f"and prompts of <= {kernel.PROMPT_ROWS} (longer: SDPA)")
        if not self._min_rows:
            return "attention: batch-invariant on CPU"
        found = sorted({r for r in self._min_rows.values() if r is not None})
        if None in self._min_rows.values():
            return "attention: SDPA, not batch-invariant (no row padding makes this CPU's GEMMs row-invariant)"
        return f"attention: batch-invariant (GEMMs padded to >= {found[0]} rows, {KEY_BLOCK}-key blocks)"

    def plan(self, slot: str, q_lens: np.ndarray, kv_lens: np.ndarray, page_tables: np.ndarray,
             lanes: int | None = None, stream: torch.cuda.Stream | None = None) -> None:
        pass

    def plan_padding(self, slot: str, lanes: int, q: int, stream: torch.cuda.Stream | None = None) -> None:
        pass

    def runs_kernel(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata | SplitAttention,
                    num_heads: int) -> bool:
        """Whether `forward` would attend this whole step in the C++ kernel (`cpu_attention`): batch-invariant
        CPU fp32 steps of at most MAX_QUERY_ROWS positions a lane, or prompts it takes (`takes_prompt`), not
        split."""
        return (self.batch_invariant and isinstance(meta, AttentionMetadata) and kernel.runs(q, k_cache)
                and _kernel_takes(meta, num_heads, k_cache))

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata | SplitAttention, num_heads: int, scale: float) -> torch.Tensor:
        if self.batch_invariant and kernel.runs(q, k_cache):  # the C++ kernel: no row padding
            return self._forward(q, k_cache, v_cache, meta, num_heads, scale, None, True)
        rows = self.min_rows(num_heads // k_cache.shape[1], k_cache.shape[-1], q.dtype, q.device)
        return self._forward(q, k_cache, v_cache, meta, num_heads, scale, rows, False)

    def _forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata | SplitAttention, num_heads: int, scale: float, rows: int | None,
                 use_kernel: bool) -> torch.Tensor:
        """`rows` / `use_kernel`: how steps of few positions attend batch-invariantly (`paged_attention`)."""
        if isinstance(meta, SplitAttention):  # each part as it would attend alone
            out = q.new_empty(q.shape[0], num_heads * k_cache.shape[-1])
            for t0, t1, part in meta.parts:
                out[t0:t1] = self._attend(q[t0:t1], k_cache, v_cache, part, num_heads, scale, rows, use_kernel)
            return out
        return self._attend(q, k_cache, v_cache, meta, num_heads, scale, rows, use_kernel)

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                num_heads: int, scale: float, rows: int | None, use_kernel: bool) -> torch.Tensor:
        """`use_kernel`: steps of few positions, and prompts the kernel takes (`cpu_attention.takes_prompt`), in the
        C++ kernel (`cpu_attention`: batch-invariant by construction); everything else in `paged_attention`."""
        if use_kernel and _kernel_takes(meta, num_heads, k_cache):
            return kernel.cpu_attention(q, k_cache, v_cache, meta, num_heads, scale)
        return paged_attention(q, k_cache, v_cache, meta, num_heads, scale, self.workspace, rows)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Training path: [B, H, S, D] queries over [B, Hkv, S, D] keys, causal, no cache."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
