"""Paged KV pool of one model: per layer, K and V as [num_pages * page_size, kv_heads, head_dim].

Page 0 is the dummy page: padding lanes (graph buckets, masked keys) read and write it, so the allocator
never hands it to a request. Target and draft each own a pool; both are indexed by the same page tables.

Start-up builds the pools with the dummy page only, measures memory with everything else in place, then sizes
them (`allocate`, see `engine.memory_plan`) before any graph is captured: graphs record the tensors' addresses.
"""

from __future__ import annotations

import numpy as np
import torch

from specstep.engine.config import ModelConfig

DUMMY_PAGE = 0


class KVPool:
    def __init__(self, cfg: ModelConfig, num_layers: int, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.page_size = page_size
        self.num_layers = num_layers
        self._row = (cfg.num_kv_heads, cfg.head_dim)
        self._dtype, self._device = dtype, device
        self.num_pages = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.allocate(num_pages)

    def allocate(self, num_pages: int) -> None:
        """Replace the pool by one of `num_pages` pages (zeroed). Only before graphs are captured and while no
        request holds a page: the old contents are dropped."""
        self.k, self.v = [], []  # the old tensors go first: the peak stays at one pool
        shape = (num_pages * self.page_size, *self._row)
        self.k = [zeros(shape, self._dtype, self._device) for _ in range(self.num_layers)]
        self.v = [zeros(shape, self._dtype, self._device) for _ in range(self.num_layers)]
        self.num_pages = num_pages

    @property
    def page_bytes(self) -> int:
        """Bytes one page takes across every layer, K and V."""
        elem = torch.empty((), dtype=self._dtype).element_size()
        return 2 * self.num_layers * self.page_size * self._row[0] * self._row[1] * elem


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed pool tensor. On CPU from calloc (numpy's zeros): the kernel hands out zero pages as they are first
    written, so a pool costs resident memory as requests fill it, and start-up does not write every byte
    (`torch.zeros` did: 8 s and 4 GiB resident for SmolLM2's default 4 GiB pool before the first request).
    Zero bits are 0.0 in every float format, and masked keys must hold finite values: attention multiplies
    them by an exact zero weight (`invariant_attention`), and garbage could be NaN."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    elem = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(int(np.prod(shape)) * elem, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)

