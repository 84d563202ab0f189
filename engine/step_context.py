"""What one decode/speculative step knows about its batch, built on the host before launch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from specstep.engine.forward_batch import BatchLayout
from specstep.engine.sampling_params import SamplingParams, SamplingTensors


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
class Chain:
    """Rows of this step that continue requests of the previous step, which has not been read back yet.

    The host does not know how many tokens that step accepts, so it builds this step with stale starts and
    last tokens; the device patches them first thing:  start[dst] = prev.start[src] + accepted[src] + 1,
    last[dst] = prev.out_tokens[src, accepted[src]].  No host sync between the two steps: the stream runs in
    order, so when this step runs the previous step's outputs exist (`StepHandle.result()`).
    """

    prev: Any  # StepHandle[StepOutput] of the previous step
    src: np.ndarray  # [R] int64 rows in the previous step (host; staged with the step's inputs)
    dst: np.ndarray  # [R] int64 rows in this step
    src_dev: torch.Tensor | None = None  # device copies, set when the step's inputs are uploaded
    dst_dev: torch.Tensor | None = None


@dataclass(slots=True)
class DecodeContext:
    """A decode-only batch: request b's last token sits at position base_pos[b] and it drafts num_draft[b].

    The verify layout (q = num_draft + 1 per request) is shared by verify and by the proposer's refill.
    """

    seqs: list[SeqState] | None  # None inside a graph-captured step (only tensors there)
    k: int  # drafts per request in this step's layout (max of num_draft)
    num_draft: np.ndarray | None  # [B] int64, <= k (host; None inside a captured step)
    base_pos: np.ndarray | None  # [B] int64 (host copy)
    start: torch.Tensor  # [B] device copy of base_pos
    st: SamplingTensors
    slots: torch.Tensor  # [B] long, device: rows of the proposer's carried state
    verify_layout: BatchLayout | None  # None on the host side of a graph replay (the graph derives its own)
    single_layout: BatchLayout | None  # one token per request (the draft loop)
    device: torch.device
    input_grid: np.ndarray | None  # [B, k + 1] host: last token, then host drafts (n-gram) where known
    num_draft_dev: torch.Tensor  # [B] device copy of num_draft
    chain: Chain | None = None  # rows whose start/last token come from the previous, still running step
    refill: bool = True  # keep the proposer's KV current (the policy may drop it while nobody speculates)
    page_tables: np.ndarray | None = None  # [B, P] host copy, for attention backends that plan (FlashInfer)

    graph: bool = False  # replay a captured graph (uniform q = k + 1 per lane, fixed page-table width)
    graph_kind: str | None = None  # the registered graph it replays (flavour and page-table width)
    graph_page_table: torch.Tensor | None = None  # [B, captured width]: all a graph replay uploads of the layout
    input_grid_dev: torch.Tensor | None = None  # device copy of input_grid (staged with the step's other inputs)
    tp_message: Any = None  # tensor parallelism: the leader's description of this step for the followers

    @property
    def batch_size(self) -> int:
        return self.start.shape[0]

    def verify_flat_index(self) -> torch.Tensor:
        """[T] index into a [B, k + 1] grid for each token of the ragged verify layout."""
        lay = self.verify_layout
        return lay.token_req * (self.k + 1) + lay.token_offset

    def verify_rows(self) -> torch.Tensor:
        """[B, k + 1] flat token row of (request b, verify position j); positions past num_draft[b] repeat its
        last row (their values are never used)."""
        lay = self.verify_layout
        j = torch.arange(self.k + 1, device=self.device).unsqueeze(0)
        return lay.q_index.gather(1, torch.minimum(j, (lay.q_lens - 1).unsqueeze(1)))
