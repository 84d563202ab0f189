"""Per-step metadata handed explicitly to the model and the attention backend (no global context)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Index tensors the torch attention backend needs for one forward over a paged cache.

    Requests are ragged: request b has `q_len[b]` new tokens and `kv_len[b]` cached+new tokens. The backend
    pads queries to Q and keys to K per request:

        flat tokens  (T)      : r0q0 r0q1 r0q2 | r1q0 | r2q0 r2q1
        q_index      [B, Q]   : [[0, 1, 2], [3, 0, 0], [4, 5, 0]]     padding points at row 0 (masked)
        out_index    [T]      : [0, 1, 2, 3, 6, 7]                      row of each token in the B*Q grid
        kv_slots     [B, K]   : KV slot of key position j of request b (padding -> the dummy page)
        mask      [B, 1, Q, K]: key j visible to query i  iff  j <= kv_len - q_len + i  and  j < kv_len

    Padding query rows may see key 0 only, so softmax never sees an all-masked row (which would be NaN).
    """

    q_index: torch.Tensor
    out_index: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor

    def grouped_mask(self, group: int) -> torch.Tensor:
        """The mask for queries laid out as [B, kv_heads, group * Q, K] (grouped-query attention)."""
        b, _, q, k = self.mask.shape
        if group == 1:
            return self.mask
        return self.mask.unsqueeze(2).expand(b, 1, group, q, k).reshape(b, 1, group * q, k)


@dataclass(slots=True)
class ForwardBatch:
    """One forward over flat tokens: ids, absolute positions, where each new K/V goes, and attention indices."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long, flat KV slot = page * page_size + offset
    attn: AttentionMetadata

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
