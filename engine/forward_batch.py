"""Per-step metadata handed explicitly to the model and the attention backend (no global context).

A batch is split into a *layout*, fixed once the scheduler has chosen requests and tokens per request, and a
*start* vector (each request's first new position), which is the only thing that depends on how many tokens
the previous step accepted. Everything length-dependent is derived from `start` on the device, so the host can
build step N+1's layout while step N runs and patch only `start` (and the input ids) when N's lengths arrive;
and a captured graph can replay a layout with new starts.

    flat tokens  (T)        : r0q0 r0q1 r0q2 | r1q0 | r2q0 r2q1
    token_req    [T]        : 0    0    0      1      2    2
    token_offset [T]        : 0    1    2      0      0    1
    q_index      [B, Q]     : [[0, 1, 2], [3, 0, 0], [4, 5, 0]]    padding points at row 0 (masked)
    out_index    [T]        : [0, 1, 2, 3, 6, 7]                    row of each token in the B*Q grid
    page_table   [B, P]     : pages of each request, padded with the dummy page; keys cover P * page_size
    derived on device from start [B]:
        positions    = start[token_req] + token_offset
        slot_mapping = page_table[token_req, positions // page_size] * page_size + positions % page_size
        mask[b,i,j]  = j <= start[b] + i  and  j < start[b] + q_len[b]  and  i < q_len[b]   (by block, on demand)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specstep.engine.kv_cache import DUMMY_PAGE


@dataclass(slots=True)
class BatchLayout:
    """Device tensors of a batch's fixed shape (see module docstring)."""

    q_lens: torch.Tensor  # [B]
    token_req: torch.Tensor  # [T]
    token_offset: torch.Tensor  # [T]
    q_index: torch.Tensor  # [B, Q]
    out_index: torch.Tensor  # [T]
    page_table: torch.Tensor  # [B, P]
    page_size: int
    dense: bool = False  # host-known: every lane has Q token rows (q_index and out_index are the identity)

    @property
    def num_tokens(self) -> int:
        return self.token_req.shape[0]


def uniform_layout(page_table: torch.Tensor, q: int, page_size: int,
                   q_lens: torch.Tensor | None = None) -> BatchLayout:
    """The layout of q tokens in every lane, built on the device with `arange` (nothing copied from the host),
    so a captured graph can build it from its static page table; `q_lens` [B] (<= q) masks a lane's unused tail
    queries (ragged verify: the rows stay, the mask hides them).

        lanes = 2, q = 3     flat token t = 0 1 2 | 3 4 5
        token_req    = t // q        0 0 0 | 1 1 1
        token_offset = t % q         0 1 2 | 0 1 2
        q_index      = t.view(B, q)  [[0 1 2] [3 4 5]]        out_index = t
    """
    b = page_table.shape[0]
    t = torch.arange(b * q, device=page_table.device)
    if q_lens is None:
        q_lens = torch.full((b,), q, dtype=torch.long, device=page_table.device)
    return BatchLayout(q_lens=q_lens, token_req=t // q, token_offset=t % q, q_index=t.view(b, q), out_index=t,
                       page_table=page_table, page_size=page_size, dense=True)


