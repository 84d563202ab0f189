"""Llama-family decoder (Llama 2/3, Qwen2, Mistral without sliding window).

Two ways in, one set of weights:
  * serving: flat tokens [T] with a `ForwardBatch` and a paged `KVPool` (prefill, decode and verify alike);
  * training: dense [B, S] causal batches without a cache (`forward_dense`).
q/k/v and gate/up projections are merged (one GEMM each); the loader splits Hugging Face tensors into them.

Tensor parallelism (`tp`, default a single rank) changes only shapes and adds collectives: each rank builds its
share of the heads, KV heads, MLP width and vocabulary (`ModelConfig.shard`, `engine.parallel.shard`) out of plain
`nn.Linear`s (so the CPU's `CpuLinear` swap still applies), the ranks' partial sums are all-reduced after o_proj,
down_proj and the embedding, and `compute_logits` gathers the vocabulary. Hidden states between layers are
replicated on every rank, so every rank must run every forward and `compute_logits` in the same order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specstep.engine.attention.backend import AttentionBackend
from specstep.engine.attention.torch_backend import TorchAttention, dense_causal_attention, store_kv
from specstep.engine.config import ModelConfig
from specstep.engine.forward_batch import ForwardBatch
from specstep.engine.kv_cache import KVPool
from specstep.engine.models.rotary import RotaryEmbedding, apply_rotary
from specstep.engine.parallel.group import SINGLE, TPGroup
from specstep.engine.parallel.vocab_embedding import VocabParallelEmbedding

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) for the batch's positions


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # the CPU case: no casts (3 ops less)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Hugging Face normalises in float32 and casts back; so do we, so half-precision logits agree.
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class LlamaAttention(nn.Module):
    """`cfg` is this rank's share (its heads and KV heads); o_proj is row-parallel, so its output is all-reduced."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.layer_id = layer_id
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        # Llama with attention_bias has an o_proj bias too; Qwen2 has q/k/v biases only.
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.attention_bias and cfg.architecture != "qwen2")
        self.scale = cfg.head_dim**-0.5

    def _qkv(self, x: torch.Tensor, rope: Rope):
        cfg = self.cfg
        qk, v = self.qkv_proj(x).split([cfg.q_size + cfg.kv_size, cfg.kv_size], dim=-1)
        # Rotate q and k heads together: one rotary application per layer.
        qk = apply_rotary(qk.unflatten(-1, (cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)), *rope)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=-2)
        return q, k, v.unflatten(-1, (cfg.num_kv_heads, cfg.head_dim))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVPool, rope: Rope,
                attention: AttentionBackend) -> torch.Tensor:
        q, k, v = self._qkv(x, rope)
        k_cache, v_cache = kv.k[self.layer_id], kv.v[self.layer_id]
        store_kv(k_cache, v_cache, k, v, batch.slot_mapping)
        o = attention.forward(q.flatten(1), k_cache, v_cache, batch.attn, self.cfg.num_heads, self.scale)
        return self.tp.all_reduce(self.o_proj(o))

    def forward_dense(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        q, k, v = self._qkv(x, rope)  # [B, S, heads, D]
        o = dense_causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.scale)
        return self.tp.all_reduce(self.o_proj(o.transpose(1, 2).flatten(2)))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVPool, rope: Rope,
                attention: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, kv, rope, attention)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_dense(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        x = x + self.self_attn.forward_dense(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """`forward` returns the final (normed) hidden states; `compute_logits` applies `lm_head`.

    Keeping them apart lets the engine compute logits only at the positions it samples from, and hands the
    hidden states to an MTP head. `attention` is the paged-attention backend every layer uses (the torch
    reference unless the engine installs FlashInfer); it is state of the serving path, not of the weights.

    `cfg` is the whole model's; `rank_cfg` is this rank's share, which its KV pool and attention backend take.
    """

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.rank_cfg = cfg.shard(tp.world_size)  # raises ParallelError if the heads do not split
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(self.rank_cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Column-parallel over the (padded) vocabulary: the same rows as this rank's embedding shard.
        self.lm_head = nn.Linear(cfg.hidden_size, self.embed_tokens.num_embeddings, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.attention: AttentionBackend = TorchAttention()
        # The decoder layers in C++ where the loader installed them (`engine.models.decode_layers`: GGUF linears
        # on CPU); not a module: it points at these layers' weights.
        self.native = None

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the final norm's (the embedding may be a GGUF table of blocks, whose `weight`
        dequantises the whole table)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def forward(self, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        rope = self.rotary.cos_sin(batch.positions, x.dtype)
        # a pool the C++ layers do not write keeps the torch ops
        if self.native is not None and self.native.runs(kv):
            return self.native.forward(x, batch, kv, rope, self.attention)  # its own final norm
        for layer in self.layers:
            x = layer(x, batch, kv, rope, self.attention)
        return self.norm(x)

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed_tokens(input_ids)
        rope = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer.forward_dense(x, rope)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.tp.world_size > 1:
            # Every rank gets the whole vocabulary (sampling runs on any rank); padding rows are cut off.
            logits = self.tp.all_gather(logits, dim=-1)[..., : self.cfg.vocab_size].contiguous()
        return logits.float()
