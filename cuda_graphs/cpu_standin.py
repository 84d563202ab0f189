"""The CPU stand-in for a CUDA graph: same interface, and it *checks* the contract (see `contract.py`).

A real graph replays the kernels recorded at capture on the captured addresses, without running Python. The
stand-in re-runs the step function at each replay, so on its own it would hide every bug a graph exposes. It
therefore runs the step under a dispatch-level probe (at capture and for the first `deep_replays` replays)
and compares each replay with the capture:

    check                              why a real graph breaks
    inputs: same objects, same         the graph reads the captured address; a rebound/resized input is
      data_ptr, shape, stride            never read
    outputs: same names/shapes/dtypes  a graph writes the captured shapes
    pre-existing outputs: same storage the graph's output is the captured tensor, not the one Python picks now
    op sequence and scalar arguments   the graph replays the captured work: host state cannot steer it
    no fresh tensor outlives the step  Python that stored it (self.x = t) does not re-run at replay
    no host sync / host data           .item(), nonzero, bool masks sync (capture fails); torch.tensor(list)
                                         is baked in at capture

Outputs the step freshly allocates are copied into the static outputs captured the first time, so callers
read static outputs exactly as on CUDA (and see them overwritten by the next replay, as on CUDA).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from specstep.cuda_graphs.contract import GraphContractError, GraphKey, StepFn

_SYNC_OPS = {"item", "_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "unique",
             "_unique", "_unique2", "unique_consecutive", "unique_dim", "allclose", "nonzero_static_", "tolist"}
_HOST_DATA_OPS = {"lift_fresh", "lift_fresh_copy"}
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except NotImplementedError:  # opaque layouts (oneDNN-prepacked weights): static, never a step's allocation
        return -id(t)


def _fingerprint(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


class _Probe(TorchDispatchMode):
    """Records one run of a step: op signature, fresh allocations (weakly), forbidden ops (raises)."""

    def __init__(self, key: GraphKey) -> None:
        super().__init__()
        self.key = key
        self.signature: list[tuple[Any, ...]] = []
        self.fresh: list[tuple[weakref.ref, int, tuple[int, ...]]] = []
        self.fresh_ptrs: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        leaves, _ = tree_flatten((args, kwargs))
        if name in _SYNC_OPS or (name == "index" and any(isinstance(x, torch.Tensor) and x.dtype == torch.bool
                                                         for x in leaves)):
            raise GraphContractError(f"step {self.key}: {func} synchronises with the host; it cannot be captured "
                                     "(keep data-dependent decisions on the device, e.g. torch.where)")
        if name in _HOST_DATA_OPS:
            raise GraphContractError(f"step {self.key}: a tensor is built from host data inside the step "
                                     "(torch.tensor(...)); a graph would replay the captured values. Pass it "
                                     "as an input instead")
        out = func(*args, **kwargs)
        in_ptrs = {_storage_ptr(x) for x in leaves if isinstance(x, torch.Tensor)}
        sig: list[Any] = [str(func)]
        for x in leaves:
            if isinstance(x, torch.Tensor):
                sig.append((tuple(x.shape), x.dtype))
            elif isinstance(x, _SCALARS):
                sig.append(x)
            else:
                sig.append(type(x).__name__)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                sig.append(("out", tuple(t.shape), t.dtype))
                ptr = _storage_ptr(t)
                if t.numel() and ptr not in in_ptrs:
                    self.fresh.append((weakref.ref(t), ptr, tuple(t.shape)))
                    self.fresh_ptrs.add(ptr)
        self.signature.append(tuple(sig))
        return out

    def escaped(self, allowed: set[int]) -> list[tuple[int, ...]]:
        """Shapes of fresh tensors still alive whose storage is not in `allowed`."""
        def alive() -> list[tuple[int, ...]]:
            return [shape for ref, ptr, shape in self.fresh if ref() is not None and ptr not in allowed]

        if alive():
            gc.collect()  # reference cycles may hold dead tensors for a while
        return alive()


class StandInGraph:
    """One captured step on the CPU: `outputs` are static, `replay()` recomputes them in place."""

    def __init__(self, fn: StepFn, inputs: Mapping[str, torch.Tensor], key: GraphKey,
                 deep_replays: int | None = 1) -> None:
        self.key = key
        self.inputs = dict(inputs)
        self._fn = fn
        self._deep_left = deep_replays
        self._in_fp = {n: _fingerprint(t) for n, t in self.inputs.items()}
        probe = _Probe(key)
        outs = self._call(probe)
        self.outputs = dict(outs)
        self._fresh = {n: _storage_ptr(t) in probe.fresh_ptrs for n, t in self.outputs.items()}
        self._out_fp = {n: _fingerprint(t) for n, t in self.outputs.items()}
        self._signature = probe.signature
        self._check_escapes(probe, allowed={_storage_ptr(t) for t in self.outputs.values()})
        self.nbytes = sum(t.numel() * t.element_size() for n, t in self.outputs.items() if self._fresh[n])

    def _call(self, probe: _Probe | None) -> dict[str, torch.Tensor]:
        self._check_inputs("before the step ran (static buffers were rebound or resized outside the step)")
        args = dict(self.inputs)
        if probe is not None:
            with probe:
                outs = self._fn(args, self.key)
        else:
            outs = self._fn(args, self.key)
        for n, t in self.inputs.items():
            if args.get(n) is not t or args.keys() != self.inputs.keys():
                raise GraphContractError(f"step {self.key} rebound input {n!r}; write inputs in place (copy_) "
                                         "so the graph's captured address sees the data")
        self._check_inputs("by the step (reallocated, resized or re-pointed with set_)")
        if not isinstance(outs, Mapping) or not all(isinstance(t, torch.Tensor) for t in outs.values()):
            raise GraphContractError(f"step {self.key} must return a mapping of name -> tensor")
        return dict(outs)

    def _check_inputs(self, when: str) -> None:
        for n, t in self.inputs.items():
            if _fingerprint(t) != self._in_fp[n]:
                was, now = self._in_fp[n], _fingerprint(t)
                raise GraphContractError(f"step {self.key}: static input {n!r} changed {when}: "
                                         f"shape {was[1]} -> {now[1]}, data_ptr {was[0]:#x} -> {now[0]:#x}")

    def _check_escapes(self, probe: _Probe, allowed: set[int]) -> None:
        leaked = probe.escaped(allowed)
        if leaked:
            raise GraphContractError(
                f"step {self.key} keeps {len(leaked)} tensor(s) it allocated alive after it returned (shapes "
                f"{leaked[:4]}); under a graph that memory belongs to the graph pool and the Python that stored "
                "it does not re-run at replay. Write state in place into buffers allocated outside the step, "
                "or return the tensor as an output")

    def replay(self) -> None:
        deep = self._deep_left is None or self._deep_left > 0
        if self._deep_left:
            self._deep_left -= 1
        probe = _Probe(self.key) if deep else None
        self._store(self._call(probe), probe)  # the step's own outputs die on return, before the escape check
        if probe is not None:
            if probe.signature != self._signature:
                raise GraphContractError(self._signature_diff(probe.signature))
            self._check_escapes(probe, allowed=set())

    def _store(self, outs: dict[str, torch.Tensor], probe: _Probe | None) -> None:
        if outs.keys() != self.outputs.keys():
            raise GraphContractError(f"step {self.key} returned outputs {sorted(outs)} at replay, "
                                     f"{sorted(self.outputs)} at capture")
        for n, t in outs.items():
            static = self.outputs[n]
            if (tuple(t.shape), t.dtype) != (tuple(static.shape), static.dtype):
                raise GraphContractError(f"step {self.key}: output {n!r} is {tuple(t.shape)} {t.dtype} at "
                                         f"replay, {tuple(static.shape)} {static.dtype} at capture; a graph "
                                         "writes the captured shape")
            if not self._fresh[n]:
                if _fingerprint(t) != self._out_fp[n]:
                    raise GraphContractError(f"step {self.key}: output {n!r} is a different tensor than at "
                                             "capture (its storage differs); a graph returns the captured one")
            elif probe is not None and _storage_ptr(t) not in probe.fresh_ptrs:
                raise GraphContractError(f"step {self.key}: output {n!r} was computed at capture but is a "
                                         "pre-existing tensor at replay; a graph returns the captured one")
            else:
                static.copy_(t)

    def _signature_diff(self, now: list[tuple[Any, ...]]) -> str:
        first = next((i for i, (a, b) in enumerate(zip(self._signature, now)) if a != b),
                     min(len(self._signature), len(now)))
        cap = self._signature[first] if first < len(self._signature) else "<end>"
        rep = now[first] if first < len(now) else "<end>"
        return (f"step {self.key}: its device work changed between capture and replay at op #{first}: captured "
                f"{cap}, now {rep}. A graph replays the captured kernels with the captured scalars, so host-side "
                "values must not steer the step (make them inputs, or part of the graph key)")


class StandInBackend:
    """Captures `StandInGraph`s; deep checks on the first `deep_replays` replays of each (None: always)."""

    name = "cpu-standin"

    def __init__(self, deep_replays: int | None = 1) -> None:
        self.deep_replays = deep_replays

    def warmup(self, fn: StepFn, inputs: Mapping[str, torch.Tensor], key: GraphKey, runs: int) -> None:
        for _ in range(runs):
            fn(dict(inputs), key)

    def capture(self, fn: StepFn, inputs: Mapping[str, torch.Tensor], key: GraphKey) -> StandInGraph:
        return StandInGraph(fn, inputs, key, self.deep_replays)
