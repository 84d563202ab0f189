"""MTP / EAGLE-style draft head: one decoder layer over (target hidden state, next-token embedding).

At position i the head sees the target's hidden state h[i] and the embedding of token t[i+1] (the one-position
shift of DeepSeek-V3's MTP), and predicts t[i+2]:

    x = fc([rmsnorm(h[i]) ; rmsnorm(embed(t[i+1]))])  ->  decoder layer (own paged KV)  ->  rmsnorm  ->  lm_head

The RMSNorms EAGLE dropped are restored (they made training converge). Embedding and lm_head are the
target's own, frozen and shared: the caller passes embeddings in and applies the target's `compute_logits`, so
this module holds only its own weights. Its output plays the role of a target hidden state, which is what it
feeds forward when drafting more than one token.

Under tensor parallelism the head shards with the target (same group): its decoder layer splits like the target's,
`fc` and the norms are replicated (their inputs are the replicated hidden states and embeddings), and its KV pool
takes `rank_cfg`. Every rank runs it, because its layer's collectives need every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from specstep.engine.attention.backend import AttentionBackend
from specstep.engine.attention.torch_backend import TorchAttention
from specstep.engine.config import ModelConfig
from specstep.engine.forward_batch import ForwardBatch
from specstep.engine.kv_cache import KVPool
from specstep.engine.models.llama import LlamaDecoderLayer, RMSNorm
from specstep.engine.models.rotary import RotaryEmbedding
from specstep.engine.parallel.group import SINGLE, TPGroup


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.rank_cfg = cfg.shard(tp.world_size)
        d = cfg.hidden_size
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.embed_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList([LlamaDecoderLayer(self.rank_cfg, 0, tp)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.attention: AttentionBackend = TorchAttention()  # the engine may install FlashInfer (see LlamaForCausalLM)

    def _fuse(self, token_embeds: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.hidden_norm(target_hidden), self.embed_norm(token_embeds)], dim=-1))

    def forward(self, batch: ForwardBatch, kv: KVPool, token_embeds: torch.Tensor,
                target_hidden: torch.Tensor) -> torch.Tensor:
        x = self._fuse(token_embeds, target_hidden)
        return self.norm(self.layers[0](x, batch, kv, self.rotary.cos_sin(batch.positions, x.dtype), self.attention))

    def forward_dense(self, token_embeds: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        """Training path over [B, S] sequences, causal, no cache."""
        positions = torch.arange(token_embeds.shape[1], device=token_embeds.device)
        x = self._fuse(token_embeds, target_hidden)
        return self.norm(self.layers[0].forward_dense(x, self.rotary.cos_sin(positions, x.dtype)))
