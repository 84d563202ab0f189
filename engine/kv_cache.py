"""Paged KV pool of one model: per layer, K and V as [num_pages * page_size, kv_heads, head_dim].

Page 0 is the dummy page: padding lanes (graph buckets, masked keys) read and write it, so the allocator
never hands it to a request. Target and draft each own a pool; both are indexed by the same page tables.
"""

from __future__ import annotations

import torch

from specstep.engine.config import ModelConfig

DUMMY_PAGE = 0


class KVPool:
    def __init__(self, cfg: ModelConfig, num_layers: int, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        shape = (num_pages * page_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, num_layers: int, page_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * elem
