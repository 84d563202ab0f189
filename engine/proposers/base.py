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

from specstep.engine.argmax import argmax
from specstep.engine.batch_builder import Upload
from specstep.engine.kv_cache import KVPool
from specstep.engine.random import DRAFT
from specstep.engine.sampler import processed_probs, sample_from_probs
from specstep.engine.sampling_params import SamplingTensors
from specstep.engine.step_context import DecodeInputs, DecodePlan, SeqState
from specstep.traces.tracer import Tracer


class Proposer(ABC):
    """Every member a caller uses, with the default a proposer without a network of its own (n-gram, and a
    tensor-parallel follower's `LeaderDraft`) has: no pool, no network, no attention to plan, nothing to consume,
    keep or catch up. Model proposers (`model_proposer.ModelProposer`) override them; so a caller calls these on
    any proposer instead of branching on `has_model`."""

    kind: str = ""
    #: model proposers keep a KV cache, need prefill and refill and draft on the device; host proposers (n-gram)
    #: propose on the CPU at build time (`propose_host`)
    has_model: bool = True
    #: the host writes the drafts into the step's input grid when it builds the step (`plan_drafts`); False: the
    #: device drafts them inside the step (`propose`). The step engine needs it to know whether drafting is device
    #: work of the step at all (its trace range, its write of the drafts into the verify input)
    drafts_on_host: bool = False
    #: a step's `refill` flag changes the proposer's work in it (`after_verify`: refill, else keep), so a step
    #: without refill replays graphs of its own (`step_graphs`); False: nothing to refill, and a step runs the
    #: same work whatever the flag says
    refills: bool = False
    #: at tensor-parallel size > 1 the proposer runs on the leader only (a draft model: a small model gains nothing
    #: from the split), so its drafts and the acceptance only it can compute are broadcast inside the step
    leader_only: bool = False
    #: extra look-ahead tokens past the verify window that the proposer writes into the shared pages
    kv_lookahead: int = 0
    #: positions the draft lags the target by (MTP: it consumes (h[p-1], t[p]) at p - 1; `model_proposer`); a
    #: step's pages cover the refill's writes at n + 1 - shift onwards
    shift: int = 0
    #: the proposer's own KV pool, sized with the target's by the memory plan; None: it keeps no KV here
    pool: KVPool | None = None

    @property
    def network(self) -> torch.nn.Module | None:
        """The proposer's own network on this rank (a draft model or an MTP head; it gets an attention backend
        like the target's); None without one."""
        return None

    @property
    def max_context(self) -> int | None:
        """The longest sequence the proposer drafts within (a draft model's own context); None: no limit."""
        return None

    def plan_attention(self, plan: DecodePlan, base: np.ndarray, verify_q: np.ndarray, lanes: int | None) -> None:
        """Plan the proposer's forwards of a decode step (backends that need exact host lengths, FlashInfer);
        nothing without a network."""

    def plan_padding(self, k: int, lanes: int, refill: bool) -> None:
        """Plan the proposer's forwards for an all-padding batch before graph capture; nothing without a
        network."""

    def after_prefill(self, seqs: list[SeqState], start: np.ndarray, q_lens: np.ndarray, final: np.ndarray,
                      cu: np.ndarray, target_hidden: torch.Tensor, sampled: torch.Tensor, consume: np.ndarray,
                      upload: Upload) -> None:
        """The proposer's part of a target prefill or mixed step over ragged runs (`cu`: their offsets in the
        flat `target_hidden`): rows in `consume` (bool [B]) consume their chunk (`prefill`), the others keep
        what a catch-up needs (`keep_prefill`). `upload` is the step's own staging: the rows this needs travel
        with the step's inputs, and the proposer's staging sets keep their budget of uploads per step. Nothing
        without a network."""

    def prefill(self, seqs: list[SeqState], start: np.ndarray, q_lens: np.ndarray, final: np.ndarray,
                target_hidden: torch.Tensor, sampled: torch.Tensor) -> None:
        """Consume the target's prefill chunk token_ids[start : start + q_lens] of each request (its hidden
        states: `target_hidden`, ragged); a *final* chunk (it ends at the last prompt token) also consumes the
        target's sampled token (device tensor) and carries state into the first decode step."""

    def can_chain(self, num_draft: np.ndarray) -> bool:
        """Whether a step drafting `num_draft[i]` tokens for request i can be built blind, before the previous
        step's tokens reach the host (its starts and last tokens patched on the device, `Chain`). A model
        proposer drafts on the device from those patched inputs: always."""
        return True

    def propose_host(self, seqs: list[SeqState], k: int) -> list[list[int]] | None:
        """Drafts known on the host at build time (n-gram); None for model proposers."""
        return None

    def draft_limits(self, token_ids: list[list[int]], k: int) -> np.ndarray | None:
        """[B] how many of k drafts the proposer would make for each request's current tokens, where it knows
        before the step (n-gram: its lookup's length); None where it does not (model proposers: always k)."""
        return None

    def plan_drafts(self, seqs: list[SeqState], num_draft: np.ndarray, refill: bool
                    ) -> tuple[np.ndarray, list[list[int]] | None]:
        """For a step asked to draft num_draft[i] tokens for request i (a refill dropped where `refill` is
        False): how many each drafts (never more), and the drafts where the host knows them now (`drafts_on_host`),
        else None (`propose` drafts them on the device). By default: as asked, on the device."""
        return num_draft, None

    def propose(self, inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [B, k] and their distributions [B, k, V] (None when every request is greedy)."""
        raise NotImplementedError(f"{self.kind} proposes on the host (propose_host)")

    def refill(self, inputs: DecodeInputs, out_tokens: torch.Tensor, num_accepted: torch.Tensor,
               target_hidden: torch.Tensor) -> None:
        """Bring the draft's KV and carried state up to date with the tokens just emitted."""

    def keep_prefill(self, seqs: list[SeqState], start: np.ndarray, q_lens: np.ndarray,
                     target_hidden: torch.Tensor) -> None:
        """A prefill chunk (or a mixed step's decode row) ran without the proposer: keep what `catch_up` will
        need (device only)."""

    def after_verify(self, inputs: DecodeInputs, out_tokens: torch.Tensor, num_accepted: torch.Tensor,
                     target_hidden: torch.Tensor, tracer: Tracer) -> None:
        """The proposer's part of a decode step after acceptance (device only, graph-capturable): `refill` where
        the step keeps it current (`inputs.refill`), else `keep`; `tracer` records the refill's range. Nothing
        without a network."""

    def keep(self, inputs: DecodeInputs, target_hidden: torch.Tensor) -> None:
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
    greedy = argmax(logits)
    if st.all_greedy:
        return greedy, None
    q = processed_probs(logits, st)
    sampled = sample_from_probs(q, st.seeds, positions, DRAFT)
    return (torch.where(st.greedy, greedy, sampled) if st.any_greedy else sampled), q
