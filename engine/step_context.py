"""What one decode/speculative step knows about its batch, built on the host before launch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine.sampling_params import SamplingParams, SamplingTensors


class SeqState(Protocol):
    """The view of a request the step engine needs (the scheduler's `Request` satisfies it).

    Lengths: `num_computed` tokens have target KV written; a running request has
    num_computed == len(token_ids) - 1 (its last sampled token is fed by the next step).
    """

    token_ids: list[int]
    num_computed: int
    page_table: list[int]
    params: SamplingParams
    seed: int
    slot: int


@dataclass(slots=True)
class DecodeContext:
    """A decode-only batch: request b's last token sits at position base_pos[b] and it drafts num_draft[b]."""

    seqs: list[SeqState]
    k: int  # drafts per request in this step's layout (max of num_draft)
    num_draft: np.ndarray  # [B] int64, <= k
    base_pos: np.ndarray  # [B] int64
    st: SamplingTensors
    slots: torch.Tensor  # [B] long, device: rows of the proposer's carried state
    page_size: int
    device: torch.device

    @property
    def batch_size(self) -> int:
        return len(self.seqs)

    @property
    def page_tables(self) -> list[list[int]]:
        return [s.page_table for s in self.seqs]

    @property
    def verify_q_lens(self) -> np.ndarray:
        return self.num_draft + 1

    def verify_row_index(self) -> np.ndarray:
        """[B, k + 1] flat row of (request b, verify position j) in a ragged verify layout; positions past
        num_draft[b] repeat its last row (their values are never used)."""
        q = self.verify_q_lens
        cu = np.concatenate([[0], np.cumsum(q)[:-1]])
        j = np.arange(self.k + 1)[None, :]
        return cu[:, None] + np.minimum(j, q[:, None] - 1)
