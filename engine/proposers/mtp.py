"""`mtp`: the EAGLE-style one-layer head over the target's hidden states, sharing its embedding and lm_head.

Drafting feeds the head's own output forward as the hidden state (accuracy drifts with depth); refill runs
over the verified positions with the target's hidden states from the verify forward (same ragged layout).

Refill can be dropped (speculation off costs what plain decoding costs): each step without it keeps the
target's hidden state at its input position in a per-slot ring of HISTORY positions, and the catch-up replays
(h[p - 1], t[p]) over the skipped tokens. Positions older than the ring leave a hole in the head's KV: its
drafts may get worse there, never the output (drafts are only proposals).
"""

from __future__ import annotations

import numpy as np
import torch

from specstep.engine.errors import CheckpointError
from specstep.engine.forward_batch import ForwardBatch
from specstep.engine.kv_cache import KVPool
from specstep.engine.models.llama import LlamaForCausalLM
from specstep.engine.models.mtp_head import MTPHead
from specstep.engine.proposers.draft_vocab import ReducedLMHead
from specstep.engine.proposers.model_proposer import ModelProposer
from specstep.engine.step_context import DecodeInputs, SeqState

HISTORY = 256  # target hidden states kept per slot while refill is dropped


class MTPProposer(ModelProposer):
    kind = "mtp"
    shift = 1

    def __init__(self, head: MTPHead, target: LlamaForCausalLM, pool: KVPool, max_slots: int,
                 device: torch.device, reduced_head: ReducedLMHead | None = None) -> None:
        # The head concatenates the target's hidden states (and embeddings) with its own: one dtype for all, or
        # the concatenation promotes and the head's linears see a dtype their weights are not in.
        dtype = target.dtype
        if head.fc.weight.dtype != dtype:
            raise CheckpointError(f"the MTP head is in {head.fc.weight.dtype}, the target in {dtype}: load both "
                                  "in one dtype")
        super().__init__(pool, target.cfg.vocab_size, target.cfg.hidden_size, max_slots, device, dtype)
        self.head = head
        self.target = target
        self.reduced_head = reduced_head  # the target's lm_head rows for the head's draft vocabulary
        self.history = torch.zeros(max_slots, HISTORY, target.cfg.hidden_size, device=device, dtype=dtype)

    @property
    def network(self) -> torch.nn.Module:
        return self.head

    def carried_state(self) -> dict[str, torch.Tensor]:
        return {**super().carried_state(), "history": self.history}

    def forward(self, fb: ForwardBatch, hidden_in: torch.Tensor | None) -> torch.Tensor:
        assert hidden_in is not None, "the MTP head always needs a hidden state per token"
        return self.head(fb, self.pool, self.target.embed_tokens(fb.input_ids), hidden_in)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.reduced_head is not None:
            return self.reduced_head(hidden)
        return self.target.compute_logits(hidden)

    def keep(self, inputs: DecodeInputs, target_hidden: torch.Tensor) -> None:
        # Without refill nobody drafted (k = 0): one verify row per request, the target's hidden state at `start`.
        rows = inputs.verify_layout.q_index[:, 0]
        self.history[inputs.slots, inputs.start % HISTORY] = target_hidden[rows]  # same dtype (no cast: see _carry)

    def keep_prefill(self, seqs: list[SeqState], start: np.ndarray, q_lens: np.ndarray,
                     target_hidden: torch.Tensor) -> None:
        # Row r of the ragged chunk is position start + offset of its request; keep the last HISTORY.
        slots, positions, rows = [], [], []
        row = 0
        for s, c, q in zip(seqs, start.tolist(), q_lens.tolist()):
            first = max(0, q - HISTORY)
            rows += range(row + first, row + q)
            positions += range(c + first, c + q)
            slots += [s.slot] * (q - first)
            row += q
        slot_t, pos_t, row_t = self.staging.upload([np.array(slots, dtype=np.int64),
                                                    np.array(positions, dtype=np.int64) % HISTORY,
                                                    np.array(rows, dtype=np.int64)])
        self.history[slot_t, pos_t] = target_hidden[row_t]

    def catch_up(self, seqs: list[SeqState], draft_lens: list[int]) -> None:
        # Token t[p] is consumed at position p - 1 with h[p - 1]; only the last HISTORY hidden states exist.
        ids, starts, slots, positions = [], [], [], []
        for s, n in zip(seqs, draft_lens):
            first = max(n, len(s.token_ids) - HISTORY + 1)
            ids.append(s.token_ids[first:])
            starts.append(first - 1)
            slots += [s.slot] * (len(s.token_ids) - first)
            positions += range(first - 1, len(s.token_ids) - 1)
        slot_t, pos_t = self.staging.upload([np.array(slots, dtype=np.int64),
                                             np.array(positions, dtype=np.int64) % HISTORY])
        hidden = self.history[slot_t, pos_t]
        self.run_host_tokens(seqs, ids, np.array(starts, dtype=np.int64), hidden, "catch_up")
