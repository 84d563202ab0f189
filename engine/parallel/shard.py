"""Which part of each checkpoint tensor a tensor-parallel rank holds (Megatron's split, vLLM's names).

Rank r of N, H attention heads, Hkv KV heads, head size D, MLP width I, vocabulary V padded to Vp = N * ceil(V / N):

    checkpoint tensor            split      rank r holds                      layer kind
    q_proj      [H*D, d]         rows       heads [r*H/N, (r+1)*H/N)          column-parallel (merged into qkv_proj)
    k/v_proj    [Hkv*D, d]       rows       KV heads [r*Hkv/N, (r+1)*Hkv/N)   column-parallel (merged into qkv_proj)
                                            or, if N > Hkv: KV head r*Hkv//N (replicated on N/Hkv ranks)
    o_proj      [d, H*D]         columns    the columns of its own q heads    row-parallel: partial sums, all-reduced
    gate/up     [I, d]           rows       [r*I/N, (r+1)*I/N)                column-parallel (merged into gate_up)
    down_proj   [d, I]           columns    the same block of I               row-parallel
    embed_tokens, lm_head [V, d] rows       [r*Vp/N, (r+1)*Vp/N), rows >= V   vocabulary-parallel
                                            zero
    o/down bias [d]              -          rank 0: the bias; others: zeros   (the all-reduce adds it once)
    norms, the MTP head's fc     -          everything                        replicated

q/k/v biases split like their weights. Zeros (rather than no bias) on ranks > 0 keep the same parameter names on
every rank, so the loader's strict checks fail alike everywhere. The MTP head's `fc` is replicated as in vLLM's
EAGLE heads: its input is replicated, and splitting it would cost a collective per draft step to save d x 2d.
"""

from __future__ import annotations

from dataclasses import dataclass

from specstep.engine.config import ModelConfig
from specstep.engine.parallel.group import ParallelConfig

ZEROS = "zeros"  # this rank holds zeros of the tensor's shape (row-parallel biases beyond rank 0)


@dataclass(frozen=True, slots=True)
class RankSlice:
    """Indices [start, stop) along `dim` of a checkpoint tensor that holds `global_size` there; the rank's
    parameter has `size` >= stop - start along `dim` (the vocabulary's last shard is zero-padded)."""

    dim: int
    start: int
    stop: int
    global_size: int
    size: int


def vocab_shard(vocab_size: int, tp: ParallelConfig) -> tuple[int, int]:
    """(first token id, rows) of this rank's vocabulary shard; every rank holds the same number of rows."""
    rows = -(-vocab_size // tp.world_size)
    return tp.rank * rows, rows


def rank_slice(name: str, cfg: ModelConfig, tp: ParallelConfig) -> RankSlice | str | None:
    """What rank `tp.rank` holds of the checkpoint tensor `name` (a pre-merge local name, e.g.
    `layers.0.self_attn.k_proj.weight`): a `RankSlice`, `ZEROS`, or None for all of it (replicated, or N = 1)."""
    if tp.world_size == 1:
        return None
    *_, module, kind = name.split(".")
    r, n = tp.rank, tp.world_size
    share = cfg.shard(n)
    d = cfg.head_dim
    if module == "q_proj":
        return _block(0, r * share.q_size, share.q_size, cfg.q_size)
    if module in ("k_proj", "v_proj"):
        first = r * cfg.num_kv_heads // n  # one head shared by N/Hkv consecutive ranks when N > Hkv
        return _block(0, first * d, share.kv_size, cfg.kv_size)
    if module in ("gate_proj", "up_proj"):
        return _block(0, r * share.intermediate_size, share.intermediate_size, cfg.intermediate_size)
    if module in ("o_proj", "down_proj"):
        if kind == "bias":
            return None if r == 0 else ZEROS
        width, total = ((share.q_size, cfg.q_size) if module == "o_proj"
                        else (share.intermediate_size, cfg.intermediate_size))
        return _block(1, r * width, width, total)
    if module in ("embed_tokens", "lm_head"):
        start, rows = vocab_shard(cfg.vocab_size, tp)
        return RankSlice(0, min(start, cfg.vocab_size), min(start + rows, cfg.vocab_size), cfg.vocab_size, rows)
    return None


def _block(dim: int, start: int, size: int, total: int) -> RankSlice:
    return RankSlice(dim, start, start + size, total, size)
