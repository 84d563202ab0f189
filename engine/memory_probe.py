"""Measured memory figures for the KV plan (`engine.memory_plan` does the arithmetic).

Start-up order (`scheduler.build`): note host RAM (CPU) -> load the weights -> build the proposer, the step engine
and the attention backends over pools of the dummy page only -> measure here -> size the pools -> capture graphs.

CUDA (`measure_cuda`, torch >= 2.4 API only): a warm-up forward of the target, with its real attention backend,
at each of the largest steps the scheduler can form (`largest_steps`), measures the transient peak
(`max_memory_allocated` above what was allocated before it); then, the allocator's cache emptied,
`mem_get_info` says what is in use (weights, proposer state, CUDA context and library workspaces, other
processes). Graphs are captured after the KV pool exists (they record its addresses), so the graph pool is a
documented *estimate*, not a measurement: a pool keeps the intermediates of its largest capture (the decode step
at the largest bucket; smaller buckets and the other graphs reuse that memory), so the reserve is the decode
step's measured eager peak plus `GraphConfig.overhead_per_graph` for each graph expected.

Only the target is warmed up: the proposer's forwards are smaller and run after one another; what it keeps
across a verify (the drafts' distributions, [B, k, V] float32) is added by formula (`draft_carry_bytes`).

CPU (`measure_cpu`): no warm-up (a prefill of thousands of tokens costs seconds here): activations come from a
bounded formula over the same shapes (`step_peak_bytes`), weights from the tensors reachable from the models and
the proposer (`resident_bytes`: each storage once, plus CPU linears' oneDNN-packed copies, which are resident
too). No graph reserve: the CPU stand-in keeps only static inputs and outputs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from specstep.cuda_graphs.buckets import default_buckets
from specstep.engine.attention.torch_backend import DEFAULT_WORKSPACE, TorchAttention, attention_blocks
from specstep.engine.batch_builder import build_forward_batch
from specstep.engine.config import ModelConfig
from specstep.engine.errors import ConfigError
from specstep.engine.kv_cache import DUMMY_PAGE, KVPool
from specstep.engine.memory_plan import GiB, MemoryFigures
from specstep.engine.sampler import sample
from specstep.engine.sampling_params import SamplingParams, SamplingTensors
from specstep.engine.step_graphs import decode_graph_ids

CUDA_DEFAULT_UTILIZATION = 0.9  # vLLM's default
# Host RAM is shared with the OS, the frontend, other processes and often other engines (test machines run
# several at once in 24 GiB), and `torch.zeros` commits every page of the pool at start-up. So the CPU default
# takes half of what is available and at most 4 GiB of KV (vLLM's CPU backend defaults to a fixed 4 GiB too);
# an explicit --gpu-memory-utilization lifts the cap.
CPU_DEFAULT_UTILIZATION = 0.5
CPU_DEFAULT_KV_CAP = 4 * GiB
WARMUP_PARAMS = SamplingParams(temperature=1.0, top_p=0.9)  # the sampler's costliest path (a full sort)


@dataclass(frozen=True, slots=True)
class StepShape:
    """One target forward the scheduler may form: rows of q_lens[i] new tokens from starts[i], keys gathered over
    a page table `width` tokens wide, logits at `logit_rows` rows."""

    name: str
    q_lens: tuple[int, ...]
    starts: tuple[int, ...]
    width: int
    logit_rows: int


def largest_steps(max_batch_size: int, k_max: int, max_model_len: int, seq_tokens: int, page_size: int,
                  max_prefill_tokens: int, max_num_batched_tokens: int | None) -> tuple[StepShape, StepShape]:
    """The largest decode (verify) step and the largest prefill or mixed step, at the longest sequences.

    decode : max_batch_size rows x (k + 1) tokens, keys over the full page-table width (a graph's, too).
    prefill: whole prompts: the longest prompt (max_model_len - 1; the first prompt of a step may exceed
             max_prefill_tokens), as many of them as max_prefill_tokens admits; chunked: every other running
             request decoding one token beside one chunk of what is left of the token budget."""
    width = -(-seq_tokens // page_size) * page_size
    q = k_max + 1
    longest = max(1, max_model_len - 1)
    decode = StepShape("decode", (q,) * max_batch_size, (max(0, longest - q),) * max_batch_size, width,
                       max_batch_size * q)
    if max_num_batched_tokens is None:
        rows = max(1, min(max_batch_size, max_prefill_tokens // longest))
        prefill = StepShape("prefill", (longest,) * rows, (0,) * rows, width, rows)
    else:
        d = max(0, min(max_batch_size - 1, max_num_batched_tokens - 1))
        chunk = min(max_num_batched_tokens - d, longest)
        prefill = StepShape("mixed prefill", (1,) * d + (chunk,), (longest - 1,) * d + (longest - chunk,), width,
                            d + 1)
    return decode, prefill


def step_peak_bytes(cfg: ModelConfig, shape: StepShape, elem: int, workspace: int = DEFAULT_WORKSPACE,
                    min_rows: int | None = None) -> int:
    """An upper estimate of one eager target forward's transient memory with the torch attention backend.

    Per layer: the residual stream, its norm and the attention output; q/k/v before and after rotation, and the
    queries' [B, Q] grid and its output; the attention's largest block (`attention_blocks`: gathered keys and
    values with their casts and the mask, at most the backend's `workspace` however long the context; SDPA's
    fused CPU kernels do not materialise the scores: measured; the batch-invariant path's scores, with its row
    padding `min_rows`, are counted); the MLP's gate/up and product. Then float32 logits at the sampled rows,
    the sampler's probabilities and its sort (values and int64 indices)."""
    t, rows, qn = sum(shape.q_lens), len(shape.q_lens), max(shape.q_lens)
    group = cfg.num_heads // cfg.num_kv_heads
    stream = t * (2 * cfg.hidden_size + cfg.q_size) * elem
    qkv = 2 * t * (cfg.q_size + 2 * cfg.kv_size) * elem
    grid = 2 * rows * qn * cfg.q_size * elem
    attention = attention_blocks(rows, qn, shape.width, cfg.num_kv_heads, group, cfg.head_dim, elem, elem,
                                 1, workspace, min_rows).nbytes
    mlp = 3 * t * cfg.intermediate_size * elem
    logits = shape.logit_rows * cfg.vocab_size * (4 + 4 + 4 + 8)
    return stream + qkv + grid + attention + mlp + logits


def draft_carry_bytes(max_batch_size: int, k_max: int, vocab_size: int) -> int:
    """What a model proposer keeps across the verify: its drafts' distributions [B, k, V] in float32."""
    return max_batch_size * k_max * vocab_size * 4


def graph_count_estimate(max_batch_size: int, ks: Sequence[int], has_draft_model: bool, widths: int = 1) -> int:
    """Graphs a capture makes: the (flavour, q) pairs decode steps form (`engine.step_graphs.decode_graph_ids`,
    counted as if the policy drops refills: never fewer than without) per default bucket, at each of `widths`
    page-table widths (the torch attention backend's KV-length buckets, `StepEngine.graph_widths`)."""
    pairs = sum(len(q) for _, q in decode_graph_ids(tuple(ks), drops_refill=has_draft_model))
    return widths * len(default_buckets(max_batch_size)) * pairs


def resident_bytes(*roots: object, device_type: str | None = None) -> int:
    """Bytes of the tensors reachable from `roots` (through modules, and the attributes, lists, tuples and dicts
    of the engine's own objects), each storage counted once; `device_type`: count only tensors there.
    oneDNN-packed weights (opaque tensors without a storage) count as their elements."""
    seen: set[int] = set()
    storages: dict[tuple[str, int], int] = {}
    stack = list(roots)
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if x.is_meta or (device_type is not None and x.device.type != device_type):
                continue
            if x.layout == torch.strided:
                s = x.untyped_storage()
                storages[(str(x.device), s.data_ptr())] = s.nbytes()
            else:
                storages[("opaque", id(x))] = x.numel() * x.element_size()
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, nn.Module) or type(x).__module__.startswith("specstep."):
            stack.extend(getattr(x, "__dict__", {}).values())
            stack.extend(getattr(x, n, None) for c in type(x).__mro__ for n in getattr(c, "__slots__", ()))
    return sum(storages.values())


