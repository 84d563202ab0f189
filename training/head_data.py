"""The head's training data: target features computed through specstep's own inference path.

`PagedRunner` runs the target (and optionally the head, as the engine's `MTPProposer`) over whole windows the
way the engine's verify step does: a paged `ForwardBatch` over a `KVPool`. `precompute` turns windows into
`TargetFeatures` (fp16 final hidden states + the top-k log-probabilities of the next token), and `FeaturePool`
holds a bounded ring of them for training to draw batches from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specstep.engine.batch_builder import build_forward_batch
from specstep.engine.kv_cache import KVPool
from specstep.engine.models.llama import LlamaForCausalLM
from specstep.engine.models.mtp_head import MTPHead
from specstep.engine.proposers.mtp import MTPProposer

PAGE_SIZE = 16


def topk_index_dtype(vocab_size: int) -> torch.dtype:
    return torch.int16 if vocab_size <= 32767 else torch.int32


@dataclass(slots=True)
class TargetFeatures:
    tokens: torch.Tensor  # [N, S] int64
    hidden: torch.Tensor  # [N, S, d] fp16: the target's final (normed) hidden states
    top_logp: torch.Tensor  # [N, S, k] fp16: log-probabilities of the target's top-k next tokens
    top_idx: torch.Tensor  # [N, S, k] int16 (int32 for vocabularies over 32k)


class PagedRunner:
    """Runs the target (and a head) over whole windows through the serving path: paged KV, ForwardBatch."""

    def __init__(self, target: LlamaForCausalLM, max_windows: int, seq_len: int, head: MTPHead | None = None):
        self.target = target
        self.device = target.device
        self.max_windows = max_windows
        dtype = target.dtype
        self.pages_per_window = -(-seq_len // PAGE_SIZE)
        num_pages = 1 + max_windows * self.pages_per_window  # page 0 is the dummy page
        self.pool = KVPool(target.cfg, target.cfg.num_layers, num_pages, PAGE_SIZE, dtype, self.device)
        self.proposer = None
        if head is not None:
            head_pool = KVPool(head.cfg, 1, num_pages, PAGE_SIZE, dtype, self.device)
            self.proposer = MTPProposer(head, target, head_pool, max_windows, self.device)

    def _batch(self, ids: Sequence[Sequence[int]]):
        ppw = self.pages_per_window
        tables = [list(range(1 + b * ppw, 1 + (b + 1) * ppw)) for b in range(len(ids))]
        return build_forward_batch(ids, np.zeros(len(ids), np.int64), tables, PAGE_SIZE, self.device)

    @torch.no_grad()
    def target_hidden(self, windows: torch.Tensor) -> torch.Tensor:
        """[B, S] -> [B, S, d] final hidden states, from one paged prefill per window."""
        b, s = windows.shape
        return self.target(self._batch(windows.tolist()), self.pool).view(b, s, -1)

    @torch.no_grad()
    def head_hidden(self, tokens: torch.Tensor, hidden_in: torch.Tensor) -> torch.Tensor:
        """The head's serving forward: tokens [B, S'] (t[i+1]) with hidden_in [B, S', d] (h[i]) -> [B, S', d]."""
        assert self.proposer is not None
        b, s = tokens.shape
        fb = self._batch(tokens.tolist())
        return self.proposer.forward(fb, hidden_in.reshape(b * s, -1)).view(b, s, -1)


def precompute(runner: PagedRunner, windows: torch.Tensor, topk: int, batch: int,
               on_batch: Callable[[int], None] | None = None) -> TargetFeatures:
    n, s = windows.shape
    d = runner.target.cfg.hidden_size
    idx_dtype = topk_index_dtype(runner.target.cfg.vocab_size)
    hidden = torch.empty(n, s, d, dtype=torch.float16)
    top_logp = torch.empty(n, s, topk, dtype=torch.float16)
    top_idx = torch.empty(n, s, topk, dtype=idx_dtype)
    for i in range(0, n, batch):
        chunk = windows[i : i + batch]
        h = runner.target_hidden(chunk)
        logp = torch.log_softmax(runner.target.compute_logits(h), dim=-1)
        vals, idx = logp.topk(topk, dim=-1)
        hidden[i : i + len(chunk)] = h.to(torch.float16)
        top_logp[i : i + len(chunk)] = vals.clamp_min(-60.0).to(torch.float16)
        top_idx[i : i + len(chunk)] = idx.to(idx_dtype)
        if on_batch:
            on_batch(len(chunk))
    return TargetFeatures(windows.clone(), hidden, top_logp, top_idx)


class FeaturePool:
    """A bounded ring of precomputed windows; training draws batches uniformly from what is filled."""

    def __init__(self, capacity: int, seq_len: int, d: int, topk: int, idx_dtype: torch.dtype) -> None:
        self.capacity = capacity
        self.tokens = torch.zeros(capacity, seq_len, dtype=torch.int64)
        self.hidden = torch.zeros(capacity, seq_len, d, dtype=torch.float16)
        self.top_logp = torch.zeros(capacity, seq_len, topk, dtype=torch.float16)
        self.top_idx = torch.zeros(capacity, seq_len, topk, dtype=idx_dtype)
        self.filled = 0
        self.cursor = 0
        self.added = 0

    def add(self, f: TargetFeatures) -> None:
        for j in range(f.tokens.shape[0]):
            c = self.cursor
            self.tokens[c], self.hidden[c] = f.tokens[j], f.hidden[j]
            self.top_logp[c], self.top_idx[c] = f.top_logp[j], f.top_idx[j]
            self.cursor = (c + 1) % self.capacity
            self.filled = min(self.filled + 1, self.capacity)
            self.added += 1

    def sample(self, batch: int, rng: np.random.Generator) -> TargetFeatures:
        pick = torch.from_numpy(rng.integers(0, self.filled, size=batch))
        return TargetFeatures(self.tokens[pick], self.hidden[pick], self.top_logp[pick], self.top_idx[pick])
