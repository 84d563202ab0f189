"""oneDNN's prepacked linear as a `torch.library` custom op, so a compiled step (`cuda_graphs.cpu_compiled`) can
call it: the prepacked weight is an opaque `mkldnn` tensor that neither dynamo's fake tensors nor inductor can
trace, so the compiled graph calls this op, which runs exactly the kernel the eager step runs (same bits: batch
invariance holds under compilation because every linear stays the one row-invariant kernel).

The op takes the linear's ordinary weight, which the compiled graph reads as an input: the fake implementation
takes the output width from it and the real one finds the `CpuLinear` that owns it (and its packed copy) in a
process-wide table keyed by the weight's address and shape. Keyed by the weight, not by a handle baked into the
graph, the graph is the same for every engine built from the same model, so inductor's disk cache serves a
second engine in the same process as well as a second start.
"""

from __future__ import annotations

import weakref

import torch

_OWNERS: dict[tuple[int, tuple[int, ...]], weakref.ref] = {}  # (weight address, shape) -> its CpuLinear


def _key(weight: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    return weight.data_ptr(), tuple(weight.shape)


def register(linear, weight: torch.Tensor) -> None:
    """`linear` (a `CpuLinear`: the op calls its `_onednn(x)`) owns `weight` from now on."""
    _OWNERS[_key(weight)] = weakref.ref(linear)


@torch.library.custom_op("specstep::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    ref = _OWNERS.get(_key(weight))
    linear = ref() if ref is not None else None
    if linear is None:
        raise RuntimeError(f"onednn_linear: no live CpuLinear owns the weight {tuple(weight.shape)} it was given")
    return linear._onednn(x)


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
