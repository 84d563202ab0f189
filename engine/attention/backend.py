"""The interface every attention backend implements (the torch reference and FlashInfer)."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from specstep.engine.forward_batch import AttentionMetadata


class AttentionBackend(Protocol):
    name: str
    needs_plan: bool  # plan() must see each forward's host lengths before it runs

    def plan(self, slot: str, q_lens: np.ndarray, kv_lens: np.ndarray, page_tables: np.ndarray,
             lanes: int | None = None, stream: torch.cuda.Stream | None = None) -> None:
        """Lengths of the forward that will name `slot` (AttentionMetadata.slot); `lanes`: a graph replay."""

    def plan_padding(self, slot: str, lanes: int, q: int, stream: torch.cuda.Stream | None = None) -> None:
        """Plan an all-padding batch of `lanes` lanes (what a graph is captured with)."""

    def prompts_join(self, rows: int, keys: int) -> bool:
        """Whether prompt-sized requests padded to `rows` x `keys` may attend as one part of a split forward and
        still get each lane's bits as alone (`batch_builder.attention_parts`; backends that plan take ragged
        batches as they are and never split)."""

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                num_heads: int, scale: float) -> torch.Tensor:
        """q [T, H * D] over the paged cache -> [T, H * D]."""
