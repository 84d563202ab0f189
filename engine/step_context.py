"""What one decode/speculative step knows about its batch: the host's plan and the device inputs it runs on.

    DecodePlan     host, frozen: the requests and their host rows, eager or which graph, what attention plans read
      .inputs      DecodeInputs, device: what the step body, the proposers and a captured graph consume
    PromptRuns     host, frozen: a prompt forward's ragged runs (whole prefills, chunks, a mixed step's prompts)

A graph replay hands `step_graphs.graph_inputs(plan.inputs)` to the graph, whose step function builds its own
`DecodeInputs` from its static buffers: no field of either record is None because the step replays a graph.
"""

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


@dataclass(frozen=True, slots=True)
class Chain:
    """Rows of this step that continue requests of the previous step, which has not been read back yet.

    The host does not know how many tokens that step accepts, so it builds this step with stale starts and
    last tokens; the device patches them first thing:  start[dst] = prev.start[src] + accepted[src] + 1,
    last[dst] = prev.out_tokens[src, accepted[src]].  No host sync between the two steps: the stream runs in
    order, so when this step runs the previous step's outputs exist (`StepHandle.result()`). The rows' device
    copies travel with the step's other inputs (`DecodeInputs.chain_src / chain_dst`).
    """

    prev: Any  # StepHandle[StepOutput] of the previous step
    src: np.ndarray  # [R] int64 rows in the previous step (host; staged with the step's inputs)
    dst: np.ndarray  # [R] int64 rows in this step


@dataclass(frozen=True, slots=True)
class StepLayouts:
    """The layouts a step's forwards run on: ragged on an eager step (from the host), uniform inside a captured
    graph (derived on device from its static page table, `forward_batch.uniform_layout`)."""

    verify: BatchLayout  # q = num_draft + 1 per request: verify, and the proposer's refill
    single: BatchLayout  # one token per request: the draft loop


@dataclass(frozen=True, slots=True)
class GraphTable:
    """The host side of a graph replay: all it uploads of the layout. The graph derives its own layouts."""

    page_table: torch.Tensor  # [B, captured width], padded with the dummy page


