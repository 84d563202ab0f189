"""The step engine: prefill, decode and speculative decode over the paged target and a proposer.

A speculative step, all on device after the host has built its inputs:

    draft    proposer extends each request by num_draft[b] <= k tokens (from carried logits)
    verify   the target runs [last, d1 .. d_num_draft] per request in one ragged forward
    accept   rejection sampling -> out_tokens [B, k+1], num_accepted [B]            (no host sync)
    refill   the proposer re-runs over the emitted tokens, carrying logits forward  (no host sync)

k = 0 is plain decoding: with refill, the proposer stays current; without (the policy's "off"), it keeps what
its catch-up needs (`Proposer.keep`) and the step costs what plain decoding costs. The one host sync is the
caller reading `StepOutput` back, as late as it likes.

Attention backends that plan (FlashInfer) get every forward's exact lengths before the step is enqueued
(`_plan_attention`); each forward names its plan in `ForwardBatch.derive(..., slot=...)`. For a chained step
that costs a second, earlier host sync: its starts are only known once the previous step has finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from specstep.cuda_graphs.buckets import kv_page_buckets
from specstep.engine.batch_builder import build_forward_batch
from specstep.engine.decode_batch import build_decode_plan
from specstep.engine.forward_batch import ForwardBatch
from specstep.engine.kv_cache import KVPool
from specstep.engine.models.llama import LlamaForCausalLM
from specstep.engine.parallel.group import SINGLE, TPGroup
from specstep.engine.proposers.base import Proposer
from specstep.engine.rejection_sampler import rejection_sample
from specstep.engine.sampler import sample
from specstep.engine.sampling_params import SamplingFlags, SamplingTensors
from specstep.engine.staging import Staging
from specstep.engine.step_context import Chain, DecodeInputs, DecodePlan, PromptRuns, SeqState
from specstep.engine.step_graphs import graph_for, graph_inputs, register_decode_graphs
from specstep.traces import ranges
from specstep.traces.ranges import DEVICE_TRACK
from specstep.traces.tracer import NULL_TRACER, Tracer

if TYPE_CHECKING:
    from specstep.cuda_graphs.runner import GraphRunner


@dataclass(slots=True)
class StepOutput:
    """Device tensors; read them back (the step's only sync) when the host needs the new lengths."""

    out_tokens: torch.Tensor  # [B, k + 1]
    num_accepted: torch.Tensor  # [B] accepted drafts; the step emitted num_accepted + 1 tokens
    num_draft: np.ndarray  # [B] drafts actually proposed (host-known)
    start: torch.Tensor  # [B] position of each request's input token (device; chained steps read it)

    rows: torch.Tensor | None = None  # [B, 1 + k + 1]: counts then tokens; the fields above are views of it

    @classmethod
    def packed(cls, out_tokens: torch.Tensor, num_accepted: torch.Tensor, num_draft: np.ndarray,
               start: torch.Tensor) -> StepOutput:
        """Counts and tokens copied into one tensor of the step's own (one kernel; it also frees a graph's static
        outputs for the next replay), the two fields views of it, so `read` is a single transfer."""
        rows = torch.cat([num_accepted.unsqueeze(1), out_tokens], dim=1)
        return cls(out_tokens=rows[:, 1:], num_accepted=rows[:, 0], num_draft=num_draft, start=start, rows=rows)

    def read(self) -> tuple[list[int], list[list[int]]]:
        """The step's one host sync: accepted counts and tokens, read back in one transfer."""
        rows = self.rows if self.rows is not None else torch.cat([self.num_accepted.unsqueeze(1), self.out_tokens], 1)
        host = rows.tolist()
        return [r[0] for r in host], [r[1:] for r in host]


class StepEngine:
    def __init__(self, target: LlamaForCausalLM, pool: KVPool, proposer: Proposer | None,
                 device: torch.device, tracer: Tracer = NULL_TRACER, tp: TPGroup = SINGLE) -> None:
        self.tracer = tracer
        # Tensor parallelism (`engine.parallel.tp_engine`): every rank runs this step on its shard. A draft model
        # lives on the leader only; its drafts and the acceptance it alone can compute are broadcast in the step.
        self.tp = tp
        self.leader_drafts = tp.world_size > 1 and proposer is not None and proposer.leader_only
        self.graphs: GraphRunner | None = None  # set by `use_graphs` after the KV pools are sized
        self.graph_widths: tuple[int, ...] = ()  # captured page-table widths, ascending
        self.graph_ks: tuple[int, ...] = ()  # k values graphs were registered for, ascending
        self.target = target
        self.pool = pool
        self.proposer = proposer
        self.device = device
        self.vocab_size = target.cfg.vocab_size
        self.staging = Staging(device)  # every per-step host -> device copy (pinned, double-buffered on CUDA)

    def use_graphs(self, runner: GraphRunner, ks: tuple[int, ...], max_model_len: int, scratch_slot: int,
                   drops_refill: bool = True):
        """Register the decode step for the k values in `ks` that steps replay and capture (largest bucket
        first). `drops_refill`: whether the policy ever drops the proposer's refill (`PolicyConfig.drops_refill`;
        True captures for both)."""
        # Every lane of a graph writes k + 1 verify positions (and the proposer's look-ahead), even a request
        # one token short of max_model_len that drafts nothing: the page table's width covers them.
        self.graph_widths = self.kv_widths(self.max_kv_len(max_model_len, max(ks)))
        self.graph_ks = tuple(sorted(ks))
        register_decode_graphs(runner, self, ks, self.graph_widths, scratch_slot, drops_refill)
        self.graphs = runner
        return runner.capture(self.tracer)

    def close(self, failed: bool = False) -> None:
        """Nothing to release on one device (the tensor-parallel leader stops its group here): the protocol's
        member, so the core calls it without asking what kind of engine it holds."""

    def kv_widths(self, max_kv_len: int) -> tuple[int, ...]:
        """Page-table widths graphs are captured at. FlashInfer reads only the pages it is planned with: one
        width. The torch backend gathers a table's whole width: KV-length buckets up to max_kv_len."""
        max_pages = -(-max_kv_len // self.page_size)
        return (max_pages,) if self.plans_attention else kv_page_buckets(max_pages, self.page_size)

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def max_kv_len(self, max_model_len: int, k_max: int) -> int:
        """Positions a step may touch: the model's length plus a uniform graph lane's k + 1 writes and the
        proposer's look-ahead."""
        return max_model_len + k_max + 1 + (self.proposer.kv_lookahead if self.proposer else 0)

    @property
    def plans_attention(self) -> bool:
        """The attention backend needs each forward's exact lengths on the host before it runs (FlashInfer)."""
        return self.target.attention.needs_plan

    @property
    def has_draft_model(self) -> bool:
        return self.proposer is not None and self.proposer.has_model

    def can_chain(self, num_draft: np.ndarray) -> bool:
        return self.proposer is None or self.proposer.can_chain(num_draft)

    @torch.inference_mode()
    def prefill(self, seqs: list[SeqState], with_proposer: bool | list[bool] = True,
                q_lens: list[int] | np.ndarray | None = None) -> torch.Tensor:
        """One target forward over ragged runs token_ids[num_computed : num_computed + q_lens[i]] (default: every
        uncomputed token); return the token sampled after each run [B] (device). It serves whole prefills and
        prefill chunks (a mixed step's, where it is not fused: `run_mixed`).

        A run is *final* when it ends at the request's last token: only a final run's sampled token is used. The
        proposer consumes the same chunk (`with_proposer`, per row or for all), so its carried state is ready when
        the prefill completes; otherwise it only keeps what a later catch-up needs."""
        runs = PromptRuns.of(seqs, q_lens)
        with self.tracer.range(ranges.PREFILL, track=DEVICE_TRACK, batch=len(seqs), tokens=runs.num_tokens):
            hidden = self.target(self._prompt_batch(seqs, runs), self.pool)
            return self._after_prompts(seqs, runs, hidden, with_proposer)

    def _prompt_batch(self, seqs: list[SeqState], runs: PromptRuns) -> ForwardBatch:
        return build_forward_batch(runs.ids, runs.start, [s.page_table for s in seqs], self.page_size, self.device,
                                   self.target.attention, "prefill", self.staging.upload)

    def _after_prompts(self, seqs: list[SeqState], runs: PromptRuns, hidden: torch.Tensor,
                       with_proposer: bool | list[bool]) -> torch.Tensor:
        """Sample after each run's last token (`hidden`: the runs' rows, flat), and the proposer's part."""
        start, q_lens, cu = runs.start, runs.q_lens, runs.cu
        params = [s.params for s in seqs]
        last, positions, *sampling = self.staging.upload(
            [cu[1:] - 1, start + q_lens, *SamplingTensors.host_arrays(params, [s.seed for s in seqs],
                                                                       self.vocab_size)])
        st = SamplingTensors.from_tensors(sampling, params, self.vocab_size)
        tokens = sample(self.target.compute_logits(hidden[last]), st, positions)
        if self.proposer is not None:
            consume = np.array(with_proposer, bool) if isinstance(with_proposer, list) else np.full(len(seqs),
                                                                                                     with_proposer)
            self.proposer.after_prefill(seqs, start, q_lens, runs.final, cu, hidden, tokens, consume,
                                        self.staging.upload)
        return tokens

    @property
    def fuses_mixed_steps(self) -> bool:
        """Mixed steps run as one forward (`run_mixed`): no captured graphs (a graph replays the decode rows on
        their own) and an attention backend that needs no host plan (FlashInfer plans each forward's lengths)."""
        return self.graphs is None and not self.plans_attention

    def fuses_mixed(self, plan: DecodePlan) -> bool:
        """Whether a mixed step with this decode plan runs as one forward (`fuses_mixed_steps`, and an eager,
        unchained step); else the decode step, then the prompt forward."""
        return self.fuses_mixed_steps and not plan.graph and plan.chain is None

    @torch.inference_mode()
    def run_mixed(self, plan: DecodePlan, seqs: list[SeqState], with_proposer: list[bool],
                  q_lens: list[int]) -> tuple[StepOutput, torch.Tensor]:
        """A mixed step in one target forward: the decode step's verify rows (drafted first, as in
        `decode_body`), then the prompt chunks, so the chunks share the weights' pass instead of paying a second
        forward's. Acceptance and the proposer's refill run over the verify rows, sampling and the proposer's
        prefill over the chunks, as the two separate forwards would; with batch invariance (the CPU default: the
        C++ layers and the batch-invariant attention never mix rows) to the bit. No host sync."""
        assert self.fuses_mixed(plan), "a graph, a chained or a planned decode step runs apart from the prompts"
        inputs, runs = plan.inputs, PromptRuns.of(seqs, q_lens)
        with self.tracer.range(ranges.MIXED, track=DEVICE_TRACK, batch=plan.batch_size, k=plan.k,
                               prompts=len(seqs), tokens=runs.num_tokens):
            # One batch over the verify lanes (at their host-known starts: a mixed step is never chained) and
            # the chunks, built on the host as a prefill's is, so where the attention kernel takes its padded
            # shape it is one part (the C++ layers' one call); the verify tokens are plugged in once drafted.
            verify_q = plan.num_draft + 1
            rows = int(verify_q.sum())
            fb = build_forward_batch([[0] * q for q in verify_q.tolist()] + runs.ids,
                                     np.concatenate([plan.base_pos, runs.start]),
                                     [s.page_table for s in plan.seqs] + [s.page_table for s in seqs],
                                     self.page_size, self.device, self.target.attention, "prefill",
                                     self.staging.upload)
            drafts, draft_probs = self._draft(inputs)
            fb.input_ids[:rows] = self._verify_ids(inputs)
            hidden = self.target(fb, self.pool)  # verify rows and chunks: the MIXED range, not VERIFY
            out, accepted = self._accept(inputs, hidden[:rows], drafts, draft_probs)
            if self.proposer is not None:
                self.proposer.after_verify(inputs, out, accepted, hidden[:rows], self.tracer)
            tokens = self._after_prompts(seqs, runs, hidden[rows:], with_proposer)
            return StepOutput.packed(out, accepted, plan.num_draft, inputs.start), tokens

    @torch.inference_mode()
    def catch_up(self, seqs: list[SeqState], draft_lens: list[int]) -> None:
        """Bring a stale proposer up to date with tokens it skipped while its refill was dropped."""
        assert self.proposer is not None
        with self.tracer.range(ranges.CATCH_UP, track=DEVICE_TRACK, batch=len(seqs),
                               tokens=sum(len(s.token_ids) - n for s, n in zip(seqs, draft_lens))):
            self.proposer.catch_up(seqs, draft_lens)

    def decode_context(self, seqs: list[SeqState], num_draft: np.ndarray, host_drafts: list[list[int]] | None = None,
                       chain: Chain | None = None, refill: bool = True) -> DecodePlan:
        """Host-side batch preparation for a decode step (runs on the scheduler thread, overlapping the
        previous step's device work when chained): the plan, and its inputs uploaded (`decode_batch`)."""
        kind, k, width = None, int(num_draft.max(initial=0)), None
        if self.graphs is not None:
            flags = SamplingFlags.of([s.params for s in seqs], self.vocab_size)
            kind, k, width = graph_for(self, flags, refill, [s.page_table for s in seqs], k)
        return build_decode_plan(seqs, num_draft, host_drafts, chain, refill, k, kind, width,
                                 upload=self.staging.upload, page_size=self.page_size, vocab_size=self.vocab_size,
                                 host_tables=self.plans_attention)

    def plan_decode(self, seqs: list[SeqState], num_draft: np.ndarray, chain: Chain | None = None,
                    refill: bool = True) -> DecodePlan:
        num_draft = np.asarray(num_draft, dtype=np.int64).copy()
        if self.proposer is None:
            return self.decode_context(seqs, np.zeros_like(num_draft), None, chain, refill)
        # A chained step is built before the previous step's tokens reach the host: its drafts cannot read them.
        assert chain is None or self.proposer.can_chain(num_draft), "this step cannot be built blind: do not chain it"
        num_draft, host_drafts = self.proposer.plan_drafts(seqs, num_draft, refill)
        return self.decode_context(seqs, num_draft, host_drafts, chain, refill)

    def run_decode(self, plan: DecodePlan) -> StepOutput:
        """The device part of a decode step (no host sync): patch a chained step's inputs, then run the body
        eagerly or as a graph replay."""
        b, k, inputs = plan.batch_size, plan.k, plan.inputs
        plans = self.plans_attention
        if plans:
            # Outside the DECODE range: the device idles while a chained step waits for the previous step's
            # lengths and plans, and the trace should show that gap.
            plan.patch_chain()
            self._plan_attention(plan)
        with self.tracer.range(ranges.DECODE, track=DEVICE_TRACK, batch=b, k=k, graph=plan.graph):
            if not plans:
                plan.patch_chain()
            if plan.graph:
                outs = self.graphs.run(plan.graph_kind, k + 1, graph_inputs(inputs), b)
                # Static outputs are rewritten by the next replay, which may run before the host reads these:
                # packing them is the copy.
                out, accepted = outs["out_tokens"], outs["num_accepted"]
            else:
                out, accepted = self.decode_body(inputs)
            return StepOutput.packed(out, accepted, plan.num_draft, inputs.start)

    def _plan_attention(self, plan: DecodePlan) -> None:
        """Plan every forward of the step with exact host lengths. A chained step's starts exist only on the
        device until the previous step finishes: read them back first (a host sync; see flashinfer_backend)."""
        base = plan.base_pos
        if plan.chain is not None:
            with self.tracer.range(ranges.WAIT, chained=True):
                base = plan.inputs.start.cpu().numpy()
        with self.tracer.range(ranges.PLAN, batch=plan.batch_size, k=plan.k):
            b, k = plan.batch_size, plan.k
            lanes = self.graphs.bucket_for(b) if plan.graph else None
            q = np.full(b, k + 1, np.int64) if plan.graph else plan.num_draft + 1
            self.target.attention.plan("verify", q, base + q, plan.page_tables, lanes)
            if self.proposer is not None:
                self.proposer.plan_attention(plan, base, q, lanes)

    def plan_graph_padding(self, k: int, lanes: int, refill: bool) -> None:
        """Before capturing a decode graph: plan each of its forwards for an all-padding batch, so the graph
        records the attention buffers later plans rewrite in place."""
        self.target.attention.plan_padding("verify", lanes, k + 1)
        if self.proposer is not None:
            self.proposer.plan_padding(k, lanes, refill)

    def decode_body(self, inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """draft -> verify -> accept -> refill over tensors only (graph-capturable)."""
        drafts, draft_probs = self._draft(inputs)
        with self.tracer.range(ranges.VERIFY, track=DEVICE_TRACK):
            hidden = self.target(self._verify_batch(inputs), self.pool)
        out, accepted = self._accept(inputs, hidden, drafts, draft_probs)
        if self.proposer is not None:
            self.proposer.after_verify(inputs, out, accepted, hidden, self.tracer)
        return out, accepted

    def _draft(self, inputs: DecodeInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The step's drafts [B, k] in the verify grid (proposed on the device, or written there by the host) and
        their distributions (None: host drafts, or every request greedy); (None, None) at k = 0."""
        k, grid = inputs.k, inputs.grid
        if k == 0:
            return None, None
        if self.proposer.drafts_on_host:
            return grid[:, 1:], None  # written by the host when it built the step
        with self.tracer.range(ranges.DRAFT, track=DEVICE_TRACK):
            drafts, draft_probs = self.proposer.propose(inputs)
            if self.leader_drafts:
                drafts = self.tp.broadcast(drafts.contiguous())  # the verify batch's drafts, from rank 0
        grid[:, 1:] = drafts
        return drafts, draft_probs

    def _verify_batch(self, inputs: DecodeInputs) -> ForwardBatch:
        return ForwardBatch.derive(inputs.verify_layout, inputs.start, self._verify_ids(inputs), slot="verify")

    @staticmethod
    def _verify_ids(inputs: DecodeInputs) -> torch.Tensor:
        """[last, d1 .. d_num_draft] per request, flat in the verify layout's order, drafts plugged in on device."""
        grid = inputs.grid
        return grid.reshape(-1) if inputs.verify_is_grid else grid.reshape(-1)[inputs.verify_flat_index()]

    def _accept(self, inputs: DecodeInputs, hidden: torch.Tensor, drafts: torch.Tensor | None,
                draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [B, k + 1] and accepted drafts [B] from the verify rows' hidden states."""
        b, k = inputs.batch_size, inputs.k
        with self.tracer.range(ranges.ACCEPT, track=DEVICE_TRACK):
            first_pos = inputs.start + 1
            if k == 0:
                out = sample(self.target.compute_logits(hidden), inputs.st, first_pos).unsqueeze(1)
                return out, torch.zeros(b, dtype=torch.long, device=self.device)
            logits = self.target.compute_logits(hidden)
            # [B, k + 1, V] (a batch-8 verify step's gather copied 7.9 MB of logits, ~1.8 ms on CPU)
            logits = logits.view(b, k + 1, -1) if inputs.verify_is_grid else logits[inputs.verify_rows()]
            if self.leader_drafts and self.tp.rank != 0:
                # Only the leader has the draft's distributions: its acceptance arrives below.
                out = torch.zeros(b, k + 1, dtype=torch.long, device=self.device)
                accepted = torch.zeros(b, dtype=torch.long, device=self.device)
            else:
                out, accepted = rejection_sample(drafts, draft_probs, logits, inputs.num_draft, inputs.st, first_pos)
            if self.leader_drafts:
                out, accepted = self.tp.broadcast(out.contiguous()), self.tp.broadcast(accepted.contiguous())
            return out, accepted

