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
        mask[b,i,j]  = j <= start[b] + i  and  j < start[b] + q_len[b]  and  i < q_len[b]
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


@dataclass(slots=True)
class AttentionMetadata:
    q_index: torch.Tensor  # [B, Q]
    out_index: torch.Tensor  # [T]
    kv_slots: torch.Tensor  # [B, K]
    mask: torch.Tensor  # [B, 1, Q, K] bool; padding query rows see key 0 only (never an all-masked row)
    slot: str = ""  # which of the step's attention plans this forward uses (backends that plan: FlashInfer)
    dense: bool = False  # the flat tokens already form the [B, Q] grid: no gather in or out
    # [B, P] pages behind kv_slots (kv_slots[b] = page_table[b, :, None] * page_size + arange(page_size)): a
    # backend that gathers keys copies whole pages instead of one slot at a time.
    page_table: torch.Tensor | None = None
    page_size: int = 0
    _grouped: dict[int, torch.Tensor] = field(default_factory=dict)  # per forward, shared by all layers

    def grouped_mask(self, group: int) -> torch.Tensor:
        """The mask for queries laid out as [B, kv_heads, group * Q, K] (grouped-query attention)."""
        if group == 1:
            return self.mask
        if group not in self._grouped:
            b, _, q, k = self.mask.shape
            self._grouped[group] = self.mask.unsqueeze(2).expand(b, 1, group, q, k).reshape(b, 1, group * q, k)
        return self._grouped[group]


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
        b, p = layout.page_table.shape
        kpos = torch.arange(p * ps, device=start.device)
        kv_slots = (layout.page_table.unsqueeze(-1) * ps + torch.arange(ps, device=start.device)).view(b, p * ps)
        qi = torch.arange(layout.q_index.shape[1], device=start.device)
        q_valid = qi.unsqueeze(0) < layout.q_lens.unsqueeze(1)  # [B, Q]
        q_pos = start.unsqueeze(1) + qi  # [B, Q]
        kv_len = start + layout.q_lens
        mask = (kpos <= q_pos.unsqueeze(-1)) & (kpos < kv_len.view(b, 1, 1)) & q_valid.unsqueeze(-1)
        mask[:, :, 0] |= ~q_valid
        return cls(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                   attn=AttentionMetadata(layout.q_index, layout.out_index, kv_slots, mask.unsqueeze(1), slot,
                                              layout.dense, layout.page_table, ps))
