"""Start-up in reading order: threads, device, load target (and proposer), plan memory and size the KV pools,
capture graphs, build the core."""

from __future__ import annotations

import os
from dataclasses import dataclass

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning OpenMP threads starve the other core

import torch  # noqa: E402

from specstep.engine.attention import make_backend, resolve_backend  # noqa: E402
from specstep.engine.engine_config import EngineConfig  # noqa: E402
from specstep.engine.errors import CheckpointError  # noqa: E402
from specstep.engine.kv_cache import KVPool  # noqa: E402
from specstep.engine.memory_plan import MemoryPlan, plan_kv_cache  # noqa: E402
from specstep.engine.memory_probe import (  # noqa: E402
    draft_carry_bytes,
    graph_count_estimate,
    host_ram_available,
    largest_steps,
    measure_cpu,
    measure_cuda,
)
from specstep.engine.model_loader import load_model, load_mtp_head  # noqa: E402
from specstep.engine.proposers.base import Proposer  # noqa: E402
from specstep.engine.proposers.draft_model import DraftModelProposer  # noqa: E402
from specstep.engine.proposers.draft_vocab import build_reduced_head  # noqa: E402
from specstep.engine.proposers.mtp import MTPProposer  # noqa: E402
from specstep.engine.proposers.ngram import NgramProposer  # noqa: E402
from specstep.engine.step_engine import StepEngine  # noqa: E402
from specstep.engine.stream import make_stream  # noqa: E402
from specstep.engine.tokenizer import Tokenizer  # noqa: E402
from specstep.scheduler.engine_core import EngineCore, SchedulerConfig  # noqa: E402
from specstep.scheduler.page_allocator import PageAllocator  # noqa: E402
from specstep.scheduler.spec_governor import GovernorConfig  # noqa: E402
from specstep.scheduler.spec_policy import AdaptivePolicy, PolicyConfig  # noqa: E402
from specstep.traces.tracer import NULL_TRACER, Tracer  # noqa: E402


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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_engine(cfg: EngineConfig, tracer: Tracer = NULL_TRACER) -> tuple[EngineCore, Tokenizer | None, EngineInfo]:
    device = resolve_device(cfg.device)
    if device.type == "cpu":
        # With overlap, the scheduler thread and the stream's worker thread each take a core: one intra-op
        # thread. Inline, both cores go to the matmuls (measured faster from batch 1 up on this machine kind).
        torch.set_num_threads(cfg.threads or (1 if cfg.overlap else 2))
    planned = cfg.num_pages is None and cfg.kv_cache_tokens is None
    # The CPU budget is a share of the RAM available before the weights load: they come out of it.
    ram = host_ram_available() if planned and device.type == "cpu" else 0
    target = load_model(cfg.model, device, cfg.dtype, cfg.cpu_linear)
    dtype = target.embed_tokens.weight.dtype
    max_len = min(cfg.max_model_len or target.cfg.max_position_embeddings, target.cfg.max_position_embeddings)
    # Pools of the dummy page only until memory is planned: the proposer's state, the attention backends and a
    # warm-up exist (and are measured) before the KV cache takes what is left.
    pool = KVPool(target.cfg, target.cfg.num_layers, 1, cfg.page_size, dtype, device)
    proposer = build_proposer(cfg, target, 1, dtype, device)
    if device.type == "cuda":  # device-track ranges timed by CUDA events, not by the launching thread
        tracer.use_cuda_events(torch.cuda)
    step_engine = StepEngine(target, pool, proposer, device, tracer)
    k_max = cfg.num_spec_tokens if proposer else 0
    attention = install_attention(cfg, step_engine, step_engine.max_kv_len(max_len, k_max), dtype, device)
    ks = graph_ks(k_max)
    use_graphs = cfg.graphs == "on" or (cfg.graphs == "auto" and device.type == "cuda")
    pools = [pool] + ([proposer.pool] if proposer is not None and proposer.has_model else [])
    memory = plan_memory(cfg, step_engine, pools, max_len, k_max, ram, ks if use_graphs else None)
    for p in pools:
        p.allocate(memory.num_pages)
    num_pages = memory.num_pages
    capture = None
    if use_graphs:
        from specstep.cuda_graphs.runner import GraphConfig, GraphRunner

        runner = GraphRunner(device, GraphConfig(max_batch=cfg.max_batch_size))
        capture = step_engine.use_graphs(runner, ks, max_len, scratch_slot=cfg.max_batch_size)
    try:
        tokenizer = Tokenizer.from_folder(cfg.model)
    except CheckpointError:
        tokenizer = None
    eos = target.cfg.eos_token_ids or (tokenizer.eos_token_ids if tokenizer else ())
    # A draft with a shorter context than the target drafts only while a request fits its context.
    spec_max_len = proposer.network.cfg.max_position_embeddings if proposer is not None and proposer.has_model \
        else None
    sched = SchedulerConfig(max_batch_size=cfg.max_batch_size, max_prefill_tokens=cfg.max_prefill_tokens,
                            max_num_batched_tokens=cfg.max_num_batched_tokens,
                            num_spec_tokens=cfg.num_spec_tokens if proposer else 0, max_model_len=max_len,
                            spec_max_len=spec_max_len)
    policy = AdaptivePolicy(policy_config(cfg, sched.num_spec_tokens, ks if capture is not None else None))
    core = EngineCore(step_engine, PageAllocator(num_pages, cfg.page_size), sched, eos, policy=policy,
                      stream=make_stream(device, cfg.overlap), tracer=tracer)
    info = EngineInfo(num_pages=num_pages, page_size=cfg.page_size, max_model_len=max_len,
                      vocab_size=target.cfg.vocab_size, device=str(device), dtype=str(dtype).replace("torch.", ""),
                      spec=cfg.spec, eos_token_ids=tuple(eos),
                      graphs=capture.to_dict() if capture is not None else None, attention=attention, memory=memory)
    return core, tokenizer, info


