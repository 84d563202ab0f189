"""`draft_model`: a small Llama-family checkpoint sharing the target's tokenizer, with its own KV pool
indexed by the shared page tables."""

from __future__ import annotations

import numpy as np
import torch

from specstep.engine.errors import CheckpointError
from specstep.engine.forward_batch import ForwardBatch
from specstep.engine.kv_cache import KVPool
from specstep.engine.models.llama import LlamaForCausalLM
from specstep.engine.proposers.draft_vocab import ReducedLMHead
from specstep.engine.proposers.model_proposer import ModelProposer
from specstep.engine.step_context import SeqState


class DraftModelProposer(ModelProposer):
    kind = "draft_model"
    shift = 0
    kv_lookahead = 1  # refill writes the bonus token's KV, one past the verify window
    leader_only = True

    def __init__(self, draft: LlamaForCausalLM, target_vocab: int, pool: KVPool, max_slots: int,
                 device: torch.device, reduced_head: ReducedLMHead | None = None) -> None:
        if draft.cfg.vocab_size != target_vocab:
            raise CheckpointError(
                f"draft vocabulary ({draft.cfg.vocab_size}) differs from the target's ({target_vocab}); "
                "a draft model must share the target's tokenizer")
        super().__init__(pool, target_vocab, draft.cfg.hidden_size, max_slots, device, draft.dtype)
        self.model = draft
        self.reduced_head = reduced_head  # the draft's lm_head rows for its draft vocabulary

    def catch_up(self, seqs: list[SeqState], draft_lens: list[int]) -> None:
        """Feed tokens[draft_len:] (known on the host) and carry logits from the last one."""
        ids = [s.token_ids[n:] for s, n in zip(seqs, draft_lens)]
        self.run_host_tokens(seqs, ids, np.array(draft_lens, dtype=np.int64), None, "catch_up")

    @property
    def network(self) -> torch.nn.Module:
        return self.model

    def forward(self, fb: ForwardBatch, hidden_in: torch.Tensor | None) -> torch.Tensor:
        return self.model(fb, self.pool)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.reduced_head is not None:
            return self.reduced_head(hidden)
        return self.model.compute_logits(hidden)
