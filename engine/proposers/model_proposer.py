"""What the draft-model and MTP proposers share: carried state per request slot, the draft loop, refill.

Both consume sequence tokens at a fixed shift from the target's positions:

    seq position   p:   0    1    2   ...  n (last token)   n+1 (draft 1) ...
    draft model  (shift 0) consumes t[p] at position p        -> predicts t[p+1]
    MTP head     (shift 1) consumes (h[p-1], t[p]) at p - 1    -> predicts t[p+1]

so prefill feeds token_ids[shift:] + [sampled] at positions 0.., refill feeds the emitted tokens at
n + 1 - shift onwards, and draft j (at seq position n + j) is consumed at n + j - shift.
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np
import torch

from specstep.engine.attention.backend import AttentionBackend
from specstep.engine.batch_builder import Upload, build_forward_batch
from specstep.engine.forward_batch import ForwardBatch
from specstep.engine.kv_cache import KVPool
from specstep.engine.proposers.base import Proposer, draw
from specstep.engine.staging import Staging
from specstep.engine.step_context import DecodeInputs, DecodePlan, SeqState
from specstep.traces import ranges
from specstep.traces.ranges import DEVICE_TRACK
from specstep.traces.tracer import Tracer


class ModelProposer(Proposer):
    refills = True

    def __init__(self, pool: KVPool, vocab_size: int, hidden_size: int, max_slots: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.pool = pool
        self.device = device
        self.staging = Staging(device)  # its host -> device inputs (pinned, double-buffered on CUDA)
        # Logits stay float32, as `compute_logits` returns them (sampling and acceptance work in float32 on every
        # path, so draft 1, drawn from these, is drawn exactly as drafts 2..k are). The hidden state is the
        # network's own output and feeds it again (an MTP head's next draft): in the network's dtype, since a
        # float32 copy would promote the head's input concatenation and break its half-precision linears.
        self.carried_logits = torch.zeros(max_slots, vocab_size, device=device, dtype=torch.float32)
        self.carried_hidden = torch.zeros(max_slots, hidden_size, device=device, dtype=dtype)

    @abstractmethod
    def forward(self, fb: ForwardBatch, hidden_in: torch.Tensor | None) -> torch.Tensor:
        """Hidden states [T, d] for the batch's tokens (hidden_in: per-token target/own hidden, heads only)."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    @property
    @abstractmethod
    def network(self) -> torch.nn.Module:
        """The proposer's own network (draft model or head): its `cfg` and its `attention` backend."""

    @property
    def max_context(self) -> int | None:
        return self.network.cfg.max_position_embeddings

    @property
    def attention(self) -> AttentionBackend:
        return self.network.attention

    def plan_attention(self, plan: DecodePlan, base: np.ndarray, verify_q: np.ndarray, lanes: int | None) -> None:
        """Plan the draft loop's and the refill's forwards of a decode step whose requests' last tokens sit at
        `base` (exact host positions); mirrors `propose` and `refill` below."""
        attn, ones = self.attention, np.ones(len(base), np.int64)
        for j in range(1, plan.k):
            pos = np.where(plan.num_draft > j, base + (j - self.shift), base)
            attn.plan(f"draft.{j}", ones, pos + 1, plan.page_tables, lanes)
        if plan.refill:
            attn.plan("refill", verify_q, base + (1 - self.shift) + verify_q, plan.page_tables, lanes)

    def plan_padding(self, k: int, lanes: int, refill: bool) -> None:
        """Plans for an all-padding batch (graph capture), slot by slot as `plan_attention`."""
        for j in range(1, k):
            self.attention.plan_padding(f"draft.{j}", lanes, 1)
        if refill:
            self.attention.plan_padding("refill", lanes, k + 1)

    def carried_state(self) -> dict[str, torch.Tensor]:
        return {"carried_logits": self.carried_logits, "carried_hidden": self.carried_hidden}

    def _carry(self, hidden: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        # No cast: indexed assignment refuses a dtype mismatch, so a network whose output is not in the carried
        # dtype fails here, loudly, instead of being rounded into place.
        h = hidden[rows]
        self.carried_hidden[slots] = h
        self.carried_logits[slots] = self.compute_logits(h)

    def after_prefill(self, seqs: list[SeqState], start: np.ndarray, q_lens: np.ndarray, final: np.ndarray,
                      cu: np.ndarray, target_hidden: torch.Tensor, sampled: torch.Tensor, consume: np.ndarray,
                      upload: Upload) -> None:
        groups = []  # (rows, consume?) with their flat token rows, both sent in one upload
        for mask, eat in ((consume, True), (~consume, False)):
            idx = np.flatnonzero(mask)
            if len(idx):
                flat = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in idx])
                groups.append((idx, eat, flat))
        dev = upload([a for idx, _, flat in groups for a in (flat, idx.astype(np.int64))])
        for g, (idx, eat, _) in enumerate(groups):
            flat_dev, idx_dev = dev[2 * g], dev[2 * g + 1]
            sub = [seqs[i] for i in idx]
            if eat:
                self.prefill(sub, start[idx], q_lens[idx], final[idx], target_hidden[flat_dev], sampled[idx_dev])
            else:
                self.keep_prefill(sub, start[idx], q_lens[idx], target_hidden[flat_dev])

    def plan_drafts(self, seqs: list[SeqState], num_draft: np.ndarray, refill: bool
                    ) -> tuple[np.ndarray, list[list[int]] | None]:
        # Without the refill the draft's KV and carried logits fall behind the target: a stale draft cannot propose.
        return (num_draft if refill else np.zeros_like(num_draft)), None

    def prefill(self, seqs: list[SeqState], start: np.ndarray, q_lens: np.ndarray, final: np.ndarray,
                target_hidden: torch.Tensor, sampled: torch.Tensor) -> None:
        # The target's chunk [c, c + q), one token to the left for a head (t[p] is consumed at p - shift): a
        # head's rows line up with the target's hidden states. A chunk before the last already knows the next
        # prompt token; the last chunk ends with the target's sampled token, filled in on device.
        sh = self.shift
        ids = [s.token_ids[c + sh: c + q] + [0] if f else s.token_ids[c + sh: c + q + sh]
               for s, c, q, f in zip(seqs, start.tolist(), q_lens.tolist(), final.tolist())]
        (last,) = self.staging.upload([np.flatnonzero(final).astype(np.int64)])
        self.run_host_tokens(seqs, ids, start, target_hidden, "prefill", last_token=sampled[last],
                             last_of=last)

    def run_host_tokens(self, seqs: list[SeqState], ids: list[list[int]], start: np.ndarray,
                        hidden_in: torch.Tensor | None, slot: str, last_token: torch.Tensor | None = None,
                        last_of: torch.Tensor | None = None) -> None:
        """Feed ragged host token runs from `start`, and carry state from each run's last token (optionally
        replaced on device by `last_token`, e.g. the target's sampled token, for the runs `last_of` or all)."""
        fb = build_forward_batch(ids, start, [s.page_table for s in seqs], self.pool.page_size, self.device,
                                 self.attention, slot, self.staging.upload)
        last_rows, slots = self.staging.upload([np.cumsum([len(t) for t in ids], dtype=np.int64) - 1,
                                                np.array([s.slot for s in seqs], dtype=np.int64)])
        if last_token is not None:
            fb.input_ids.index_copy_(0, last_rows if last_of is None else last_rows[last_of], last_token)
        hidden = self.forward(fb, hidden_in)
        self._carry(hidden, last_rows, slots)

    def propose(self, inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        slots = inputs.slots
        token, q = draw(self.carried_logits[slots], inputs.st, inputs.start + 1)
        drafts, probs = [token], [q]
        hidden = self.carried_hidden[slots]
        for j in range(1, inputs.k):
            # A request drafting fewer than k tokens has no pages reserved past its own drafts: its lane keeps
            # the batch's shape but reads at its start and writes the dummy page.
            more = inputs.num_draft > j
            pos = torch.where(more, inputs.start + (j - self.shift), inputs.start)
            fb = ForwardBatch.derive(inputs.single_layout, pos, token, write=more, slot=f"draft.{j}")
            hidden = self.forward(fb, hidden)
            token, q = draw(self.compute_logits(hidden), inputs.st, inputs.start + (j + 1))
            drafts.append(token)
            probs.append(q)
        draft_probs = None if probs[0] is None else torch.stack(probs, dim=1)
        return torch.stack(drafts, dim=1), draft_probs

    def after_verify(self, inputs: DecodeInputs, out_tokens: torch.Tensor, num_accepted: torch.Tensor,
                     target_hidden: torch.Tensor, tracer: Tracer) -> None:
        if inputs.refill:
            with tracer.range(ranges.REFILL, track=DEVICE_TRACK):
                self.refill(inputs, out_tokens, num_accepted, target_hidden)
        else:
            self.keep(inputs, target_hidden)

    def refill(self, inputs: DecodeInputs, out_tokens: torch.Tensor, num_accepted: torch.Tensor,
               target_hidden: torch.Tensor) -> None:
        ids = out_tokens.reshape(-1)[inputs.verify_flat_index()]
        fb = ForwardBatch.derive(inputs.verify_layout, inputs.start + (1 - self.shift), ids, slot="refill")
        hidden = self.forward(fb, target_hidden)
        carry_rows = inputs.verify_layout.q_index[:, 0] + num_accepted
        self._carry(hidden, carry_rows, inputs.slots)
