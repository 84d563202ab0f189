"""Host-side construction of batch layouts (numpy on the CPU: the batch preparation that overlaps device work)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from specstep.engine.attention.invariant_attention import MAX_QUERY_ROWS
from specstep.engine.forward_batch import BatchLayout, ForwardBatch, SplitAttention
from specstep.engine.kv_cache import DUMMY_PAGE

Upload = Callable[[Sequence[np.ndarray]], list[torch.Tensor]]  # engine.staging.Staging.upload


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
        if len(pages) > num_pages:  # a cut table would send a lane's keys and writes to the wrong pages
            raise ValueError(f"page table of {len(pages)} pages does not fit a width of {num_pages}")
        pt[i, :len(pages)] = pages
    return pt


def layout_arrays(q_lens: Sequence[int] | np.ndarray, page_tables: Sequence[Sequence[int]], page_size: int,
                  max_kv_len: int | None = None) -> tuple[list[np.ndarray], bool]:
    """Host arrays of `BatchLayout` (in its field order) for request b feeding q_lens[b] tokens, keys covering
    every page in its table (or max_kv_len); and whether the layout is dense."""
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
    return [q_lens, token_req, token_offset, q_index, out_index, pt], bool((q_lens == qn).all())


LAYOUT_ARRAYS = 6


def build_layout(q_lens: Sequence[int] | np.ndarray, page_tables: Sequence[Sequence[int]], page_size: int,
                 device: torch.device | str, max_kv_len: int | None = None) -> BatchLayout:
    """The layout on the device, one copy an array (tests and one-off forwards; steps stage `layout_arrays`)."""
    arrays, dense = layout_arrays(q_lens, page_tables, page_size, max_kv_len)
    return layout_from([to_device(a, device) for a in arrays], page_size, dense)


def layout_from(tensors: Sequence[torch.Tensor], page_size: int, dense: bool) -> BatchLayout:
    return BatchLayout(*tensors, page_size=page_size, dense=dense)


# A padded attention part may compute at most this many times its requests' own query x keys; inf: one padded batch
# whatever the requests' sizes (tests compare against it).
PAD_LIMIT = 2.0


def attention_parts(q_lens: np.ndarray, kv_lens: np.ndarray, page_size: int,
                    prompts_join: Callable[[int, int], bool] | None = None,
                    table_pages: np.ndarray | None = None) -> list[tuple[int, int]]:
    """Consecutive request ranges [r0, r1) to attend separately: one batch pads every request to the longest
    query and the longest key range, so a decode row beside a 4,000-token prompt chunk would compute the
    chunk's whole [q, keys] block; a part grows while its padded work stays within PAD_LIMIT of its own. Requests
    of a decode step's size (at most MAX_QUERY_ROWS rows: decode, verify, draft, refill, short chunks) share
    parts, which attend batch-invariantly; a longer one (a prompt, a chunk) shares a part only with requests of
    its very shape, or with any requests where the backend attends their padded shape lane by lane as alone at
    no cost for the padding (`prompts_join(rows, keys)`: the C++ kernel's prompt sizes; a fused mixed step's
    verify rows and chunks then attend in one call), so its rows are the same bits whatever shares its
    forward. `table_pages`: each request's page-table length (a part attends over its widest table's keys, which
    may run past its keys in use: pages reserved for later positions); by default its keys in use."""
    keys = -(-kv_lens // page_size) * page_size
    width = keys if table_pages is None else np.asarray(table_pages) * page_size  # what a part attends over
    few = q_lens <= MAX_QUERY_ROWS
    one_batch = PAD_LIMIT == float("inf")
    if one_batch or (prompts_join is not None and prompts_join(int(q_lens.max()), int(width.max()))):
        return [(0, len(q_lens))]  # the backend attends each lane of the padded shape as alone, padding for free
    parts, r0 = [], 0
    for r in range(1, len(q_lens) + 1):
        if r == len(q_lens):
            parts.append((r0, r))
            break
        qn, kn = q_lens[r0: r + 1].max(), keys[r0: r + 1].max()
        # a prompt-sized request shares a part only with requests of its very shape (a batch of fresh prompts of
        # one length, attended as one: the C++ layers' one call a step), which pad nothing
        alike = few[r] == few[r0] and (few[r] or (q_lens[r] == q_lens[r0] and keys[r] == keys[r0]
                                                  and width[r] == width[r0]))
        if (not alike and not one_batch) or (
                (r + 1 - r0) * qn * kn > PAD_LIMIT * float((q_lens[r0: r + 1] * keys[r0: r + 1]).sum())):
            parts.append((r0, r))
            r0 = r
    return parts


def build_forward_batch(input_ids: Sequence[Sequence[int]], start_pos: Sequence[int] | np.ndarray,
                        page_tables: Sequence[Sequence[int]], page_size: int, device: torch.device | str,
                        attention=None, slot: str = "", upload: Upload | None = None) -> ForwardBatch:
    """Ragged host token lists (prefill, mixed steps, catch-up, tests); plans `slot` on `attention` if it plans,
    else splits the attention where one padded batch would waste most of its work (`attention_parts`). Every
    array goes to the device in one `upload` when given (a step's pinned staging)."""
    q_lens = np.array([len(t) for t in input_ids], dtype=np.int64)
    start_pos = np.asarray(start_pos, dtype=np.int64)
    flat = np.fromiter((x for t in input_ids for x in t), dtype=np.int64, count=int(q_lens.sum()))
    if attention is not None and attention.needs_plan:
        width = max(len(p) for p in page_tables)
        attention.plan(slot, q_lens, start_pos + q_lens, page_table_array(page_tables, width))
        parts = [(0, len(q_lens))]
    else:
        parts = attention_parts(q_lens, start_pos + q_lens, page_size,
                                attention.prompts_join if attention is not None else None,
                                np.array([len(p) for p in page_tables]))
    host = [flat]
    dense = []
    for r0, r1 in parts:
        arrays, d = layout_arrays(q_lens[r0:r1], page_tables[r0:r1], page_size)
        host += [*arrays, start_pos[r0:r1]]
        dense.append(d)
    dev = upload(host) if upload else [to_device(a, device) for a in host]
    ids = dev[0]
    per_part = LAYOUT_ARRAYS + 1
    layouts = [(layout_from(dev[1 + i * per_part: i * per_part + per_part], page_size, d), dev[(i + 1) * per_part])
               for i, d in enumerate(dense)]
    if len(parts) == 1:
        return ForwardBatch.derive(layouts[0][0], layouts[0][1], ids, slot=slot)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    fbs = [ForwardBatch.derive(layout, start, ids[cu[r0]: cu[r1]], slot=slot)
           for (r0, r1), (layout, start) in zip(parts, layouts)]
    split = SplitAttention([(int(cu[r0]), int(cu[r1]), fb.attn) for (r0, r1), fb in zip(parts, fbs)], slot)
    return ForwardBatch(input_ids=ids, positions=torch.cat([fb.positions for fb in fbs]),
                        slot_mapping=torch.cat([fb.slot_mapping for fb in fbs]), attn=split)
