"""The step engine: prefill, decode and speculative decode over the paged target and a proposer.

A speculative step, all on device after the host has built its inputs:

    draft    proposer extends each request by num_draft[b] <= k tokens (from carried logits)
    verify   the target runs [last, d1 .. d_num_draft] per request in one ragged forward
    accept   rejection sampling -> out_tokens [B, k+1], num_accepted [B]            (no host sync)
    refill   the proposer re-runs over the emitted tokens, carrying logits forward  (no host sync)

k = 0 is plain decoding (the proposer, if any, still refills so it can resume speculating later). The one host
sync is the caller reading `StepOutput` back, as late as it likes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.batch_builder import build_forward_batch, build_layout, to_device
from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVPool
from engine.models.llama import LlamaForCausalLM
from engine.proposers.base import Proposer
from engine.rejection_sampler import rejection_sample
from engine.sampler import sample
from engine.sampling_params import SamplingTensors
from engine.step_context import DecodeContext, SeqState


@dataclass(slots=True)
class StepOutput:
    """Device tensors; read them back (the step's only sync) when the host needs the new lengths."""

    out_tokens: torch.Tensor  # [B, k + 1]
    num_accepted: torch.Tensor  # [B] accepted drafts; the step emitted num_accepted + 1 tokens
    num_draft: np.ndarray  # [B] drafts actually proposed (host-known)


class StepEngine:
    def __init__(self, target: LlamaForCausalLM, pool: KVPool, proposer: Proposer | None,
                 device: torch.device) -> None:
        self.target = target
        self.pool = pool
        self.proposer = proposer
        self.device = device
        self.vocab_size = target.cfg.vocab_size

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def has_draft_model(self) -> bool:
        return self.proposer is not None and self.proposer.has_model

    def sampling_tensors(self, seqs: list[SeqState]) -> SamplingTensors:
        return SamplingTensors.build([s.params for s in seqs], [s.seed for s in seqs], self.vocab_size, self.device)

    @torch.inference_mode()
    def prefill(self, seqs: list[SeqState]) -> torch.Tensor:
        """Run each request's uncomputed tokens; return the sampled next token per request [B] (device)."""
        ids = [s.token_ids[s.num_computed:] for s in seqs]
        start = np.array([s.num_computed for s in seqs], dtype=np.int64)
        q_lens = np.array([len(t) for t in ids], dtype=np.int64)
        fb = build_forward_batch(ids, start, [s.page_table for s in seqs], self.page_size, self.device)
        hidden = self.target(fb, self.pool)
        last = torch.from_numpy(np.cumsum(q_lens) - 1).to(self.device)
        st = self.sampling_tensors(seqs)
        tokens = sample(self.target.compute_logits(hidden[last]), st, to_device(start + q_lens, self.device))
        if self.has_draft_model:
            self.proposer.prefill(seqs, hidden, q_lens, tokens, st)
        return tokens

    def decode_context(self, seqs: list[SeqState], num_draft: np.ndarray) -> DecodeContext:
        """Host-side batch preparation for a decode step."""
        base = np.array([s.num_computed for s in seqs], dtype=np.int64)
        tables = [s.page_table for s in seqs]
        return DecodeContext(
            seqs=seqs, k=int(num_draft.max(initial=0)), num_draft=num_draft, base_pos=base,
            start=to_device(base, self.device), st=self.sampling_tensors(seqs),
            slots=to_device(np.array([s.slot for s in seqs], dtype=np.int64), self.device),
            verify_layout=build_layout(num_draft + 1, tables, self.page_size, self.device),
            single_layout=build_layout(np.ones(len(seqs), np.int64), tables, self.page_size, self.device),
            device=self.device,
        )

    @torch.inference_mode()
    def decode(self, seqs: list[SeqState], num_draft: np.ndarray) -> StepOutput:
        """One decode step; request b speculates num_draft[b] tokens (0 = plain decoding for it)."""
        num_draft = np.asarray(num_draft, dtype=np.int64).copy()
        if self.proposer is None:
            num_draft[:] = 0
        host_drafts = self.proposer.propose_host(seqs, int(num_draft.max(initial=0))) if self.proposer else None
        if host_drafts is not None:
            num_draft = np.minimum(num_draft, [len(d) for d in host_drafts])
        ctx = self.decode_context(seqs, num_draft)
        return self.run_decode(ctx, host_drafts)

    def run_decode(self, ctx: DecodeContext, host_drafts: list[list[int]] | None = None) -> StepOutput:
        """The device part of a decode step (no host sync)."""
        b, k = ctx.batch_size, ctx.k
        grid = np.zeros((b, k + 1), dtype=np.int64)
        grid[:, 0] = [s.token_ids[-1] for s in ctx.seqs]
        drafts = draft_probs = None
        if k > 0 and host_drafts is not None:
            for i, d in enumerate(host_drafts):
                grid[i, 1: 1 + ctx.num_draft[i]] = d[: ctx.num_draft[i]]
        grid_dev = to_device(grid, self.device)
        if k > 0:
            if host_drafts is not None:
                drafts = grid_dev[:, 1:]
            else:
                drafts, draft_probs = self.proposer.propose(ctx)
                grid_dev[:, 1:] = drafts
        # Verify: [last, d1 .. d_num_draft] per request, drafts plugged in on device.
        fb = ForwardBatch.derive(ctx.verify_layout, ctx.start, grid_dev.reshape(-1)[ctx.verify_flat_index()])
        hidden = self.target(fb, self.pool)

        first_pos = ctx.start + 1
        if k == 0:
            out = sample(self.target.compute_logits(hidden), ctx.st, first_pos).unsqueeze(1)
            accepted = torch.zeros(b, dtype=torch.long, device=self.device)
        else:
            logits = self.target.compute_logits(hidden)[ctx.verify_rows()]  # [B, k + 1, V]
            out, accepted = rejection_sample(drafts, draft_probs, logits, to_device(ctx.num_draft, self.device),
                                             ctx.st, first_pos)
        if self.has_draft_model:
            self.proposer.refill(ctx, out, accepted, hidden)
        return StepOutput(out_tokens=out, num_accepted=accepted, num_draft=ctx.num_draft)
