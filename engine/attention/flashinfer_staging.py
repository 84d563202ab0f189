"""Host side of a FlashInfer plan: the paged-KV arrays built from page tables, and the pinned sets they are staged in.

`paged_kv_layout` builds FlashInfer's (indptr, indices, last_page_len) in O(rows + pages in use): it never
touches page-table columns past a row's last page, so a plan's host work does not grow with the longest
context a request may reach (max_pages), only with the pages the step attends.

`PinnedStaging` holds one slot's two pinned sets (see flashinfer_backend's docstring, "Staging and syncs").
Each set carries the event recorded after the plan that last used it. A set is rewritten, or its arrays
replaced (grown) and so freed, only after that event has completed: FlashInfer copies its schedule out of the
pinned mirror with its own `cudaMemcpyAsync`, which torch's pinned allocator does not see, so a freed block
could be handed out again and overwritten while that copy is still pending.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from specstep.engine.kv_cache import DUMMY_PAGE


class Event(Protocol):
    """What a staging set needs of a CUDA event (tests pass a fake one)."""

    def synchronize(self) -> None: ...


def paged_kv_layout(kv_lens: np.ndarray, page_tables: np.ndarray, page_size: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's paged-KV arrays for rows with kv_lens[b] keys (at least one page each). Row b <
    len(page_tables) reads its pages from page_tables[b] (the dummy page past the table's end); later rows (a
    graph's padding lanes) read the dummy page only.

        row  pages  indptr   indices
         0     2    0        t0[0] t0[1]
         1     1    2        t1[0]
         2     3    3        t2[0] t2[1] DUMMY     <- a table one page short: the dummy page fills in
                    6
    """
    kv = np.asarray(kv_lens, dtype=np.int32)
    n = np.maximum((kv + page_size - 1) // page_size, 1).astype(np.int32)
    indptr = np.zeros(len(n) + 1, np.int32)
    np.cumsum(n, out=indptr[1:])
    indices = np.full(int(indptr[-1]), DUMMY_PAGE, np.int32)
    live = min(len(page_tables), len(n))
    take = np.minimum(n[:live], page_tables.shape[1])
    if take.sum():
        # Row r's first take[r] pages, flattened: (row, column) of each, and where it lands in `indices`.
        rows = np.repeat(np.arange(live), take)
        cols = np.arange(int(take.sum())) - np.repeat(np.cumsum(take) - take, take)
        indices[indptr[rows] + cols] = page_tables[rows, cols]
    return indptr, indices, kv - (n - 1) * page_size


def capacity(n: int) -> int:
    """Buffers that grow with the batch grow by powers of two: a few regrowths, then none."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(slots=True)
class _Staging:
    """One pinned host set: what plan() reads on the host and copies to the device asynchronously."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    int_workspace: torch.Tensor  # swapped in as FlashInfer's pinned mirror of the slot's int workspace
    event: Event | None = None  # recorded after the last plan that used this set


class PinnedStaging:
    """Two pinned sets per slot, used alternately. Plans of different slots (all made before a step's kernels
    are enqueued) never share a set, so the event wait below only ever waits for a copy from an earlier step
    (normally long done). Wrappers of one slot share them: one step plans a slot once. The int-workspace
    mirrors are as large as the device int workspace they mirror (FlashInfer bounds its schedule by the device
    buffer's size and writes the mirror at the same offsets); they never change size."""

    def __init__(self, mirror_bytes: int, pinned: bool) -> None:
        self._mirror_bytes = mirror_bytes
        self._pinned = pinned
        self._sets: list[_Staging | None] = [None, None]
        self._turn = 0

    def stage(self, qo_indptr: np.ndarray, kv_indptr: np.ndarray, kv_indices: np.ndarray,
              last_page_len: np.ndarray) -> _Staging:
        """Copy one plan's host arrays into the next set (sliced to size in the returned set's tensors)."""
        self._turn ^= 1
        s = self._sets[self._turn]
        if s is not None and s.event is not None:
            s.event.synchronize()  # its earlier copies are done: only now may it be rewritten, or freed below
        rows, pages = len(last_page_len), len(kv_indices)
        if s is None or s.last_page_len.numel() < rows or s.kv_indices.numel() < pages:
            s = self._sets[self._turn] = self._grow(s, rows, pages)
        s.event = None
        s.qo_indptr[: rows + 1] = torch.from_numpy(qo_indptr)
        s.kv_indptr[: rows + 1] = torch.from_numpy(kv_indptr)
        s.kv_indices[:pages] = torch.from_numpy(kv_indices)
        s.last_page_len[:rows] = torch.from_numpy(last_page_len)
        return s

    def _grow(self, old: _Staging | None, rows: int, pages: int) -> _Staging:
        rows, pages = capacity(rows), capacity(pages)
        if old is not None:
            rows, pages = max(rows, old.last_page_len.numel()), max(pages, old.kv_indices.numel())
        pin = dict(dtype=torch.int32, pin_memory=self._pinned)
        mirror = old.int_workspace if old is not None else torch.empty(self._mirror_bytes, dtype=torch.uint8,
                                                                       pin_memory=self._pinned)
        return _Staging(torch.empty(rows + 1, **pin), torch.empty(rows + 1, **pin), torch.empty(pages, **pin),
                        torch.empty(rows, **pin), mirror)
