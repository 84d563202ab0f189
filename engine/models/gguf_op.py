"""The GGUF kernel as a `torch.library` custom op, so a compiled step (`cuda_graphs.cpu_compiled`) calls it as an
opaque op (the ctypes call is not traceable); eager steps call the kernel directly and skip the dispatcher."""

from __future__ import annotations

import torch

from specstep.engine.models.gguf_kernel import gguf_linear


@torch.library.custom_op("specstep::gguf_linear", mutates_args=())
def gguf_linear_op(x: torch.Tensor, blocks: torch.Tensor, out_features: int, fmt: str,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return gguf_linear(x, blocks, out_features, fmt, bias)


@gguf_linear_op.register_fake
def _(x: torch.Tensor, blocks: torch.Tensor, out_features: int, fmt: str, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
