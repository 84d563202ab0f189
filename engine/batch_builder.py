"""Host-side construction of a `ForwardBatch` from ragged per-request token runs and page tables.

Everything here is numpy on the CPU: it is the batch preparation the scheduler overlaps with device work.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.forward_batch import AttentionMetadata, ForwardBatch
from engine.kv_cache import DUMMY_PAGE


def page_table_array(page_tables: Sequence[Sequence[int]], num_pages: int) -> np.ndarray:
    """[B, num_pages] int64, padded with the dummy page."""
    pt = np.full((len(page_tables), max(num_pages, 1)), DUMMY_PAGE, dtype=np.int64)
    for i, pages in enumerate(page_tables):
        n = min(len(pages), num_pages)
        pt[i, :n] = pages[:n]
    return pt


def build_forward_batch(
    input_ids: Sequence[Sequence[int]] | np.ndarray,
    start_pos: Sequence[int] | np.ndarray,
    page_tables: Sequence[Sequence[int]],
    page_size: int,
    device: torch.device | str,
    q_lens: np.ndarray | None = None,
) -> ForwardBatch:
    """Request b feeds `input_ids[b]` at positions start_pos[b] .. start_pos[b] + q_len - 1 and attends to
    every cached position before them. `input_ids` is ragged (list of lists) or a [B, Q] array with `q_lens`."""
    start = np.asarray(start_pos, dtype=np.int64)
    if q_lens is None:
        q_lens = np.fromiter((len(t) for t in input_ids), dtype=np.int64, count=len(input_ids))
        flat_ids = np.fromiter((x for t in input_ids for x in t), dtype=np.int64, count=int(q_lens.sum()))
    else:
        q_lens = np.asarray(q_lens, dtype=np.int64)
        ids = np.asarray(input_ids, dtype=np.int64)
        flat_ids = ids[np.arange(ids.shape[1])[None, :] < q_lens[:, None]]
    b = len(q_lens)
    kv_lens = start + q_lens
    qn = int(q_lens.max())
    kn = int(kv_lens.max())
    pt = page_table_array(page_tables, -(-kn // page_size))

    req_of_token = np.repeat(np.arange(b), q_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    offset_in_req = np.arange(len(flat_ids)) - cu[req_of_token]
    positions = start[req_of_token] + offset_in_req
    slot_mapping = pt[req_of_token, positions // page_size] * page_size + positions % page_size

    qi = np.arange(qn)[None, :]
    q_valid = qi < q_lens[:, None]
    q_index = np.where(q_valid, cu[:-1, None] + qi, 0)
    out_index = req_of_token * qn + offset_in_req

    kpos = np.arange(kn)
    kv_slots = pt[:, kpos // page_size] * page_size + kpos % page_size
    qpos = start[:, None] + qi  # [B, Q]
    mask = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] < kv_lens[:, None, None])
    mask &= q_valid[:, :, None]
    mask[:, :, 0] |= ~q_valid  # padding query rows see key 0 only (never an all-masked softmax row)

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    return ForwardBatch(
        input_ids=t(flat_ids),
        positions=t(positions),
        slot_mapping=t(slot_mapping),
        attn=AttentionMetadata(q_index=t(q_index), out_index=t(out_index), kv_slots=t(kv_slots),
                               mask=t(mask[:, None])),
    )