@dataclass(slots=True)
class AttentionMetadata:
    """What a paged-attention forward needs, derived on the device from `start` (see the module docstring).

    The mask is not stored: for a long context it is the largest tensor of a step ([B, Q, K] booleans, times
    the query group for grouped-query attention), so a backend asks for the block it attends at a time
    (`mask_block`), and only a block that fits its workspace is ever materialised."""

    q_index: torch.Tensor  # [B, Q]
    out_index: torch.Tensor  # [T]
    q_pos: torch.Tensor  # [B, Q] absolute position of each query row
    kv_len: torch.Tensor  # [B] keys a lane may see: start + q_len
    q_valid: torch.Tensor  # [B, Q] bool; padding query rows see key 0 only (never an all-masked row)
    # [B, P] pages; a lane's keys are its pages' slots in order, P * page_size of them (`keys`).
    page_table: torch.Tensor
    page_size: int
    slot: str = ""  # which of the step's attention plans this forward uses (backends that plan: FlashInfer)
    dense: bool = False  # the flat tokens already form the [B, Q] grid: no gather in or out
    _blocks: dict[tuple, torch.Tensor] = field(default_factory=dict)  # per forward, shared by all layers

    @property
    def keys(self) -> int:
        return self.page_table.shape[1] * self.page_size

    @property
    def mask(self) -> torch.Tensor:
        """The whole [B, 1, Q, K] mask (tests, and backends that attend in one block)."""
        return self.mask_block(0, self.q_index.shape[0], 0, self.q_index.shape[1], 0, self.keys, 1)

    def mask_block(self, b0: int, b1: int, i0: int, i1: int, k0: int, k1: int, group: int,
                   cache: bool = True) -> torch.Tensor:
        """Lanes [b0, b1), query rows [i0, i1), keys [k0, k1) as [b1 - b0, 1, group * (i1 - i0), k1 - k0],
        query heads grouped as [B, kv_heads, group * Q, K] lays them out (h = kv_head * group + g). `cache`:
        keep it for the forward's other layers (a backend attending in one block); blocks of a workspace-bound
        attention are not kept, or together they would be the whole mask again."""
        key = (b0, b1, i0, i1, k0, k1, group)
        if not cache or key not in self._blocks:
            kpos = torch.arange(k0, k1, device=self.kv_len.device)
            q_pos, q_valid = self.q_pos[b0:b1, i0:i1], self.q_valid[b0:b1, i0:i1]
            m = (kpos <= q_pos.unsqueeze(-1)) & (kpos < self.kv_len[b0:b1].view(-1, 1, 1)) & q_valid.unsqueeze(-1)
            if k0 == 0:
                m[:, :, 0] |= ~q_valid
            b, q, k = m.shape
            if group > 1:
                m = m.unsqueeze(1).expand(b, group, q, k).reshape(b, group * q, k)
            if not cache:
                return m.unsqueeze(1)
            self._blocks[key] = m.unsqueeze(1)
        return self._blocks[key]


@dataclass(slots=True)
class SplitAttention:
    """Attention for a batch whose requests differ widely in query or key length (a mixed step: decode rows
    beside a long prompt's chunk): one masked attention per part, each over a contiguous range [t0, t1) of the
    flat tokens, so no part is padded to another's lengths. Built on the host for backends that pad (torch);
    FlashInfer takes ragged batches as they are."""

    parts: list[tuple[int, int, AttentionMetadata]]
    slot: str = ""


@dataclass(slots=True)
class ForwardBatch:
    """One forward over flat tokens: ids, absolute positions, where each new K/V goes, attention indices."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long, flat KV slot = page * page_size + offset
    attn: AttentionMetadata | SplitAttention

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def derive(cls, layout: BatchLayout, start: torch.Tensor, input_ids: torch.Tensor,
               write: torch.Tensor | None = None, slot: str = "") -> ForwardBatch:
        """All length-dependent metadata from `start` [B], on the device, without a host sync.

        `write` [B] bool: lanes whose new K/V are kept; the others write the dummy page (a lane computed only
        to keep the batch's shape, e.g. a request that drafts fewer tokens than the batch's k).
        `slot`: the attention plan this forward uses ("prefill", "verify", "draft.1", "refill", ...)."""
        ps = layout.page_size
        positions = start[layout.token_req] + layout.token_offset
        slot_mapping = layout.page_table[layout.token_req, positions // ps] * ps + positions % ps
        if write is not None:
            slot_mapping = torch.where(write.index_select(0, layout.token_req), slot_mapping, DUMMY_PAGE * ps)
        qi = torch.arange(layout.q_index.shape[1], device=start.device)
        q_valid = qi.unsqueeze(0) < layout.q_lens.unsqueeze(1)  # [B, Q]
        attn = AttentionMetadata(layout.q_index, layout.out_index, start.unsqueeze(1) + qi, start + layout.q_lens,
                                 q_valid, layout.page_table, ps, slot, layout.dense)
        return cls(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, attn=attn)
