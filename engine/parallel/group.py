"""The tensor-parallel group: which rank this process is, and the collectives the sharded model calls.

World size 1 is the default everywhere (`SINGLE`): no process group exists and every collective returns its input
untouched, so a one-device model pays a method call per layer and nothing else.

`init_tp_group` forms a group of N processes (one per rank, one device each). The rendezvous store is ours, not
`init_process_group`'s, so that joining is checked the same way on every backend: each rank writes a key, every
rank waits for all of them with a deadline, and a rank that never comes raises `ParallelError` naming it. (NCCL
creates its communicators lazily, so without this a missing rank would only show as a hang in the first
collective.) Only the backend differs between GPU (NCCL) and CPU (gloo); the calls are the same.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from specstep.engine.errors import ParallelError

BACKENDS = ("auto", "nccl", "gloo")
_JOINED = "specstep/tp/joined/"


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    world_size: int = 1
    rank: int = 0
    backend: str = "none"  # "gloo" | "nccl" once a group is formed; "none" at world size 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ParallelError(f"rank {self.rank} is outside a tensor-parallel group of {self.world_size}")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


class TPGroup:
    """A formed group (from `init_tp_group`), or, with `group=None`, a description of one rank's place in a group:
    enough to build and load that rank's shard on `meta`/CPU (tests, sizing), though its collectives cannot run."""

    __slots__ = ("config", "_group", "_store", "_cpu_group")

    def __init__(self, config: ParallelConfig, group: dist.ProcessGroup | None = None,
                 store: dist.Store | None = None, cpu_group: dist.ProcessGroup | None = None) -> None:
        self.config = config
        self._group = group
        self._store = store  # kept alive: a TCP store's server lives in the leader's object
        self._cpu_group = cpu_group if cpu_group is not None else group  # host objects (gloo)

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def rank(self) -> int:
        return self.config.rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (row-parallel outputs, the vocabulary-parallel embedding)."""
        if self.config.world_size > 1:
            dist.all_reduce(x, group=self._need_group())
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order (vocabulary-parallel logits)."""
        if self.config.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.config.world_size)]
        dist.all_gather(parts, x, group=self._need_group())
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`src`'s `x` on every rank, in place (the leader's step inputs)."""
        if self.config.world_size > 1:
            dist.broadcast(x, src=src, group=self._need_group())
        return x

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """`src`'s picklable host object on every rank (the leader's step messages), over the gloo group."""
        if self.config.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self._cpu_group if self._cpu_group is not None
                                   else self._need_group())
        return box[0]

    def min(self, value: int) -> int:
        """The smallest of every rank's `value` (memory plans: every rank must size the same KV pool)."""
        if self.config.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._cpu_group)
        return int(t.item())

    def close(self) -> None:
        if self._group is not None:
            dist.destroy_process_group()
            self._group = self._cpu_group = None

    def _need_group(self) -> dist.ProcessGroup:
        if self._group is None:
            raise ParallelError(f"rank {self.rank} of {self.world_size} describes a group that was never formed "
                                "(use init_tp_group to run collectives)")
        return self._group

    def __repr__(self) -> str:
        c = self.config
        return f"TPGroup(rank={c.rank}, world_size={c.world_size}, backend={c.backend!r})"


SINGLE = TPGroup(ParallelConfig())


def init_tp_group(world_size: int, rank: int, init_method: str, backend: str = "auto",
                  device: torch.device | str | None = None, join_timeout_s: float = 60.0,
                  timeout_s: float = 600.0, alive: Callable[[], str | None] | None = None) -> TPGroup:
    """Join (or, as rank 0, host) the group at `init_method` (`tcp://host:port`, `file:///path`, `env://`).

    `auto` picks NCCL for a CUDA `device` (default: CUDA when present) and gloo otherwise. Every rank waits at most
    `join_timeout_s` for the others; `timeout_s` bounds each collective afterwards. A `file://` path must be fresh
    for each start of the group: a crashed group's file still holds its ranks' keys."""
    ParallelConfig(world_size, rank)  # validates the rank before anything connects
    if world_size == 1:
        return SINGLE
    if dist.is_initialized():
        raise ParallelError("this process already belongs to a process group")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    backend = _resolve_backend(backend, device)
    if backend == "nccl":
        # One device per rank on one machine: rank r drives cuda:r unless told otherwise.
        torch.cuda.set_device(device if device.index is not None else rank % torch.cuda.device_count())
    store = _connect_store(init_method, world_size, rank, join_timeout_s)
    _wait_for_ranks(store, init_method, world_size, rank, join_timeout_s, alive)
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as e:
        raise ParallelError(f"rank {rank}: could not form the {backend} group at {init_method}: {e}") from e
    # Host messages travel over gloo; with NCCL that is a second group beside the device one.
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    return TPGroup(ParallelConfig(world_size, rank, backend), dist.group.WORLD, store, cpu_group)


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ParallelError(f"tensor-parallel backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    available = dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()
    if not dist.is_available() or not available:
        raise ParallelError(f"torch.distributed backend {backend!r} is not available in this torch build")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ParallelError("the nccl backend needs CUDA devices")
    return backend


def _connect_store(init_method: str, world_size: int, rank: int, timeout_s: float) -> dist.Store:
    url = urlparse(init_method)
    timeout = timedelta(seconds=timeout_s)
    try:
        if url.scheme == "file":
            return dist.FileStore(url.path, world_size)
        if url.scheme in ("tcp", "env"):
            host, port = ((url.hostname, url.port) if url.scheme == "tcp" else
                          (os.environ.get("MASTER_ADDR"), int(os.environ.get("MASTER_PORT", "0")) or None))
            if not host or not port:
                raise ParallelError(f"{init_method}: needs a host and a port (MASTER_ADDR/MASTER_PORT for env://)")
            # The leader serves the store; followers retry connecting until the deadline.
            return dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                                 wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        raise ParallelError(f"rank {rank}: could not reach the tensor-parallel group's store at {init_method} "
                            f"within {timeout_s:g} s: {e}") from e
    raise ParallelError(f"unsupported init method {init_method!r} (use tcp://host:port, file:///path or env://)")


def _wait_for_ranks(store: dist.Store, init_method: str, world_size: int, rank: int, timeout_s: float,
                    alive: Callable[[], str | None] | None = None) -> None:
    """Until every rank has joined, or the deadline; `alive` (the leader, which started the others) says why a
    rank can no longer join (its process exited), so start-up fails at once instead of at the deadline."""
    keys = [f"{_JOINED}{r}" for r in range(world_size)]
    store.set(keys[rank], "1")
    deadline = time.monotonic() + timeout_s
    # Polled with `check` (no waits that time out: c10d logs a warning for each).
    while missing := [r for r, key in enumerate(keys) if not store.check([key])]:
        dead = alive() if alive is not None else None
        if dead or time.monotonic() >= deadline:
            why = dead or f"did not join within {timeout_s:g} s"
            raise ParallelError(f"rank {rank}: rank(s) {missing} of the tensor-parallel group at {init_method} {why}")
        time.sleep(0.05)