def plan_memory(cfg: EngineConfig, engine: StepEngine, pools: list[KVPool], max_len: int, k_max: int,
                ram: int, capture_ks: tuple[int, ...] | None) -> MemoryPlan:
    """The KV pools' size: as given (--num-pages, --kv-cache-tokens), else planned from measured memory
    (`engine.memory_plan`; `ram`: host RAM available before the weights loaded, CPU only; `capture_ks`: the k
    values graphs will be captured for, None without graphs)."""
    seq_tokens = engine.max_kv_len(max_len, k_max)
    figures = None
    if cfg.num_pages is None and cfg.kv_cache_tokens is None:
        shapes = largest_steps(cfg.max_batch_size, k_max, max_len, seq_tokens, cfg.page_size, cfg.max_prefill_tokens,
                               cfg.max_num_batched_tokens)
        carry = draft_carry_bytes(cfg.max_batch_size, k_max, engine.vocab_size) if engine.has_draft_model else 0
        roots = (engine.target, engine.proposer)
        if engine.device.type == "cuda":
            graphs = None if capture_ks is None else graph_count_estimate(
                cfg.max_batch_size, capture_ks, engine.has_draft_model,
                len(engine.kv_widths(engine.max_kv_len(max_len, max(capture_ks)))))
            figures = measure_cuda(engine.target, shapes, roots, cfg.page_size, engine.device,
                                   cfg.gpu_memory_utilization, carry, graphs)
        else:
            figures = measure_cpu(engine.target, shapes, roots, ram, cfg.gpu_memory_utilization, carry)
    return plan_kv_cache(sum(p.page_bytes for p in pools), cfg.page_size, seq_tokens, cfg.max_batch_size, figures,
                         cfg.kv_cache_tokens, cfg.num_pages)


def policy_config(cfg: EngineConfig, k_max: int, candidates: tuple[int, ...] | None) -> PolicyConfig:
    """The speculation policy for an engine: n-gram's eager ragged verify costs per draft row; model proposers
    and captured graphs pay per lane (see scheduler.spec_costs)."""
    latency = cfg.spec_objective == "latency"
    epsilon = cfg.spec_epsilon if cfg.spec_epsilon is not None else (0.005 if latency else 0.02)
    return PolicyConfig(kind=cfg.spec_policy, k_max=k_max, candidates=candidates, objective=cfg.spec_objective,
                        itl_budget=cfg.spec_itl_budget, keeps_draft_kv=cfg.spec in ("draft_model", "mtp"),
                        cost_shape="rows" if cfg.spec == "ngram" and candidates is None else "lanes",
                        governor=GovernorConfig(delta=cfg.spec_delta, epsilon=epsilon))


def install_attention(cfg: EngineConfig, engine: StepEngine, max_kv_len: int, dtype: torch.dtype,
                      device: torch.device) -> str:
    """Give the target and the proposer's network their attention backend (before graphs are captured)."""
    name = resolve_backend(cfg.attention, device)
    if name == "torch":
        return name
    max_pages = -(-max_kv_len // cfg.page_size)
    nets = [engine.target] + ([engine.proposer.network] if engine.has_draft_model else [])
    workspace = None
    for net in nets:
        net.attention = make_backend(name, net.cfg, cfg.page_size, dtype, device, max_pages, workspace)
        workspace = net.attention.workspace  # one float workspace: the models' kernels run in stream order
    return name


def graph_ks(k_max: int) -> tuple[int, ...]:
    """k values to capture: 0, powers of two below k_max, and k_max (speculation multiplies graph count)."""
    return tuple(sorted({0, k_max, *(2**i for i in range(5) if 2**i < k_max)}))


def build_proposer(cfg: EngineConfig, target, num_pages: int, dtype: torch.dtype,
                   device: torch.device) -> Proposer | None:
    if cfg.spec == "none":
        return None
    if cfg.spec == "ngram":
        return NgramProposer(device)
    path = cfg.draft_path
    if cfg.spec == "draft_model":
        draft = load_model(path, device, str(dtype).replace("torch.", ""), cfg.cpu_linear)
        pool = KVPool(draft.cfg, draft.cfg.num_layers, num_pages, cfg.page_size, dtype, device)
        reduced = build_reduced_head(draft.lm_head.weight, path, draft.cfg.vocab_size, cfg.draft_vocab,
                                     cfg.cpu_linear)
        return DraftModelProposer(draft, target.cfg.vocab_size, pool, cfg.max_batch_size + 1, device, reduced)
    head = load_mtp_head(path, target.cfg, device, dtype, cfg.cpu_linear)
    pool = KVPool(head.cfg, 1, num_pages, cfg.page_size, dtype, device)
    reduced = build_reduced_head(target.lm_head.weight, path, target.cfg.vocab_size, cfg.draft_vocab, cfg.cpu_linear)
    # max_batch_size + 1: a scratch row for padding lanes
    return MTPProposer(head, target, pool, cfg.max_batch_size + 1, device, reduced)
