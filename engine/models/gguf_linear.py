"""Linears that read a GGUF checkpoint's quantised blocks as they are (`--quantization auto|gguf`, CPU).

A batch-1 decode step reads every weight once, so on a CPU its cost is the bytes read: SmolLM2-135M is 538 MB in
fp32 and 96 MB in its file's Q4_1 / Q8_0 blocks. `GGUFLinear` is a linear over such blocks: the older Q4_1 / Q8_0
kernel's (`gguf_kernel`), or the kernel layer's formats (`engine/kernels`). `gguf_model_linears` swaps a model's
linears for them.

Same weights, other roundings: the kernel computes each output as the dequantised weights' dot product in fp32,
in a fixed order of its own (`gguf_kernel.cpp`), so its results differ from an fp32 GEMM's by rounding only, and
every row's bits are independent of the rows beside it (batch-invariant by construction, at every row count).
`--quantization none` keeps the fp32 weights and the oneDNN / MKL linears.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specstep.engine.errors import CheckpointError
from specstep.engine.kernels import binding as kernel_layer
from specstep.engine.models.gguf_kernel import (
    ACTIVATIONS,
    BLOCK,
    FORMATS,
    LANES_PACKED,
    amx_pack,
    gguf_linear,
    kernel_fmt,
    lanes_pack,
)


def dequantize(fmt: str, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """The fp32 weights of `blocks` [rows, bytes] (the `gguf` package's dequantiser: what the checkpoint holds)."""
    from gguf import GGMLQuantizationType, quants

    w = quants.dequantize(blocks.numpy(), GGMLQuantizationType[fmt])
    return torch.from_numpy(np.ascontiguousarray(w.reshape(blocks.shape[0], in_features), dtype=np.float32))


def table_arith(fmt: str, activations: str) -> str:
    """The kernel layer's arithmetic for `fmt` weights: fp32 where asked (exact), else the fastest the format and
    this CPU have: int8 for block formats (llama.cpp's), bf16 for BF16 weights on AVX-512 BF16 hosts (what a bf16
    checkpoint computes in elsewhere), fp32 otherwise (F16 weights, BF16 without those dot products)."""
    if activations == "fp32":
        return "fp32"
    if kernel_layer.runs(fmt, "int8"):
        return "int8"
    return "bf16" if kernel_layer.runs_here(fmt, "bf16") else "fp32"


class GGUFLinear(nn.Module):
    """y = x @ W.T + b with W read from GGUF blocks (`blocks` [out_features, in_features / 32 blocks], uint8);
    `activations` "int8": x quantised per 32-value block first (`gguf_kernel.cpp`'s header: not exact), in AVX2
    lanes (Q4_1 over a copy of the blocks repacked for them, `packed`: the same bits); "int8-tiles": the same
    quantisation in AMX tiles over a copy repacked for the tiles (`packed`; `gguf_amx.cpp`: block sums, other
    roundings); "int8-vnni": the tiles' arithmetic and copy in AVX-512 VNNI lanes (hosts without AMX). `blocks`
    stay for prompt rows (the C++ layers' prompt GEMM) and the fp32 weights."""

    def __init__(self, fmt: str, blocks: torch.Tensor, in_features: int, bias: nn.Parameter | None,
                 tied: nn.Parameter | None = None, activations: str = "fp32") -> None:
        super().__init__()
        # the kernel layer's table row (engine/kernels) for the formats it reads, else None (Q4_1 / Q8_0: the
        # older kernel, `gguf_kernel`)
        self.kernel: kernel_layer.LinearKernel | None = None
        if fmt not in FORMATS:
            self._init_table([(fmt, blocks)], in_features, bias, tied, activations)
            return
        if in_features % BLOCK:
            raise CheckpointError(f"a {fmt} weight's input width {in_features} is not a multiple of {BLOCK}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        self.fmt, self.activations = fmt, activations
        layout = "int8-packed" if activations == "int8" and fmt in LANES_PACKED else activations
        self.kernel_fmt = kernel_fmt(fmt, layout)
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        pack = {"int8-tiles": amx_pack, "int8-vnni": amx_pack, "int8-packed": lanes_pack}.get(layout)
        self.register_buffer("packed", None if pack is None else pack(self.blocks, fmt, in_features),
                             persistent=False)
        self.bias = bias
        self._tied = [tied]  # a list: not registered (the embedding owns it)

    @classmethod
    def split(cls, pieces: list[tuple[str, torch.Tensor]], in_features: int, bias: nn.Parameter | None,
              activations: str = "fp32") -> GGUFLinear:
        """A merged projection whose pieces the file stores in different formats of the kernel layer (a Q4_K_M
        file's q and k in Q4_K, v in Q6_K): each piece's rows keep their own blocks and kernel."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._init_table(pieces, in_features, bias, None, activations)
        return self

    def _init_table(self, pieces: list[tuple[str, torch.Tensor]], in_features: int, bias: nn.Parameter | None,
                    tied: nn.Parameter | None, activations: str) -> None:
        """The kernel layer's formats: `parts` (kernel, rows, byte offset) over one buffer of the pieces' blocks."""
        self.parts: list[tuple[kernel_layer.LinearKernel, int, int]] = []
        offset = 0
        for fmt, rows in pieces:
            kernel = kernel_layer.linear_kernel(fmt, table_arith(fmt, activations))
            if in_features % kernel.qk:
                raise CheckpointError(f"a {fmt} weight's input width {in_features} is not a multiple of {kernel.qk}")
            self.parts.append((kernel, rows.shape[0], offset))
            offset += rows.numel()
        self.kernel = self.parts[0][0]
        self.fmt = "+".join(dict.fromkeys(fmt for fmt, _ in pieces))
        ariths = {k.arith for k, _, _ in self.parts}
        self.activations = next((a for a in ("int8", "bf16") if a in ariths), "fp32")
        self.kernel_fmt = "+".join(dict.fromkeys(k.name for k, _, _ in self.parts))
        self.in_features, self.out_features = in_features, sum(n for _, n, _ in self.parts)
        blocks = pieces[0][1].contiguous() if len(pieces) == 1 else torch.cat([r.reshape(-1) for _, r in pieces])
        self.register_buffer("blocks", blocks, persistent=False)
        self.register_buffer("packed", None, persistent=False)
        self.bias = bias
        self._tied = [tied]

    def part_blocks(self, i: int) -> torch.Tensor:
        """Part i's blocks [rows, bytes a row] (a view of `blocks`)."""
        kernel, rows, offset = self.parts[i]
        return self.blocks.reshape(-1)[offset:offset + rows * self.in_features // kernel.qk * kernel.block_bytes] \
            .view(rows, -1)

    def _table_forward(self, x: torch.Tensor) -> torch.Tensor:
        outs, first = [], 0
        for i, (kernel, rows, _) in enumerate(self.parts):
            blocks = self.blocks if len(self.parts) == 1 else self.part_blocks(i)
            bias = None if self.bias is None else self.bias[first:first + rows]
            first += rows
            outs.append(kernel_layer.linear(x, blocks, rows, kernel, bias))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    @property
    def weight(self) -> torch.Tensor:
        """The fp32 weights (a tied embedding's own, else dequantised on demand: e.g. a drafter's reduced
        vocabulary takes rows of it at load)."""
        tied = self._tied[0]
        if tied is not None:
            return tied
        if self.kernel is not None:
            return torch.cat([torch.from_numpy(kernel_layer.dequantize(k.fmt, self.part_blocks(i)))
                              .view(rows, self.in_features) for i, (k, rows, _) in enumerate(self.parts)])
        return dequantize(self.fmt, self.blocks, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:  # training through it: the kernel has no backward
            return F.linear(x, self.weight, self.bias)
        if self.kernel is not None:
            return self._table_forward(x)
        return gguf_linear(x, self.kernel_weights, self.out_features, self.kernel_fmt, self.bias)

    @property
    def kernel_weights(self) -> torch.Tensor:
        """What the kernel's `kernel_fmt` reads: the blocks, or their repacked copy."""
        return self.blocks if self.packed is None else self.packed

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.kernel_fmt}"