def host_ram_available() -> int:
    """Host RAM the kernel could hand out now without swapping (Linux: MemAvailable; elsewhere, free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def measure_cpu(target: nn.Module, shapes: Sequence[StepShape], roots: Sequence[object], available: int,
                utilization: float | None, carry: int = 0, ranks: int = 1) -> MemoryFigures:
    """CPU figures: `available` is host RAM measured before the weights were loaded (so they come out of it);
    `ranks`: tensor-parallel ranks sharing the host (the default KV cap is the server's, split between them)."""
    elem = target.dtype.itemsize
    weights = resident_bytes(*roots)
    cfg, att = target.rank_cfg, target.attention
    workspace, rows = DEFAULT_WORKSPACE, None
    if isinstance(att, TorchAttention):  # its batch-invariant path's row padding is measured for this CPU
        workspace = att.workspace
        rows = att.min_rows(cfg.num_heads // cfg.num_kv_heads, cfg.head_dim, target.dtype,
                            torch.device("cpu"))
    activations = max(step_peak_bytes(cfg, s, elem, workspace, rows) for s in shapes) + carry  # this rank's share
    return MemoryFigures("cpu", available, utilization or CPU_DEFAULT_UTILIZATION, weights, weights, activations,
                         0, CPU_DEFAULT_KV_CAP // ranks if utilization is None else None, "activations estimated")


def warm_up(target: nn.Module, shape: StepShape, page_size: int, device: torch.device) -> None:
    """One forward of `shape` over a pool of the dummy page alone (every key read and write lands there), then
    sampling at its logit rows: the memory a real step of this shape allocates."""
    dtype = target.dtype
    # This rank's KV heads (tensor parallelism: a shard's keys are [T, Hkv / N, D]).
    pool = KVPool(target.rank_cfg, target.cfg.num_layers, 1, page_size, dtype, device)
    table = [DUMMY_PAGE] * (shape.width // page_size)
    n = shape.logit_rows
    with torch.inference_mode():
        fb = build_forward_batch([[0] * q for q in shape.q_lens], list(shape.starts), [table] * len(shape.q_lens),
                                 page_size, device, target.attention, "prefill")
        hidden = target(fb, pool)
        logits = target.compute_logits(hidden[-n:])
        st = SamplingTensors.build([WARMUP_PARAMS] * n, [0] * n, target.cfg.vocab_size, device)
        sample(logits, st, torch.zeros(n, dtype=torch.long, device=device))


def measure_cuda(target: nn.Module, shapes: Sequence[StepShape], roots: Sequence[object], page_size: int,
                 device: torch.device, utilization: float | None, carry: int = 0, graph_count: int | None = None,
                 overhead_per_graph: int = 4 << 20, cuda=torch.cuda) -> MemoryFigures:
    """CUDA figures (see the module docstring). `graph_count`: graphs to reserve for (None: graphs off).
    `cuda`: the torch.cuda namespace (tests pass a stand-in)."""
    peaks = {}
    for shape in shapes:
        cuda.synchronize(device)
        cuda.reset_peak_memory_stats(device)
        before = cuda.memory_allocated(device)
        try:
            warm_up(target, shape, page_size, device)
        except torch.cuda.OutOfMemoryError:  # torch.OutOfMemoryError only from 2.5
            raise ConfigError(f"the warm-up {shape.name} step ({len(shape.q_lens)} rows, {sum(shape.q_lens)} tokens, "
                              f"keys over {shape.width} positions) ran out of device memory: lower --max-batch-size, "
                              "--max-model-len or --max-prefill-tokens / --max-num-batched-tokens") from None
        cuda.synchronize(device)
        peaks[shape.name] = max(0, cuda.max_memory_allocated(device) - before)
    cuda.empty_cache()  # what the warm-up freed is not in use: mem_get_info should not count the cache
    free, total = cuda.mem_get_info(device)
    decode = peaks.get("decode", max(peaks.values())) + carry
    graphs = 0 if graph_count is None else decode + graph_count * overhead_per_graph
    return MemoryFigures("cuda", total, utilization or CUDA_DEFAULT_UTILIZATION, total - free,
                         resident_bytes(*roots, device_type="cuda"), max(peaks.values()) + carry, graphs, None,
                         "activations measured by a warm-up; graphs estimated")
