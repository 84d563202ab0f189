"""Peak transient memory of torch code on any device, from the tensors' own sizes (not timed, not sampled).

`LiveBytes` is a dispatch mode that sees every op's outputs: a storage first returned by an op inside the mode
counts from then until the last tensor viewing it is garbage; storages that existed before (weights, the KV
cache, views of them) never count. Kernels' private scratch (SDPA's per-thread blocks) is not seen: it is
bounded by the kernel, not by the step's shape.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _strided(xs) -> list[torch.Tensor]:
    return [x for x in tree_flatten(xs)[0] if isinstance(x, torch.Tensor) and x.layout == torch.strided]


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._bytes: dict[int, int] = {}  # storage data_ptr -> nbytes, while alive
        self._refs: dict[int, int] = {}  # storage data_ptr -> tensors seen viewing it
        self._seen: set[int] = set()  # ids of the live tensors counted (a WeakSet would compare tensors by value)

    def _release(self, ptr: int, tid: int) -> None:
        self._seen.discard(tid)
        self._refs[ptr] -= 1
        if self._refs[ptr] == 0:
            self.now -= self._bytes.pop(ptr)
            del self._refs[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        older = {x.untyped_storage().data_ptr() for x in _strided((args, kwargs))}
        for t in _strided(out):
            if id(t) in self._seen:  # an in-place op hands its input back
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr == 0 or (ptr in older and ptr not in self._bytes):  # a view of memory from before the mode
                continue
            self._seen.add(id(t))
            if ptr not in self._bytes:
                self._bytes[ptr] = t.untyped_storage().nbytes()
                self._refs[ptr] = 0
                self.now += self._bytes[ptr]
                self.peak = max(self.peak, self.now)
            self._refs[ptr] += 1
            weakref.finalize(t, self._release, ptr, id(t))
        return out
