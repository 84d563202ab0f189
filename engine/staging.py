"""Host-to-device staging of a step's inputs: pinned, double-buffered, one copy per dtype.

A step's inputs (starts, slots, token grid, layouts, page tables, sampling parameters) are built on the host
as numpy arrays. Copying each with `torch.tensor(list, device=cuda)` is a pageable copy, and the host waits for
it; a dozen of them a step is a dozen stalls between the scheduler and the device. Instead every array of one
upload is packed into a pinned host buffer per dtype and sent with one `non_blocking` copy each into a fresh
device buffer; the step's tensors are views of it.

Lifetimes (the CUDA defects this guards against):
  * The pinned buffer must not be rewritten while its copy may still be pending: there are four *sets* used
    round-robin, and an event recorded after a set's copies is synchronised before the set is reused. A
    decode step uploads once (on the scheduler thread), a prefill at most three times (inside its device job),
    so a set comes round again only after steps whose copies are long complete: the sync never waits.
  * A set's buffer is regrown only after that sync, so the buffer it replaces has no pending copy either.
  * The device buffer is an ordinary caching-allocator block allocated on the launching stream: the stream
    job that reads it keeps the step's closure, and with it these views, alive until `wait()` (engine/stream.py).

On the CPU the "device" copy is a real copy too (the device side must never alias host state: patching a
chained step's device `start` must not rewrite the host's `base_pos`), and there is nothing to pin or wait for:
each array is copied on its own and wrapped (no packing, clone and split: ~35 us less host work a step).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool}


def _check(dtype: np.dtype) -> np.dtype:
    if dtype not in _DTYPES:
        raise TypeError(f"staging takes int64, float32 or bool arrays, not {dtype}")
    return dtype


class _Set:
    __slots__ = ("buffers", "event")

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.event = None  # CUDA event after this set's last copies


class Staging:
    """`upload(arrays)` -> device tensors with the arrays' shapes and dtypes (int64, float32, bool)."""

    def __init__(self, device: torch.device | str, num_sets: int = 4) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._sets = [_Set() for _ in range(num_sets)]
        self._next = 0

    def upload(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        if not self.cuda:  # nothing to pin or overlap: a copy of each array (never the host's memory) is the upload
            return [torch.from_numpy(np.array(a, dtype=_check(a.dtype), order="C", copy=True)) for a in arrays]
        s = self._sets[self._next]
        self._next = (self._next + 1) % len(self._sets)
        if s.event is not None:
            s.event.synchronize()  # its copies from two uploads back have finished reading the buffer
        groups: dict[torch.dtype, list[int]] = {}
        arrays = [np.ascontiguousarray(a) for a in arrays]
        for i, a in enumerate(arrays):
            groups.setdefault(_DTYPES[_check(a.dtype)], []).append(i)
        out: list[torch.Tensor | None] = [None] * len(arrays)
        for dtype, idx in groups.items():
            sizes = [arrays[i].size for i in idx]
            host = self._buffer(s, dtype, sum(sizes))
            flat = host.numpy()
            off = 0
            for i, n in zip(idx, sizes):
                flat[off: off + n] = arrays[i].reshape(-1)
                off += n
            if self.cuda:
                dev = torch.empty(off, dtype=dtype, device=self.device)
                dev.copy_(host[:off], non_blocking=True)
            else:
                dev = host[:off].clone()
            for i, part in zip(idx, dev.split(sizes)):
                out[i] = part.view(arrays[i].shape)
        if self.cuda:
            s.event = torch.cuda.Event()
            s.event.record()
        return out  # type: ignore[return-value]

    def _buffer(self, s: _Set, dtype: torch.dtype, n: int) -> torch.Tensor:
        buf = s.buffers.get(dtype)
        if buf is None or buf.numel() < n:
            # Safe to drop the old buffer: this set's event was synchronised above.
            size = max(n, 2 * (buf.numel() if buf is not None else 256))
            buf = torch.empty(size, dtype=dtype, pin_memory=self.cuda)
            s.buffers[dtype] = buf
        return buf
