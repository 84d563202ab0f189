"""Host-side construction of batch layouts (numpy on the CPU: the batch preparation that overlaps device work)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specstep.engine.forward_batch import BatchLayout, ForwardBatch
from specstep.engine.kv_cache import DUMMY_PAGE


def to_device(a: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A device copy of a host array; on the CPU a real copy too, so the device side never aliases host state
    (patching a chained step's `start` must not rewrite its host `base_pos`, as it could not on CUDA)."""
    t = torch.from_numpy(a)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)  # pinned so the copy is truly asynchronous
    return t.clone()


def page_table_array(page_tables: Sequence[Sequence[int]], num_pages: int) -> np.ndarray:
    """[B, num_pages] int64, padded with the dummy page."""
    pt = np.full((len(page_tables), max(num_pages, 1)), DUMMY_PAGE, dtype=np.int64)
    for i, pages in enumerate(page_tables):
        n = min(len(pages), num_pages)
        pt[i, :n] = pages[:n]
    return pt


def build_layout(q_lens: Sequence[int] | np.ndarray, page_tables: Sequence[Sequence[int]], page_size: int,
                 device: torch.device | str, max_kv_len: int | None = None) -> BatchLayout:
    """Layout for request b feeding q_lens[b] tokens; keys cover every page in its table (or max_kv_len)."""
    q_lens = np.asarray(q_lens, dtype=np.int64)
    b = len(q_lens)
    qn = int(q_lens.max())
    token_req = np.repeat(np.arange(b), q_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    token_offset = np.arange(len(token_req)) - cu[token_req]
    qi = np.arange(qn)[None, :]
    q_index = np.where(qi < q_lens[:, None], cu[:-1, None] + qi, 0)
    out_index = token_req * qn + token_offset
    num_pages = -(-max_kv_len // page_size) if max_kv_len else max(len(p) for p in page_tables)
    pt = page_table_array(page_tables, num_pages)
    return BatchLayout(*(to_device(a, device) for a in (q_lens, token_req, token_offset, q_index, out_index, pt)),
                       page_size=page_size, dense=bool((q_lens == qn).all()))


def build_forward_batch(input_ids: Sequence[Sequence[int]], start_pos: Sequence[int] | np.ndarray,
                        page_tables: Sequence[Sequence[int]], page_size: int, device: torch.device | str,
                        attention=None, slot: str = "") -> ForwardBatch:
    """Ragged host token lists (prefill, catch-up, tests); plans `slot` on `attention` if it plans."""
    q_lens = np.array([len(t) for t in input_ids], dtype=np.int64)
    start_pos = np.asarray(start_pos, dtype=np.int64)
    flat = np.fromiter((x for t in input_ids for x in t), dtype=np.int64, count=int(q_lens.sum()))
    layout = build_layout(q_lens, page_tables, page_size, device)
    if attention is not None and attention.needs_plan:
        width = max(len(p) for p in page_tables)
        attention.plan(slot, q_lens, start_pos + q_lens, page_table_array(page_tables, width))
    return ForwardBatch.derive(layout, to_device(start_pos, device), to_device(flat, device), slot=slot)
