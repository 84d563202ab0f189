"""Vocabulary-parallel embedding: each rank holds a block of the vocabulary's rows (`shard.vocab_shard`).

A token outside the rank's block embeds to zero there, so the all-reduce sums exactly one non-zero row per token:
the result equals the whole table's lookup bit for bit. At world size 1 it is a plain `nn.Embedding`.
"""

from __future__ import annotations

import torch
from torch import nn

from specstep.engine.parallel.group import SINGLE, TPGroup
from specstep.engine.parallel.shard import vocab_shard


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, dim: int, tp: TPGroup = SINGLE) -> None:
        self.vocab_start, rows = vocab_shard(vocab_size, tp.config)
        weight = torch.empty(rows, dim)
        # nn.Embedding's own init draws the same normal values, but on `meta` (how models are loaded) its
        # normal_ goes through torch's reference ops and imports torch._dynamo: seconds per process for nothing.
        if not weight.is_meta:
            nn.init.normal_(weight)
        super().__init__(rows, dim, _weight=weight)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = super().forward(local.masked_fill(outside, 0)).masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, vocab_start={self.vocab_start}, tp={self.tp.world_size}"
