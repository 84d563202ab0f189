"""The proposer interface and the sampling shared by every model-based proposer.

Life of a request's draft state (model proposers):
    prefill : the draft catches up on the prompt and the target's first sampled token; its logits at the last
              position (and hidden state, for heads) are *carried* into the first decode step.
    propose : draft 1 comes from the carried logits; drafts 2..k need k - 1 forwards of the draft.
    refill  : after verification, the draft runs over the verified tokens (same ragged layout as verify, the
              accepted tokens plugged in on device) to fix its KV and carry logits from the last emitted token.
              Its inputs come from device tensors, so no host sync is needed before it.
    keep    : a prefill or a step without the proposer (speculation off: it costs what plain decoding costs)
              keeps only what a later catch-up needs that the host does not have (MTP: the target's hidden
              states).
    catch_up: before the next step that drafts or refills, the draft consumes the tokens it skipped.
"""

from __future__ import annotations

from abc import ABC

import numpy as np
import torch

from specstep.engine.random import DRAFT
from specstep.engine.sampler import processed_probs, sample_from_probs
from specstep.engine.sampling_params import SamplingTensors
from specstep.engine.step_context import DecodeContext, SeqState


class Proposer(ABC):
    kind: str = ""
    #: model proposers keep a KV cache, need prefill and refill; host proposers (n-gram) propose on the CPU
    has_model: bool = True
    #: extra look-ahead tokens past the verify window that the proposer writes into the shared pages
    kv_lookahead: int = 0

    def prefill(self, seqs: list[SeqState], start: np.ndarray, q_lens: np.ndarray, final: np.ndarray,
                target_hidden: torch.Tensor, sampled: torch.Tensor) -> None:
        """Consume the target's prefill chunk token_ids[start : start + q_lens] of each request (its hidden
        states: `target_hidden`, ragged); a *final* chunk (it ends at the last prompt token) also consumes the
        target's sampled token (device tensor) and carries state into the first decode step."""

    def propose_host(self, seqs: list[SeqState], k: int) -> list[list[int]] | None:
        """Drafts known on the host at build time (n-gram); None for model proposers."""
        return None

    def propose(self, ctx: DecodeContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [B, k] and their distributions [B, k, V] (None when every request is greedy)."""
        raise NotImplementedError(f"{self.kind} proposes on the host (propose_host)")

    def refill(self, ctx: DecodeContext, out_tokens: torch.Tensor, num_accepted: torch.Tensor,
               target_hidden: torch.Tensor) -> None:
        """Bring the draft's KV and carried state up to date with the tokens just emitted."""

    def keep_prefill(self, seqs: list[SeqState], start: np.ndarray, q_lens: np.ndarray,
                     target_hidden: torch.Tensor) -> None:
        """A prefill chunk (or a mixed step's decode row) ran without the proposer: keep what `catch_up` will
        need (device only)."""

    def keep(self, ctx: DecodeContext, target_hidden: torch.Tensor) -> None:
        """A step ran without refill: keep what `catch_up` will need and the host will not have (device only)."""

    def catch_up(self, seqs: list[SeqState], draft_lens: list[int]) -> None:
        """Consume token_ids[draft_len:] (known on the host) and carry state from the last one."""

    def carried_state(self) -> dict[str, torch.Tensor]:
        """The device tensors kept across steps, by name (carried logits and hidden states, rings of target hidden
        states). Hidden states are in the model's dtype; logits are float32, as `compute_logits` returns them."""
        return {}


def draw(logits: torch.Tensor, st: SamplingTensors,
         positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft token per row (argmax for greedy requests, a draw from the processed q otherwise) and q itself."""
    greedy = logits.argmax(dim=-1)
    if st.all_greedy:
        return greedy, None
    q = processed_probs(logits, st)
    sampled = sample_from_probs(q, st.seeds, positions, DRAFT)
    return (torch.where(st.greedy, greedy, sampled) if st.any_greedy else sampled), q
