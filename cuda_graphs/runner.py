"""GraphRunner: capture once per (step kind, batch bucket, tokens per request), replay with live inputs.

Start-up (after the KV pools are sized, so graph memory comes out of what is left):

    runner = GraphRunner(device, GraphConfig(max_batch=cfg.max_batch_size, memory_budget=...))
    runner.register(StepKind("decode", decode_fn, decode_inputs, q_values=(1,)))
    runner.register(StepKind("verify", verify_fn, verify_inputs, q_values=(k + 1,)))
    ...
    info = runner.capture()          # -> CaptureInfo (buckets, graph count, seconds, bytes) for the ready message
                                     #    (`describe_capture(info.to_dict())`: the ready line's words)

Each step:   outputs = runner.run("verify", q=k + 1, inputs={...live tensors...}, batch=len(seqs))

`run` picks the smallest bucket >= batch, copies each live input into the bucket's slice of that input's
static buffer (`copy_`, non-blocking: pass device or pinned tensors), fills the padding lanes with the
input's pad value, replays, and returns the static outputs sliced to the live lanes. Batches above the
largest bucket, kinds or q values not registered, and every call when `GraphConfig.enabled` is False run
the same step function eagerly.

How the engine uses it (`engine/step_graphs.py`, the graph-safe decode step):
  * Step functions take only tensors (see `contract.py`): per lane `start` [B], token ids [B * q], the page
    table [B, P] at a fixed width P (covering max_model_len plus a uniform lane's k + 1 writes and the
    proposer's look-ahead), sampling tensors, carried-state slots. Host flags that change the work (all greedy,
    refill dropped) are part of the kind's name; k is the key's q - 1.
  * Every lane feeds q = k + 1 verify tokens, with a per-lane q_lens input (num_draft + 1) that masks the
    unused tail; the tail's KV writes land in look-ahead slots the request reserved, or on the dummy page.
  * Pad values: page tables -> DUMMY_PAGE (padding lanes then write only the dummy page), start -> 0, ids -> 0,
    carried-state slots -> a scratch row reserved for padding (never a live request's slot).
  * `run` is called from inside the device stream's job, so input copies, replay and later reads stay ordered.
    Outputs are read (or copied) before the next replay of the same graph: they are overwritten in place.
  * An attention backend that plans (FlashInfer) plans an all-padding batch in `StepKind.prepare` before each
    capture, and the live lengths into the same buffers before each replay.
  * Prefill stays eager (ragged lengths); so do batches above the largest bucket.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch

from specstep.cuda_graphs.buckets import bucket_for, default_buckets, plan_buckets
from specstep.cuda_graphs.contract import BufferSpec, GraphContractError, GraphKey, StepKind, lanes_of
from specstep.cuda_graphs.cpu_standin import StandInBackend
from specstep.traces import ranges
from specstep.traces.tracer import NULL_TRACER, Tracer

log = logging.getLogger("specstep.graphs")


@dataclass(frozen=True, slots=True)
class GraphConfig:
    enabled: bool = True
    max_batch: int = 64
    buckets: tuple[int, ...] | None = None  # candidates; default: 1, 2, 4, 8, 16, 32, ... max_batch
    memory_budget: int | None = None  # bytes for static outputs + graph objects; None: no limit
    overhead_per_graph: int = 4 << 20  # estimate of one graph object's driver memory
    warmup_runs: int = 2
    deep_check_replays: int | None = 1  # CPU stand-in: probed replays per graph (None: every replay)


@dataclass(frozen=True, slots=True)
class CaptureInfo:
    """What capture learned (values for the ready message, never written back into a config)."""

    backend: str
    buckets: tuple[int, ...]
    graphs: int
    seconds: float
    nbytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def describe_capture(graphs: Mapping | None) -> str:
    """The ready line's account of start-up capture (`CaptureInfo.to_dict()`; None: graphs off, ''): how many
    graphs and how long they took, the part of start-up that grows with buckets, widths and k values."""
    if graphs is None:
        return ""
    return f"{graphs['graphs']} graphs captured in {graphs['seconds']:.1f} s ({graphs['backend']})"


class GraphRunner:
    def __init__(self, device: torch.device | str, config: GraphConfig = GraphConfig(), backend=None) -> None:
        self.device = torch.device(device)
        self.config = config
        if backend is None:
            backend = (_cuda_backend(self.device) if self.device.type == "cuda"
                       else StandInBackend(config.deep_check_replays))
        self.backend = backend
        self.buckets: tuple[int, ...] = ()
        self._kinds: dict[str, StepKind] = {}
        self._static: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self._graphs: dict[GraphKey, object] = {}
        self._dirty: dict[tuple[str, int], int] = {}  # lanes that may hold live data (not padding)
        self._spec_cache: dict[tuple[str, int], dict[str, BufferSpec]] = {}
        self.replays = 0  # steps served by a graph (the rest ran eagerly)

    def register(self, kind: StepKind) -> None:
        if self._graphs:
            raise RuntimeError("register every step kind before capture()")
        self._kinds[kind.name] = kind

    # ---- start-up ----------------------------------------------------------------------------------------

    def capture(self, tracer: Tracer = NULL_TRACER) -> CaptureInfo:
        cfg = self.config
        if not cfg.enabled or not self._kinds:
            return CaptureInfo(self.backend.name, (), 0, 0.0, 0)
        t0 = time.perf_counter()
        cands = [b for b in (cfg.buckets or default_buckets(cfg.max_batch)) if b <= cfg.max_batch]
        graph_ids = [(k.name, q) for k in self._kinds.values() for q in k.q_values]
        with tracer.range(ranges.CAPTURE), torch.inference_mode():
            per_lane = [self._output_bytes_per_lane(kind, q) for kind, q in graph_ids]
            self.buckets = plan_buckets(cands, per_lane, cfg.memory_budget, cfg.overhead_per_graph)
            if len(self.buckets) < len(set(cands)):
                log.warning("graph memory budget %s B keeps buckets %s of %s; larger batches run eagerly",
                            cfg.memory_budget, self.buckets, sorted(set(cands)))
            if not self.buckets:
                return CaptureInfo(self.backend.name, (), 0, time.perf_counter() - t0, 0)
            for kind, q in graph_ids:
                self._static[(kind, q)] = self._allocate(kind, q, self.buckets[-1])
                self._dirty[(kind, q)] = 0
            total = 0
            for bucket in reversed(self.buckets):  # largest first: smaller graphs reuse its pool memory
                for kind, q in graph_ids:
                    total += self._capture_one(GraphKey(kind, bucket, q))
        info = CaptureInfo(self.backend.name, self.buckets, len(self._graphs), time.perf_counter() - t0, total)
        log.info("captured %d graphs (%s) for buckets %s in %.2f s, %.1f MiB", info.graphs, info.backend,
                 info.buckets, info.seconds, info.nbytes / 2**20)
        return info

    def _allocate(self, kind: str, q: int, lanes: int) -> dict[str, torch.Tensor]:
        specs = self._specs(kind, q)
        with torch.inference_mode(False):  # normal tensors: `run` may update them outside inference mode
            return {n: torch.full(s.shape(lanes), s.pad, dtype=s.dtype, device=self.device)
                    for n, s in specs.items()}

    def _output_bytes_per_lane(self, kind: str, q: int) -> int:
        step, key = self._kinds[kind], GraphKey(kind, 1, q)
        if step.prepare is not None:
            step.prepare(key)
        outs = step.fn(self._allocate(kind, q, 1), key)
        return sum(t.numel() * t.element_size() for t in outs.values())

    def _capture_one(self, key: GraphKey) -> int:
        step = self._kinds[key.kind]
        specs = self._specs(key.kind, key.q)
        static = self._static[(key.kind, key.q)]
        inputs = {n: static[n][: s.rows * key.batch] for n, s in specs.items()}
        t = time.perf_counter()
        if step.prepare is not None:
            step.prepare(key)
        self.backend.warmup(step.fn, inputs, key, self.config.warmup_runs)
        graph = self.backend.capture(step.fn, inputs, key)
        self._graphs[key] = graph
        log.info("captured %s in %.1f ms, %.2f MiB", key, (time.perf_counter() - t) * 1e3, graph.nbytes / 2**20)
        return graph.nbytes

    def _specs(self, kind: str, q: int) -> Mapping[str, BufferSpec]:
        specs = self._spec_cache.get((kind, q))
        if specs is None:
            specs = self._spec_cache[(kind, q)] = dict(self._kinds[kind].inputs(q))
        return specs

    # ---- per step ----------------------------------------------------------------------------------------

    def bucket_for(self, batch: int) -> int | None:
        return bucket_for(self.buckets, batch) if self.config.enabled else None

    def has_graph(self, kind: str, q: int, batch: int) -> bool:
        bucket = self.bucket_for(batch)
        return bucket is not None and GraphKey(kind, bucket, q) in self._graphs

    def run(self, kind: str, q: int, inputs: Mapping[str, torch.Tensor], batch: int) -> Mapping[str, torch.Tensor]:
        """Outputs of step `kind` over `batch` live lanes: replayed from a graph when one fits, else eager."""
        step = self._kinds[kind]
        specs = self._specs(kind, q)
        if inputs.keys() != specs.keys():
            raise GraphContractError(f"{kind}: inputs {sorted(inputs)} do not match the registered {sorted(specs)}")
        for n, s in specs.items():
            t = inputs[n]
            if tuple(t.shape) != s.shape(batch) or t.dtype != s.dtype:
                raise GraphContractError(f"{kind} input {n!r}: got {tuple(t.shape)} {t.dtype}, expected "
                                         f"{s.shape(batch)} {s.dtype} for {batch} lanes at q={q}")
        bucket = self.bucket_for(batch)
        graph = self._graphs.get(GraphKey(kind, bucket, q)) if bucket is not None else None
        with torch.inference_mode():
            if graph is None:
                return step.fn(dict(inputs), GraphKey(kind, batch, q))
            self._load(graph.inputs, (kind, q), specs, inputs, batch, bucket)
            graph.replay()
            self.replays += 1
        return {n: t[: batch * lanes_of(t, bucket)] for n, t in graph.outputs.items()}

    def _load(self, static: Mapping[str, torch.Tensor], ident: tuple[str, int], specs,
              inputs: Mapping[str, torch.Tensor], batch: int, bucket: int) -> None:
        """Copy live lanes into the graph's own static views in place; pad only the lanes that a previous,
        larger batch left live data in (the buckets of one (kind, q) share one buffer)."""
        dirty = self._dirty[ident]
        for n, s in specs.items():
            buf = static[n]
            buf[: batch * s.rows].copy_(inputs[n], non_blocking=True)
            if dirty > batch:
                buf[batch * s.rows: min(dirty, bucket) * s.rows].fill_(s.pad)
        self._dirty[ident] = dirty if dirty > bucket else batch


def _cuda_backend(device: torch.device):
    from specstep.cuda_graphs.cuda_graph import CudaGraphBackend

    return CudaGraphBackend(device)
