"""`mtp`: the EAGLE-style one-layer head over the target's hidden states, sharing its embedding and lm_head.

Drafting feeds the head's own output forward as the hidden state (accuracy drifts with depth); refill runs
over the verified positions with the target's hidden states from the verify forward (same ragged layout).
"""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVPool
from engine.models.llama import LlamaForCausalLM
from engine.models.mtp_head import MTPHead
from engine.proposers.draft_vocab import ReducedLMHead
from engine.proposers.model_proposer import ModelProposer


class MTPProposer(ModelProposer):
    kind = "mtp"
    shift = 1

    def __init__(self, head: MTPHead, target: LlamaForCausalLM, pool: KVPool, max_slots: int,
                 device: torch.device, reduced_head: ReducedLMHead | None = None) -> None:
        super().__init__(pool, target.cfg.vocab_size, target.cfg.hidden_size, max_slots, device)
        self.head = head
        self.target = target
        self.reduced_head = reduced_head  # the target's lm_head rows for the head's draft vocabulary

    @property
    def network(self) -> torch.nn.Module:
        return self.head

    def forward(self, fb: ForwardBatch, hidden_in: torch.Tensor | None) -> torch.Tensor:
        assert hidden_in is not None, "the MTP head always needs a hidden state per token"
        return self.head(fb, self.pool, self.target.embed_tokens(fb.input_ids), hidden_in)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.reduced_head is not None:
            return self.reduced_head(hidden)
        return self.target.compute_logits(hidden)
