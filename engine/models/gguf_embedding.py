"""A GGUF file's token embedding read from its blocks (`--quantization auto|gguf`, CPU, one rank).

A lookup reads a few rows of the table, so it dequantises just those (a row is whole blocks: exactly the fp32
rows of the converted checkpoint, by the same dequantiser the loader checks them with) and the table stays in the
file's bytes: a 151,936 x 1,536 Q4_K table is 0.2 GB where its fp32 rows were 0.9. A tied `lm_head` reads the same
blocks through its `GGUFLinear` (one storage)."""

from __future__ import annotations

import torch
from torch import nn

from specstep.engine.kernels import binding as kernel_layer


class GGUFEmbedding(nn.Module):
    """embedding(ids) from `blocks` [num_embeddings, bytes a row] uint8 of GGML type `fmt`."""

    def __init__(self, fmt: str, blocks: torch.Tensor, embedding_dim: int) -> None:
        super().__init__()
        self.fmt, self.num_embeddings, self.embedding_dim = fmt, blocks.shape[0], embedding_dim
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        # Decided once (a ctypes call, too dear for every lookup): the kernel layer's dequantiser where it reads
        # the format, else the gguf package's, in Python (about 0.1 ms a decode step).
        self._in_table = not kernel_layer.unavailable() and kernel_layer.dequantizes(fmt)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        from specstep.engine.models.gguf_linear import dequantize

        if self._in_table:
            return torch.from_numpy(kernel_layer.dequantize(self.fmt, rows, threads=1)).view(-1, self.embedding_dim)
        return dequantize(self.fmt, rows, self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, input_ids.reshape(-1).long())
        return self._rows(rows).view(*input_ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The fp32 table, dequantised on demand (a copy: for callers that need the whole of it)."""
        return self._rows(self.blocks)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt} blocks"
