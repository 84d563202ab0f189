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

from engine.batch_builder import build_forward_batch
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
        positions = torch.from_numpy(start + q_lens).to(self.device)
        tokens = sample(self.target.compute_logits(hidden[last]), st, positions)
        if self.proposer is not None and self.proposer.has_model:
            self.proposer.prefill(seqs, hidden, q_lens, tokens, st)
        return tokens

    def decode_context(self, seqs: list[SeqState], num_draft: np.ndarray) -> DecodeContext:
        return DecodeContext(
            seqs=seqs, k=int(num_draft.max(initial=0)), num_draft=num_draft,
            base_pos=np.array([s.num_computed for s in seqs], dtype=np.int64),
            st=self.sampling_tensors(seqs),
            slots=torch.tensor([s.slot for s in seqs], device=self.device),
            page_size=self.page_size, device=self.device,
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
        b, k = ctx.batch_size, ctx.k

        drafts = draft_probs = None
        if k > 0:
            if host_drafts is not None:
                grid = np.zeros((b, k), dtype=np.int64)
                for i, d in enumerate(host_drafts):
                    grid[i, : num_draft[i]] = d[: num_draft[i]]
                drafts = torch.from_numpy(grid).to(self.device)
            else:
                drafts, draft_probs = self.proposer.propose(ctx)

        # Verify: [last, d1 .. d_num_draft] per request; drafts are plugged in on device.
        q_lens = ctx.verify_q_lens
        ids = np.zeros((b, k + 1), dtype=np.int64)
        ids[:, 0] = [s.token_ids[-1] for s in seqs]
        fb = build_forward_batch(ids, ctx.base_pos, ctx.page_tables, self.page_size, self.device, q_lens=q_lens)
        if k > 0:
            grid = torch.from_numpy(ids).to(self.device)
            grid[:, 1:] = drafts
            fb.input_ids = grid[torch.from_numpy(np.arange(k + 1)[None, :] < q_lens[:, None]).to(self.device)]
        hidden = self.target(fb, self.pool)

        first_pos = torch.from_numpy(ctx.base_pos + 1).to(self.device)
        if k == 0:
            out = sample(self.target.compute_logits(hidden), ctx.st, first_pos).unsqueeze(1)
            accepted = torch.zeros(b, dtype=torch.long, device=self.device)
        else:
            rows = torch.from_numpy(ctx.verify_row_index()).to(self.device)
            logits = self.target.compute_logits(hidden)[rows]  # [B, k + 1, V]
            num_draft_dev = torch.from_numpy(num_draft).to(self.device)
            out, accepted = rejection_sample(drafts, draft_probs, logits, num_draft_dev, ctx.st, first_pos)
        if self.proposer is not None and self.proposer.has_model:
            self.proposer.refill(ctx, out, accepted, hidden)
        return StepOutput(out_tokens=out, num_accepted=accepted, num_draft=num_draft)
