"""The kernel layer's linear as a `torch.library` custom op, so a compiled step calls it as an opaque op with a
schema (the ctypes call is not traceable); eager steps call `binding.linear` directly."""

from __future__ import annotations

from functools import cache

import torch

from specstep.engine.kernels import binding


@cache
def _kernel(name: str) -> binding.LinearKernel:
    fmt, arith, isa = name.split("/")
    return binding.linear_kernel(fmt, arith, isa)


@torch.library.custom_op("specstep::block_linear", mutates_args=())
def block_linear_op(x: torch.Tensor, blocks: torch.Tensor, out_features: int, kernel: str,
                    bias: torch.Tensor | None) -> torch.Tensor:
    return binding.linear(x, blocks, out_features, _kernel(kernel), bias)


@block_linear_op.register_fake
def _(x: torch.Tensor, blocks: torch.Tensor, out_features: int, kernel: str,
      bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
