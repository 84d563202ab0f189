"""Batch-invariant paged attention on CPU: a query row's output is bitwise the same whatever shares its step.

Why: greedy speculation equals plain greedy decoding bitwise only if a verify row computes exactly what the
plain decode step at that position computes. SDPA's CPU kernel does not: it cuts queries and keys into blocks
whose sizes follow the step's shape, and MKL's GEMM sums a row differently by the number of rows (below about
12 rows it takes other kernels, and the last rows of a tile are summed apart): measured, 2-8 of a verify
block's q rows differ from the same rows attended alone.

So every GEMM here has a shape that does not depend on the step, except a row count that MKL is measured to
ignore (`measure_min_rows`):

    per (kv head, lane): rows = the group's query heads x the step's query positions, zero-padded to at least
                         `min_rows` (measured per host: from there every row count and row index sums alike);
    keys in blocks of KEY_BLOCK: scores [rows, D] @ [D, KEY_BLOCK] and P @ V [rows, KEY_BLOCK] @ [KEY_BLOCK, D]
                         per block, so no GEMM's n or k follows the number of keys;
    softmax: the row max over all blocks (exact in any order), exp, sums within a block (a fixed length), and
                         the blocks' sums and P @ V partials added up in key order (`cumsum`: sequential, in
                         float64). A key past a row's last adds an exact zero, so a longer page table (a verify
                         step's look-ahead, another lane's length) changes nothing.

Long contexts attend in fixed key chunks of `key_chunk` keys merged in order (online softmax); a chunk a row
cannot see is an exact no-op. The chunk is fixed per backend, never per step, or decode and verify would merge
in different places. Lanes are attended in blocks that fit the workspace (any block size gives the same bits).
Steps of more than MAX_QUERY_ROWS positions (prompts) take the C++ kernel or SDPA: see `TorchAttention`.
"""

from __future__ import annotations

import torch

from specstep.engine.forward_batch import AttentionMetadata

KEY_BLOCK = 64  # a multiple of 64: elementwise kernels then never reach their scalar tails (AVX-512: 32 floats)
MAX_QUERY_ROWS = 17  # the most query positions of a decode, verify (k <= 16), draft or refill step
NEG_INF = float("-inf")


