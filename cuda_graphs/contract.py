"""The step-function contract every captured step follows, on CUDA and in the CPU stand-in.

A step function is `fn(inputs, key) -> outputs`:
  * `inputs`  : a mapping name -> tensor. Under a graph these are the runner's *static* buffers (views of one
                max-size buffer per input, sliced to the bucket); the runner copies live values into them in
                place before each replay. Every input is lane-major: its leading dimension is
                `key.batch * spec.rows` (rows per request: 1 for [B, ...], q for flat tokens [B * q, ...]).
  * `key`     : the `GraphKey` (step kind, batch bucket, tokens per request); host-side constants only.
  * `outputs` : a mapping name -> tensor, also lane-major. Under a graph these are the static outputs the
                capture produced; a replay rewrites them in place, so read (or copy) them before the next
                replay of the same graph.

What a graph cannot do, and the CPU stand-in therefore rejects:
  * rebind, resize or reallocate an input (a graph keeps reading the captured address);
  * change an input or output shape between capture and replay;
  * keep a tensor it allocated alive past the step other than through its outputs (state must be written
    in place into buffers allocated outside the step: a graph would not re-run the Python that rebinds it);
  * return, at replay, a different pre-existing tensor than at capture, or let host values steer the work
    (the graph replays the captured kernels with the captured scalars);
  * sync with the host (`.item()`, `nonzero`, boolean indexing) or bake host data in (`torch.tensor(list)`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch


class GraphContractError(RuntimeError):
    """A step function breaks the static-buffer contract; it would compute wrong results under a CUDA graph."""


@dataclass(frozen=True, slots=True, order=True)
class GraphKey:
    kind: str  # decode | draft | verify | refill | ... (any name the caller registers)
    batch: int  # batch bucket (lanes), or the live batch size when run eagerly
    q: int  # tokens per request


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """One static input: `rows` leading rows per lane, then `trailing` dims; padding lanes get `pad`."""

    rows: int = 1
    trailing: tuple[int, ...] = ()
    dtype: torch.dtype = torch.long
    pad: int | float = 0

    def shape(self, lanes: int) -> tuple[int, ...]:
        return (lanes * self.rows, *self.trailing)


StepFn = Callable[[Mapping[str, torch.Tensor], GraphKey], Mapping[str, torch.Tensor]]
InputSpecs = Callable[[int], Mapping[str, BufferSpec]]  # tokens per request -> specs


@dataclass(frozen=True, slots=True)
class StepKind:
    """A step the runner may capture: one graph per (bucket, q) for q in `q_values`.

    `prepare(key)`, if given, runs before the warm-up and capture of each key: e.g. plan the attention backend
    for an all-padding batch of key.batch lanes (FlashInferAttention.plan_padding), so the graph captures the
    wrapper that later plans rewrite in place.
    """

    name: str
    fn: StepFn
    inputs: InputSpecs
    q_values: tuple[int, ...] = (1,)
    prepare: Callable[[GraphKey], None] | None = None


def lanes_of(t: torch.Tensor, bucket: int) -> int:
    """Rows per lane of a lane-major output of a graph captured at `bucket` lanes."""
    if t.dim() == 0 or t.shape[0] % bucket:
        raise GraphContractError(f"output of shape {tuple(t.shape)} is not lane-major for a bucket of {bucket}")
    return t.shape[0] // bucket