@dataclass(frozen=True, slots=True)
class DecodeInputs:
    """The device tensors a decode step runs on: what `StepEngine.decode_body`, the proposers and a captured graph
    consume. Request b's last token sits at position start[b]; it drafts num_draft[b] <= k tokens.

    Frozen as a record; its tensors are written in place on the device (a chained step's `start` and
    `grid[:, 0]` are patched from the previous step's outputs, the drafts land in `grid[:, 1:]`).
    """

    k: int  # drafts per request in this step's layout (max of num_draft; a graph's captured k)
    start: torch.Tensor  # [B] position of each request's last token
    st: SamplingTensors
    slots: torch.Tensor  # [B] long: rows of the proposer's carried state
    num_draft: torch.Tensor  # [B] long, <= k
    grid: torch.Tensor  # [B, k + 1]: last token, then the drafts (host drafts uploaded, device drafts written here)
    layout: StepLayouts | GraphTable  # GraphTable only on the host side of a replay (`graph_inputs` reads it)
    refill: bool = True  # keep the proposer's KV current (the policy may drop it while nobody speculates)
    uniform: bool = False  # q = k + 1 for every lane (a captured graph): the grid feeds verify as it is
    chain_src: torch.Tensor | None = None  # [R] device copies of `Chain.src / dst`; None: not chained
    chain_dst: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.start.shape[0]

    @property
    def layouts(self) -> StepLayouts:
        if not isinstance(self.layout, StepLayouts):
            raise TypeError("the host side of a graph replay has no layouts: the graph derives them")
        return self.layout

    @property
    def verify_layout(self) -> BatchLayout:
        return self.layouts.verify

    @property
    def single_layout(self) -> BatchLayout:
        return self.layouts.single

    @property
    def verify_is_grid(self) -> bool:
        """Every request verifies k + 1 tokens (a captured graph, or every request at k drafts): the verify tokens
        are the [B, k + 1] grid in its order, in and out, with no gather (host-known from the layout's shape)."""
        return self.uniform or self.verify_layout.num_tokens == self.batch_size * (self.k + 1)

    def verify_flat_index(self) -> torch.Tensor:
        """[T] index into a [B, k + 1] grid for each token of the ragged verify layout."""
        lay = self.verify_layout
        return lay.token_req * (self.k + 1) + lay.token_offset

    def verify_rows(self) -> torch.Tensor:
        """[B, k + 1] flat token row of (request b, verify position j); positions past num_draft[b] repeat its
        last row (their values are never used)."""
        lay = self.verify_layout
        j = torch.arange(self.k + 1, device=self.start.device).unsqueeze(0)
        return lay.q_index.gather(1, torch.minimum(j, (lay.q_lens - 1).unsqueeze(1)))


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """A decode step as the host planned it (`StepEngine.plan_decode`, on the scheduler thread): the host rows
    it was built from, how it runs (eagerly, or replaying the captured graph `graph_kind`), and its uploaded
    `inputs`. The verify layout (q = num_draft + 1 per request) is shared by verify and the proposer's refill."""

    seqs: list[SeqState]
    num_draft: np.ndarray  # [B] int64, <= k
    base_pos: np.ndarray  # [B] int64: position of each request's last token (host copy of inputs.start)
    input_grid: np.ndarray  # [B, k + 1] host: last token, then host drafts (n-gram) where known
    inputs: DecodeInputs
    chain: Chain | None = None  # rows whose start/last token come from the previous, still running step
    page_tables: np.ndarray | None = None  # [B, P] host copy, only for attention backends that plan (FlashInfer)
    graph_kind: str | None = None  # the registered graph it replays (flavour and page-table width); None: eager
    tp_message: Any = None  # tensor parallelism: the leader's description of this step for the followers

    @property
    def k(self) -> int:
        return self.inputs.k

    @property
    def refill(self) -> bool:
        return self.inputs.refill

    @property
    def graph(self) -> bool:
        """Replay a captured graph (uniform q = k + 1 per lane, fixed page-table width)."""
        return self.graph_kind is not None

    @property
    def batch_size(self) -> int:
        return len(self.seqs)

    def patch_chain(self) -> None:
        """A chained step's starts and last tokens from the previous step's outputs, on the device (`Chain`);
        nothing for a step that is not chained. The first device work of the step."""
        if self.chain is not None:
            inputs, prev = self.inputs, self.chain.prev.result()
            src, dst = inputs.chain_src, inputs.chain_dst
            acc = prev.num_accepted[src]
            inputs.start[dst] = prev.start[src] + acc + 1
            inputs.grid[dst, 0] = prev.out_tokens[src, acc]


@dataclass(frozen=True, slots=True)
class PromptRuns:
    """Host arrays of a prompt forward's ragged runs token_ids[start : start + q_lens] (`StepEngine.prefill` and
    `run_mixed`)."""

    ids: list[list[int]]
    start: np.ndarray  # [B] int64
    q_lens: np.ndarray  # [B] int64
    final: np.ndarray  # [B] bool: the run ends at the request's last token
    cu: np.ndarray  # [B + 1] offsets of the runs in the flat tokens

    @classmethod
    def of(cls, seqs: list[SeqState], q_lens: list[int] | np.ndarray | None) -> PromptRuns:
        """Runs of `q_lens[i]` tokens from each request's `num_computed` (default: every uncomputed token)."""
        start = np.array([s.num_computed for s in seqs], dtype=np.int64)
        total = np.array([len(s.token_ids) for s in seqs], dtype=np.int64)
        q_lens = total - start if q_lens is None else np.asarray(q_lens, dtype=np.int64)
        ids = [s.token_ids[c: c + q] for s, c, q in zip(seqs, start.tolist(), q_lens.tolist())]
        return cls(ids, start, q_lens, start + q_lens == total, np.concatenate([[0], np.cumsum(q_lens)]))

    @property
    def num_tokens(self) -> int:
        return int(self.cu[-1])