def padded_keys(keys: int) -> int:
    return -(-keys // KEY_BLOCK) * KEY_BLOCK


def padded_rows(rows: int, min_rows: int) -> int:
    return max(rows, min_rows)


def _scores(qb: torch.Tensor, kb: torch.Tensor) -> torch.Tensor:
    """[N, R, D] x [N, KEY_BLOCK, D] -> [N, R, KEY_BLOCK]; the probe calls exactly this."""
    return torch.bmm(qb, kb.transpose(1, 2))


def _pv(p: torch.Tensor, vb: torch.Tensor) -> torch.Tensor:
    """[N, R, KEY_BLOCK] x [N, KEY_BLOCK, D] -> [N, R, D]."""
    return torch.bmm(p, vb)


def measure_min_rows(group: int, head_dim: int, dtype: torch.dtype) -> int | None:
    """The fewest rows from which both GEMMs give every row the same bits whatever the row count (up to a verify
    step's), the row's index and the number of matrices; None if none does (then attention is not invariant).

    GEMM kernels do not branch on values, so random data decides it for these shapes: each size is checked with
    the rows shuffled against the full-size product, at 1 to 3 matrices."""
    rmax = group * MAX_QUERY_ROWS
    g = torch.Generator().manual_seed(0)
    xq = torch.randn(rmax, head_dim, generator=g).to(dtype)
    xp = torch.rand(rmax, KEY_BLOCK, generator=g).to(dtype)
    kb = torch.randn(3, KEY_BLOCK, head_dim, generator=g).to(dtype)
    vb = torch.randn(3, KEY_BLOCK, head_dim, generator=g).to(dtype)
    with torch.inference_mode():
        ref_s = _scores(xq.expand(3, -1, -1).contiguous(), kb)
        ref_o = _pv(xp.expand(3, -1, -1).contiguous(), vb)
        agree = []
        for m in range(1, rmax + 1):
            rows, n = torch.randperm(rmax, generator=g)[:m], 1 + m % 3
            s = _scores(xq[rows].expand(n, -1, -1).contiguous(), kb[:n])
            o = _pv(xp[rows].expand(n, -1, -1).contiguous(), vb[:n])
            agree.append(torch.equal(s, ref_s[:n, rows]) and torch.equal(o, ref_o[:n, rows]))
    if not agree[-1]:
        return None
    low = rmax
    while low > 1 and agree[low - 2]:
        low -= 1
    return low


def invariant_bytes_per_key(kv_heads: int, rows: int, head_dim: int, kv_elem: int, q_elem: int) -> int:
    """A lane's transient memory per key at `rows` padded rows: gathered K and V (and their cast) with their row
    indices, the mask, the scores (exponentiated in place), and per key block the repeated queries and the
    P @ V partials with their running sums."""
    kv = 2 * kv_heads * head_dim * (kv_elem + q_elem) + 8 * kv_heads
    per_block = 3 * kv_heads * rows * head_dim * q_elem
    return kv + rows + kv_heads * rows * q_elem + -(-per_block // KEY_BLOCK)


def _cached(meta: AttentionMetadata, key: tuple, cache: bool, make):
    """Blocks of a step attended in one piece are shared by every layer of its forward; a workspace-bound
    step's are made per block and dropped, or together they would hold the whole step again."""
    if not cache:
        return make()
    if key not in meta._blocks:
        meta._blocks[key] = make()
    return meta._blocks[key]


def _gather_rows(meta: AttentionMetadata, kv_heads: int, b0: int, b1: int, k0: int, k1: int) -> torch.Tensor:
    """[Hkv * (b1 - b0) * (k1 - k0)] row indices into the cache viewed as [slots * Hkv, D] (slot * Hkv + head),
    in the [head, lane, key] order the GEMMs batch over: one gather lays keys out for them. Keys past the page
    table read slot 0 (the dummy page; masked)."""
    ps, width = meta.page_size, meta.page_table.shape[1]
    kpos = torch.arange(k0, k1, device=meta.page_table.device)
    pages = meta.page_table[b0:b1].index_select(1, (kpos // ps).clamp_max(width - 1))
    slots = (pages * ps + kpos % ps) * (kpos < width * ps)  # no torch.where(..., 0): no host scalar tensor
    heads = torch.arange(kv_heads, device=slots.device).view(-1, 1, 1)
    return (slots.unsqueeze(0) * kv_heads + heads).view(-1)


def _masked_out(meta: AttentionMetadata, group: int, rows: int, b0: int, b1: int, k0: int, k1: int) -> torch.Tensor:
    """[1, b1 - b0, (k1 - k0) / KEY_BLOCK, rows, KEY_BLOCK] bool, True where a row must not see a key (rows
    g * Q + i; padding rows beyond group * Q, like padding query positions, see key 0 only)."""
    qn = meta.q_pos.shape[1]
    kpos = torch.arange(k0, k1, device=meta.kv_len.device)
    q_pos, q_valid = meta.q_pos[b0:b1], meta.q_valid[b0:b1]
    see = (kpos <= q_pos.unsqueeze(-1)) & (kpos < meta.kv_len[b0:b1].view(-1, 1, 1)) & q_valid.unsqueeze(-1)
    if k0 == 0:
        see[:, :, 0] |= ~q_valid
    b, keys = b1 - b0, k1 - k0
    see = see.unsqueeze(1).expand(b, group, qn, keys).reshape(b, group * qn, keys)
    if rows > group * qn:
        see = torch.cat([see, (kpos == 0).expand(b, rows - group * qn, keys)], dim=1)
    return (~see).view(b, rows, keys // KEY_BLOCK, KEY_BLOCK).transpose(1, 2).contiguous().unsqueeze(0)


def _write(dst: torch.Tensor, op, a: torch.Tensor, b) -> None:
    """dst = op(a, b) in one kernel (`out=`), or two where autograd records it (`out=` has no backward: a
    tensor-parallel follower runs its MTP head outside inference mode)."""
    if torch.is_grad_enabled() and a.requires_grad:
        dst.copy_(op(a, b))
    else:
        op(a, b, out=dst)


def _attend_chunk(qv: torch.Tensor, scale: float, r: int, k_flat: torch.Tensor, v_flat: torch.Tensor,
                  rows_idx: torch.Tensor, masked: torch.Tensor, several: bool):
    """One lane block (`qv` [Hkv, b, G, Q, D]) over one key chunk: (row max, softmax denominator, P @ V) at `r`
    padded rows, [Hkv, b, r] / [Hkv, b, r, D]. `several`: the step has other chunks, so a row may see none of
    this one's keys (its max is -inf). Few ops: at decode sizes each costs more than its arithmetic."""
    hkv, b, group, qn, d = qv.shape
    nb = masked.shape[2]
    kb = k_flat.index_select(0, rows_idx).view(hkv * b * nb, KEY_BLOCK, d).to(qv.dtype)
    vb = v_flat.index_select(0, rows_idx).view(hkv * b * nb, KEY_BLOCK, d).to(qv.dtype)
    # The scaled queries repeated for every key block, zero rows as padding, in one write.
    qb = (qv.new_zeros if r > group * qn else qv.new_empty)(hkv * b * nb, r, d)
    _write(qb.view(hkv, b, nb, r, d)[:, :, :, : group * qn].view(hkv, b, nb, group, qn, d), torch.mul,
           qv.unsqueeze(2).expand(hkv, b, nb, group, qn, d), scale)
    s = _scores(qb, kb).view(hkv, b, nb, r, KEY_BLOCK).masked_fill_(masked, NEG_INF)
    m = s.amax(dim=(2, 4), keepdim=True)
    base = m.masked_fill(m == NEG_INF, 0.0) if several else m  # a row that sees nothing here: exp(-inf) = 0
    p = s.sub_(base).exp_()
    lsum = p.sum(-1)  # [Hkv, b, nb, r]: a fixed-length sum per block
    o = _pv(p.view(hkv * b * nb, r, KEY_BLOCK), vb).view(hkv, b, nb, r, d)
    if nb > 1:  # the blocks in key order; one block needs no sum (float32 -> float64 -> float32 is exact)
        lsum, o = lsum.cumsum(2).select(2, nb - 1), o.cumsum(2).select(2, nb - 1)
    else:
        lsum, o = lsum.select(2, 0), o.select(2, 0)
    return m.view(hkv, b, r), lsum, o


def invariant_attention(qp: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, min_rows: int, lanes: int, key_chunk: int) -> torch.Tensor:
    """qp [B, Hkv, G, Q, D] -> [B, Hkv, G, Q, D], a view of a [B, Q, Hkv, G, D] buffer (the flat tokens' order,
    so the caller's reshape is free). `lanes`: lanes a block (from the workspace); `key_chunk`: keys a chunk (a
    multiple of KEY_BLOCK, fixed per backend: see the module docstring)."""
    b, hkv, group, qn, d = qp.shape
    rows = group * qn
    r = padded_rows(rows, min_rows)
    keys = padded_keys(meta.keys)
    qv = qp.permute(1, 0, 2, 3, 4)
    k_flat, v_flat = k_cache.view(-1, d), v_cache.view(-1, d)
    out = qp.new_empty(b, qn, hkv, group, d)
    out_v = out.permute(2, 0, 3, 1, 4)  # [Hkv, B, G, Q, D]
    chunks = [(c0, min(keys, c0 + key_chunk)) for c0 in range(0, keys, key_chunk)]
    whole = lanes >= b and len(chunks) == 1
    for b0 in range(0, b, lanes):
        b1 = min(b, b0 + lanes)
        acc = None
        for k0, k1 in chunks:
            idx = _cached(meta, ("inv_rows", hkv, b0, b1, k0, k1), whole,
                          lambda: _gather_rows(meta, hkv, b0, b1, k0, k1))  # noqa: B023 (called at once)
            masked = _cached(meta, ("inv_mask", group, r, b0, b1, k0, k1), whole,
                             lambda: _masked_out(meta, group, r, b0, b1, k0, k1))  # noqa: B023
            m, lsum, o = _attend_chunk(qv[:, b0:b1], scale, r, k_flat, v_flat, idx, masked, len(chunks) > 1)
            if acc is None:
                acc = (m, lsum, o)
                continue
            # Online softmax over the chunks in key order. Every row saw key 0 in the first (m_old finite); a
            # chunk a row cannot see has m = -inf: factor 0 for it, 1 for what came before, an exact no-op.
            m_old, l_old, o_old = acc
            m_new = torch.maximum(m_old, m)
            a, c = (m_old - m_new).exp_(), (m - m_new).exp_()
            acc = (m_new, l_old * a + lsum * c, o_old * a.unsqueeze(-1) + o * c.unsqueeze(-1))
        _, lsum, o = acc
        bl = b1 - b0
        _write(out_v[:, b0:b1], torch.div, o[:, :, :rows].view(hkv, bl, group, qn, d),
               lsum[:, :, :rows].view(hkv, bl, group, qn, 1))
    return out.permute(0, 2, 3, 1, 4)
