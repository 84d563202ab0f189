"""Start-up in reading order: threads, device, load target (and proposer), plan memory and size the KV pools,
capture graphs, build the core."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning OpenMP threads starve the other core

import torch  # noqa: E402

from specstep.engine.attention import make_backend, resolve_backend  # noqa: E402
from specstep.engine.engine_config import EngineConfig  # noqa: E402
from specstep.engine.errors import CheckpointError, ConfigError  # noqa: E402
from specstep.engine.kv_cache import KVPool  # noqa: E402
from specstep.engine.memory_plan import KVCacheTooSmall, MemoryPlan, plan_kv_cache  # noqa: E402
from specstep.engine.memory_probe import (  # noqa: E402
    draft_carry_bytes,
    graph_count_estimate,
    host_ram_available,
    largest_steps,
    measure_cpu,
    measure_cuda,
)
from specstep.engine.model_loader import describe_cpu_kernels, load_model, load_mtp_head  # noqa: E402
from specstep.engine.parallel.group import SINGLE, TPGroup  # noqa: E402
from specstep.engine.parallel.tp_engine import LeaderDraft, LeaderEngine  # noqa: E402
from specstep.engine.proposers.base import Proposer  # noqa: E402
from specstep.engine.proposers.draft_model import DraftModelProposer  # noqa: E402
from specstep.engine.proposers.draft_vocab import build_reduced_head  # noqa: E402
from specstep.engine.proposers.mtp import MTPProposer  # noqa: E402
from specstep.engine.proposers.ngram import NgramProposer  # noqa: E402
from specstep.engine.step_engine import StepEngine  # noqa: E402
from specstep.engine.stream import make_stream  # noqa: E402
from specstep.engine.tokenizer import Tokenizer  # noqa: E402
from specstep.scheduler.core.engine_core import EngineCore, SchedulerConfig  # noqa: E402
from specstep.scheduler.core.page_allocator import PageAllocator  # noqa: E402
from specstep.scheduler.core.prefill_budget import resolve_budget  # noqa: E402
from specstep.scheduler.parallel.tp_group import start_tp_group  # noqa: E402
from specstep.scheduler.spec import cost_store  # noqa: E402
from specstep.scheduler.spec.governor import GovernorConfig  # noqa: E402
from specstep.scheduler.spec.policy import AdaptivePolicy, PolicyConfig  # noqa: E402
from specstep.traces.tracer import NULL_TRACER, Tracer  # noqa: E402

log = logging.getLogger("specstep.build")


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Values learned at start-up (returned, never written back into the config)."""

    num_pages: int
    page_size: int
    max_model_len: int
    vocab_size: int
    device: str
    dtype: str
    spec: str
    eos_token_ids: tuple[int, ...]
    graphs: dict | None = None  # what capture learned (buckets, graph count, seconds, bytes)
    attention: str = "torch"
    memory: MemoryPlan | None = None  # how the KV cache was sized (`MemoryPlan.describe()` for the ready line)
    tensor_parallel_size: int = 1
    prefill: str = ""  # chunked prefill's budget and how it was chosen (`PrefillBudget.describe()`)
    kernels: str = ""  # CPU: the target's linears and attention, and why (`describe_cpu_kernels`)


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """`auto`: CUDA when present. A tensor-parallel rank r drives cuda:r (one device per rank, one machine)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    return torch.device("cuda", rank) if device.type == "cuda" and device.index is None and rank else device


@dataclass(slots=True)
class StepEngineParts:
    """What every rank builds (`build_step_engine`); the leader builds the core around it."""

    step_engine: StepEngine
    memory: MemoryPlan
    capture: object | None  # CaptureInfo
    attention: str
    max_len: int
    ks: tuple[int, ...]


def build_engine(cfg: EngineConfig, tracer: Tracer = NULL_TRACER) -> tuple[EngineCore, Tokenizer | None, EngineInfo]:
    """The leader's engine: with tensor parallelism it first starts the follower ranks (`scheduler.parallel.tp_group`),
    which build the same step engine on their shards and replay its steps."""
    if cfg.tensor_parallel_size > 1 and cfg.device.startswith("cuda:"):
        raise ConfigError(f"--device {cfg.device} with --tensor-parallel-size {cfg.tensor_parallel_size}: rank r "
                          "uses cuda:r; give --device cuda (or auto) and choose GPUs with CUDA_VISIBLE_DEVICES")
    group = start_tp_group(cfg) if cfg.tensor_parallel_size > 1 else None
    if group is not None:
        # While building, a follower that fails normally fails the leader too (same code, or a gloo collective
        # that raises); the grace period lets that error surface. NCCL would leave the leader waiting instead.
        group.watch(grace_s=15.0)
    try:
        parts = build_step_engine(cfg, tracer, group.tp if group else SINGLE)
    except BaseException:
        if group is not None:  # leave the group first: followers blocked in a collective then fail at once
            group.tp.close()
            group.stop()
        raise
    step_engine, max_len, ks = parts.step_engine, parts.max_len, parts.ks
    target, proposer = step_engine.target, step_engine.proposer
    try:
        tokenizer = Tokenizer.from_folder(cfg.model)
    except CheckpointError:
        tokenizer = None
    eos = target.cfg.eos_token_ids or (tokenizer.eos_token_ids if tokenizer else ())
    # A draft with a shorter context than the target drafts only while a request fits its context.
    spec_max_len = proposer.max_context if proposer is not None else None
    engine = step_engine
    if group is not None:
        engine = LeaderEngine(step_engine, group.tp, group)
        group.watch()  # built: from now on a follower's death ends this process at once (TPGroupHandle.watch)
    num_pages = parts.memory.num_pages
    # Timed through `engine`: with tensor parallelism the followers run the same probe steps.
    budget = resolve_budget(cfg, engine, num_pages, max_len,
                            fused=group is None and step_engine.fuses_mixed_steps)
    sched = SchedulerConfig(max_batch_size=cfg.max_batch_size, max_prefill_tokens=cfg.max_prefill_tokens,
                            prefill_budget=budget, num_spec_tokens=cfg.num_spec_tokens if proposer else 0,
                            max_model_len=max_len, spec_max_len=spec_max_len)
    policy = AdaptivePolicy(policy_config(cfg, sched.num_spec_tokens, ks if parts.capture is not None else None),
                            step_cost_store(cfg, step_engine, ks if parts.capture is not None else None))
    core = EngineCore(engine, PageAllocator(num_pages, cfg.page_size), sched, eos, policy=policy,
                      stream=make_stream(step_engine.device, cfg.overlap), tracer=tracer)
    info = EngineInfo(num_pages=num_pages, page_size=cfg.page_size, max_model_len=max_len,
                      vocab_size=target.cfg.vocab_size, device=str(step_engine.device),
                      dtype=str(target.dtype).replace("torch.", ""),
                      spec=cfg.spec, eos_token_ids=tuple(eos),
                      graphs=parts.capture.to_dict() if parts.capture is not None else None,
                      attention=parts.attention, memory=parts.memory,
                      tensor_parallel_size=cfg.tensor_parallel_size,
                      prefill=budget.describe() if budget else "whole-prompt prefill (chunked prefill off)",
                      kernels=describe_cpu_kernels(target))
    return core, tokenizer, info


def build_step_engine(cfg: EngineConfig, tracer: Tracer = NULL_TRACER, tp: TPGroup = SINGLE) -> StepEngineParts:
    """Threads, device, target (this rank's shard) and proposer, memory plan and KV pools, graphs."""
    device = resolve_device(cfg.device, tp.rank)
    if device.type == "cpu":
        set_cpu_threads(cfg, tp)
    planned = cfg.num_pages is None and cfg.kv_cache_tokens is None
    # The CPU budget is a share of the RAM available before the weights load: they come out of it.
    ram = host_ram_available() // tp.world_size if planned and device.type == "cpu" else 0
    if cfg.activations not in ("fp32", "auto") and device.type != "cpu":
        raise ConfigError(f"--activations {cfg.activations} is the CPU GGUF kernel's: not on {device.type}")
    target = load_model(cfg.model, device, cfg.dtype, cfg.cpu_kernels, tp=tp)
    if cfg.activations not in ("fp32", "auto") and not any(getattr(m, "activations", "fp32") != "fp32"
                                             for m in target.modules()):
        raise ConfigError(f"--activations {cfg.activations} runs in the GGUF kernel: {cfg.model} is not a GGUF "
                          f"checkpoint it reads ({target.gguf_note or 'no GGUF blocks'})")
    dtype = target.dtype
    kv_dtype = cache_dtype(cfg, dtype, device)
    max_len = min(cfg.max_model_len or target.cfg.max_position_embeddings, target.cfg.max_position_embeddings)
    # Pools of the dummy page only until memory is planned: the proposer's state, the attention backends and a
    # warm-up exist (and are measured) before the KV cache takes what is left.
    pool = KVPool(target.rank_cfg, target.cfg.num_layers, 1, cfg.page_size, kv_dtype, device)
    proposer = build_proposer(cfg, target, 1, dtype, device, tp, kv_dtype)
    if device.type == "cuda":  # device-track ranges timed by CUDA events, not by the launching thread
        tracer.use_cuda_events(torch.cuda)
    step_engine = StepEngine(target, pool, proposer, device, tracer, tp)
    k_max = cfg.num_spec_tokens if proposer else 0
    attention = install_attention(cfg, step_engine, step_engine.max_kv_len(max_len, k_max), dtype, device)
    ks = graph_ks(k_max)
    use_graphs = wants_graphs(cfg, device, tp)
    pools = [pool] + ([proposer.pool] if proposer is not None and proposer.pool is not None else [])
    memory, max_len = plan_memory_within(cfg, step_engine, pools, max_len, k_max, ram, ks if use_graphs else None)
    if kv_dtype != dtype:
        memory = dataclasses.replace(memory, kv_dtype=str(kv_dtype).replace("torch.", ""))
    pages = tp.min(memory.num_pages)  # every rank addresses the same pages: the smallest plan wins
    if pages != memory.num_pages:
        memory = dataclasses.replace(memory, num_pages=pages, limit="the smallest tensor-parallel rank's plan")
    for p in pools:
        p.allocate(memory.num_pages)
    capture = capture_graphs(cfg, step_engine, ks, max_len, k_max) if use_graphs else None
    return StepEngineParts(step_engine, memory, capture, attention, max_len, ks)


def set_cpu_threads(cfg: EngineConfig, tp: TPGroup) -> None:
    # With overlap, the scheduler thread and the stream's worker thread each take a core: one intra-op
    # thread. Inline, both cores go to the matmuls (measured faster from batch 1 up on this machine kind).
    # Tensor-parallel ranks share the machine's cores.
    threads = cfg.threads or (1 if cfg.overlap else 2)
    torch.set_num_threads(max(1, threads // tp.world_size) if cfg.threads is None else threads)


def wants_graphs(cfg: EngineConfig, device: torch.device, tp: TPGroup) -> bool:
    """Whether steps run as captured graphs: CUDA graphs (`--graphs`), or on CPU the contract-checking stand-in
    (`graph_standin`, library-only: tests); ConfigError for a combination that cannot."""
    if device.type == "cuda":
        if cfg.graph_standin:
            raise ConfigError("graph_standin is the CPU stand-in of CUDA graphs; on CUDA the steps are captured "
                              "as CUDA graphs (--graphs)")
        return cfg.graphs != "off"
    if cfg.graphs == "on":
        raise ConfigError(f"--graphs on needs a CUDA device; on {device.type} the steps run eagerly")
    use_graphs = cfg.graph_standin and cfg.graphs != "off"
    if use_graphs and tp.world_size > 1:
        # The CPU stand-in checks that a step keeps nothing it allocated alive; gloo's collectives hold their
        # buffers past the call, so it cannot check these steps. CUDA graphs capture NCCL collectives.
        raise ConfigError("the CPU graph stand-in does not run with --tensor-parallel-size > 1 (it cannot check "
                          "steps with gloo collectives)")
    return use_graphs


def capture_graphs(cfg: EngineConfig, engine: StepEngine, ks: tuple[int, ...], max_len: int, k_max: int):
    """Capture the step graphs over batch buckets and `ks`, once the KV pools are allocated; the CaptureInfo."""
    from specstep.cuda_graphs.runner import GraphConfig, GraphRunner

    # The device's own backend: CUDA graphs, or the contract-checking stand-in on CPU.
    runner = GraphRunner(engine.device, GraphConfig(max_batch=cfg.max_batch_size))
    return engine.use_graphs(runner, ks, max_len, scratch_slot=cfg.max_batch_size,
                             drops_refill=policy_config(cfg, k_max, ks).drops_refill)


def plan_memory(cfg: EngineConfig, engine: StepEngine, pools: list[KVPool], max_len: int, k_max: int,
                ram: int, capture_ks: tuple[int, ...] | None) -> MemoryPlan:
    """The KV pools' size: as given (--num-pages, --kv-cache-tokens), else planned from measured memory
    (`engine.memory_plan`; `ram`: host RAM available before the weights loaded, CPU only; `capture_ks`: the k
    values graphs will be captured for, None without graphs)."""
    seq_tokens = engine.max_kv_len(max_len, k_max)
    figures = None
    if cfg.num_pages is None and cfg.kv_cache_tokens is None:
        shapes = largest_steps(cfg.max_batch_size, k_max, max_len, seq_tokens, cfg.page_size, cfg.max_prefill_tokens,
                               cfg.max_num_batched_tokens or None)
        carry = draft_carry_bytes(cfg.max_batch_size, k_max, engine.vocab_size) if engine.has_draft_model else 0
        roots = (engine.target, engine.proposer)
        if engine.device.type == "cuda":
            graphs = None if capture_ks is None else graph_count_estimate(
                cfg.max_batch_size, capture_ks, engine.has_draft_model,
                len(engine.kv_widths(engine.max_kv_len(max_len, max(capture_ks)))))
            figures = measure_cuda(engine.target, shapes, roots, cfg.page_size, engine.device,
                                   cfg.gpu_memory_utilization, carry, graphs)
        else:
            figures = measure_cpu(engine.target, shapes, roots, ram, cfg.gpu_memory_utilization, carry,
                                  engine.tp.world_size)
    return plan_kv_cache(sum(p.page_bytes for p in pools), cfg.page_size, seq_tokens, cfg.max_batch_size, figures,
                         cfg.kv_cache_tokens, cfg.num_pages)


def plan_memory_within(cfg: EngineConfig, engine: StepEngine, pools: list[KVPool], max_len: int, k_max: int,
                       ram: int, capture_ks: tuple[int, ...] | None) -> tuple[MemoryPlan, int]:
    """`plan_memory` at the longest length that fits, up to `max_len`. Where one sequence of the checkpoint's
    own length cannot fit, the engine starts at the longest that does and says so in one warning (a user who only
    wants the model to run should not need a second try); an explicit --max-model-len that does not fit is a
    `ConfigError` naming the length that would. Each retry re-plans (activations shrink with the length too)."""
    asked = max_len
    while True:
        try:
            memory = plan_memory(cfg, engine, pools, max_len, k_max, ram, capture_ks)
            break
        except KVCacheTooSmall as e:
            lookahead = engine.max_kv_len(max_len, k_max) - max_len
            fits = (e.pages - 1) * cfg.page_size - lookahead  # what the memory left over by this plan holds
            shorter = fits if fits >= cfg.page_size else max_len // 2  # nothing left: the activations must shrink
            if shorter < cfg.page_size or shorter >= max_len:
                raise
            max_len = shorter
    if max_len < asked:
        if cfg.max_model_len is not None:
            raise ConfigError(f"--max-model-len {asked:,} does not fit in the memory planned for the KV cache: "
                              f"{max_len:,} would (or raise --gpu-memory-utilization, lower --max-batch-size)")
        log.warning("max_model_len %s (the checkpoint's) does not fit in the memory planned for the KV cache: "
                    "starting with %s, the longest that fits (--max-model-len sets it; --gpu-memory-utilization "
                    "gives the plan more memory)", f"{asked:,}", f"{max_len:,}")
    return memory, max_len


def policy_config(cfg: EngineConfig, k_max: int, candidates: tuple[int, ...] | None) -> PolicyConfig:
    """The speculation policy for an engine: n-gram's eager ragged verify costs per draft row; model proposers
    and captured graphs pay per lane (see scheduler.spec.costs)."""
    latency = cfg.spec_objective == "latency"
    epsilon = cfg.spec_epsilon if cfg.spec_epsilon is not None else (0.005 if latency else 0.02)
    return PolicyConfig(kind=cfg.spec_policy, k_max=k_max, candidates=candidates, objective=cfg.spec_objective,
                        itl_budget=cfg.spec_itl_budget, keeps_draft_kv=cfg.spec in ("draft_model", "mtp"),
                        cost_shape="rows" if cfg.spec == "ngram" and candidates is None else "lanes",
                        governor=GovernorConfig(delta=cfg.spec_delta, epsilon=epsilon))


def step_cost_store(cfg: EngineConfig, engine: StepEngine,
                    graph_ks: tuple[int, ...] | None) -> cost_store.StepCostStore | None:
    """Where the adaptive policy keeps its measured step costs across runs: per model, proposer, host and kernel
    plan (`scheduler.spec.cost_store`); None without a proposer or with a fixed k."""
    if engine.proposer is None or cfg.spec_policy != "adaptive":
        return None
    device = engine.device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cost_store.host_id()
    key = {"model": str(Path(cfg.model).resolve()), "spec": cfg.spec,
           "draft": str(Path(cfg.draft_path).resolve()) if cfg.draft_path else "", "host": where,
           "kernels": describe_cpu_kernels(engine.target), "dtype": str(engine.target.dtype),
           "threads": str(torch.get_num_threads()), "stream": "overlap" if cfg.overlap else "inline",
           "graphs": ",".join(map(str, graph_ks)) if graph_ks else "eager", "attention": cfg.attention,
           "k_max": str(cfg.num_spec_tokens), "draft_vocab": str(cfg.draft_vocab),
           "tensor_parallel_size": str(cfg.tensor_parallel_size)}
    return cost_store.StepCostStore(cost_store.store_folder(), key)


def install_attention(cfg: EngineConfig, engine: StepEngine, max_kv_len: int, dtype: torch.dtype,
                      device: torch.device) -> str:
    """Give the target and the proposer's network their attention backend (before graphs are captured)."""
    name = resolve_backend(cfg.attention, device)
    if name == "torch":
        return name
    max_pages = -(-max_kv_len // cfg.page_size)
    # A follower's draft model lives on the leader (`LeaderDraft` has no network): nothing of it attends there.
    draft = engine.proposer.network if engine.proposer is not None else None
    nets = [engine.target] + ([draft] if draft is not None else [])
    workspace = None
    for net in nets:
        net.attention = make_backend(name, net.rank_cfg, cfg.page_size, dtype, device, max_pages, workspace)
        workspace = net.attention.workspace  # one float workspace: the models' kernels run in stream order
    return name


def graph_ks(k_max: int) -> tuple[int, ...]:
    """k values to capture: 0, powers of two below k_max, and k_max (speculation multiplies graph count)."""
    return tuple(sorted({0, k_max, *(2**i for i in range(5) if 2**i < k_max)}))


def cache_dtype(cfg: EngineConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pools' dtype (`--kv-cache-dtype`): the model's (`dtype`) unless a CPU engine asks for another."""
    if cfg.kv_cache_dtype == "auto":
        return dtype
    chosen = getattr(torch, cfg.kv_cache_dtype)
    if device.type != "cpu" and chosen != dtype:
        raise ConfigError(f"--kv-cache-dtype {cfg.kv_cache_dtype}: on {device.type} the KV cache holds the model's "
                          f"dtype ({str(dtype).replace('torch.', '')}); give auto")
    return chosen


def build_proposer(cfg: EngineConfig, target, num_pages: int, dtype: torch.dtype,
                   device: torch.device, tp: TPGroup, kv_dtype: torch.dtype) -> Proposer | None:
    """The proposer `cfg.spec` names; a model proposer's weights in `dtype`, its KV pool in `kv_dtype` (the
    target's: `--kv-cache-dtype` covers every pool)."""
    if cfg.spec == "none":
        return None
    if cfg.spec == "ngram":
        return NgramProposer(device, match_ratio=cfg.ngram_match_ratio)
    path = cfg.draft_path
    if cfg.spec == "draft_model":
        if tp.rank != 0:  # the draft runs on the leader only; followers receive its drafts
            return LeaderDraft(DraftModelProposer.kv_lookahead, device)
        draft = load_model(path, device, str(dtype).replace("torch.", ""), cfg.cpu_kernels)
        pool = KVPool(draft.cfg, draft.cfg.num_layers, num_pages, cfg.page_size, kv_dtype, device)
        reduced = build_reduced_head(draft.lm_head.weight, path, draft.cfg.vocab_size, cfg.draft_vocab,
                                     cfg.cpu_kernels)
        return DraftModelProposer(draft, target.cfg.vocab_size, pool, cfg.max_batch_size + 1, device, reduced)
    head = load_mtp_head(path, target.cfg, device, dtype, cfg.cpu_kernels, tp=tp)
    pool = KVPool(head.rank_cfg, 1, num_pages, cfg.page_size, kv_dtype, device)
    # A reduced draft vocabulary takes rows of the full lm_head, which a tensor-parallel rank does not hold: the
    # head drafts over the full (gathered) vocabulary there.
    reduced = None if tp.world_size > 1 else build_reduced_head(target.lm_head.weight, path, target.cfg.vocab_size,
                                                                cfg.draft_vocab, cfg.cpu_kernels)
    # max_batch_size + 1: a scratch row for padding lanes
    return MTPProposer(head, target, pool, cfg.max_batch_size + 1, device, reduced)
