"""Tensor-parallel steps: the leader's step-engine calls, replayed on every follower rank.

Every rank holds a `StepEngine` over its shard of the target (and of the MTP head); only the leader (rank 0) runs
the scheduler. Each device job the leader's `EngineCore` submits (a prefill or mixed step, a decode step, a
catch-up) is described in one host message, broadcast once, and replayed by the followers with the same
arguments, so every rank runs the same forwards in the same order and meets the leader in each collective:

    leader  (scheduler thread)  plan_decode -> message built from the host state the step was planned on
    leader  (device job)        broadcast(message) -> run_decode        (all-reduces / all-gathers inside)
    follower                    message = broadcast() -> decode_context -> run_decode

Sampling, acceptance and the MTP head run on every rank: logits are gathered identically everywhere and the
random draws are hashes of (seed, position), so every rank computes the leader's tokens without a round trip,
and a chained step patches its inputs from its own rank's previous outputs. A draft *model* runs on the leader
only (a small model gains nothing from the split): its drafts, and the
acceptance it alone can compute (the followers have no draft distributions), reach the followers in two
broadcasts inside the step (`StepEngine.decode_body`). N-gram drafts are host data and travel in the message.

Messages carry request state as deltas: a follower mirrors each slot's token list and receives only the tokens
appended since the last message (a request new to its slot is sent whole). Messages are numbered; a follower
checks it applies them in the order the leader built them.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from specstep.engine.parallel.group import TPGroup
from specstep.engine.proposers.base import Proposer
from specstep.engine.sampling_params import SamplingParams
from specstep.engine.step_context import Chain, DecodeInputs, DecodePlan, SeqState

if TYPE_CHECKING:
    from specstep.engine.step_engine import StepEngine, StepOutput

STOP = "stop"
log = logging.getLogger("specstep.tp")


@dataclass(slots=True)
class SeqView:
    """A follower's mirror of one request (the fields a step reads: `engine.step_context.SeqState`)."""

    token_ids: list[int]
    num_computed: int
    page_table: list[int]
    params: SamplingParams
    seed: int
    slot: int


class SeqSync:
    """Leader side: what each slot's mirror on the followers already holds."""

    def __init__(self) -> None:
        # slot -> (the request object, tokens sent). The object itself, not its id or request_id: both can be
        # reused, and a stale mirror would silently feed the followers other tokens than the leader's.
        self._sent: dict[int, tuple[SeqState, int]] = {}

    def snapshot(self, seqs: list[SeqState]) -> list[tuple]:
        out = []
        for s in seqs:
            known = self._sent.get(s.slot)
            n = len(s.token_ids)
            if known is None or known[0] is not s or known[1] > n:
                out.append((s.slot, s.num_computed, list(s.page_table), list(s.token_ids), s.params, s.seed))
            else:
                out.append((s.slot, s.num_computed, list(s.page_table), s.token_ids[known[1]:]))
            self._sent[s.slot] = (s, n)
        return out


class SeqMirror:
    """Follower side: slot -> `SeqView`, updated from the leader's snapshots."""

    def __init__(self) -> None:
        self._views: dict[int, SeqView] = {}

    def apply(self, snapshot: list[tuple]) -> list[SeqView]:
        seqs = []
        for entry in snapshot:
            slot, num_computed, pages, tokens = entry[:4]
            if len(entry) == 6:
                view = self._views[slot] = SeqView(tokens, num_computed, pages, entry[4], entry[5], slot)
            else:
                view = self._views[slot]
                view.token_ids.extend(tokens)
                view.num_computed, view.page_table = num_computed, pages
            seqs.append(view)
        return seqs


class _Done:
    """A finished step's handle, as a follower's chained step reads it (`Chain.prev.result()`)."""

    def __init__(self, out) -> None:
        self._out = out

    def result(self):
        return self._out


class LeaderEngine:
    """The leader's step engine, as `EngineCore` sees it (`engine.step_engine_protocol.StepEngineProtocol`):
    each device call is first announced to the followers; the host-side members are the local engine's. What
    start-up needs beyond the protocol (graphs, memory planning) it reads from the local engine, `local`."""

    def __init__(self, engine: StepEngine, tp: TPGroup, group=None) -> None:
        self.local = engine
        self.tp = tp
        self._group = group  # the follower processes (`scheduler.parallel.tp_group.TPGroupHandle`): stop / kill
        self._sync = SeqSync()
        self._seq = 0
        self._lock = threading.Lock()  # messages are numbered in the order they are built
        # Followers hold no draft model: its catch-ups are the leader's alone.
        self._followers_catch_up = engine.has_draft_model and not engine.leader_drafts

    @property
    def proposer(self) -> Proposer | None:
        return self.local.proposer

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    @property
    def has_draft_model(self) -> bool:
        return self.local.has_draft_model

    def _message(self, kind: str, *payload) -> tuple:
        with self._lock:
            self._seq += 1
            return (self._seq, kind, *payload)

    def _send(self, message: tuple) -> None:
        self.tp.broadcast_object(message)

    def prefill(self, seqs: list[SeqState], with_proposer: bool | list[bool] = True, q_lens=None) -> torch.Tensor:
        self._send(self._message("prefill", self._sync.snapshot(seqs), with_proposer,
                                 None if q_lens is None else np.asarray(q_lens, dtype=np.int64)))
        return self.local.prefill(seqs, with_proposer, q_lens)

    def catch_up(self, seqs: list[SeqState], draft_lens: list[int]) -> None:
        if self._followers_catch_up:
            self._send(self._message("catch_up", self._sync.snapshot(seqs), list(draft_lens)))
        return self.local.catch_up(seqs, draft_lens)

    def can_chain(self, num_draft: np.ndarray) -> bool:
        return self.local.can_chain(num_draft)

    def plan_decode(self, seqs: list[SeqState], num_draft: np.ndarray, chain: Chain | None = None,
                    refill: bool = True) -> DecodePlan:
        plan = self.local.plan_decode(seqs, num_draft, chain, refill)
        host_drafts = None
        if plan.k > 0 and self.local.proposer.drafts_on_host:
            host_drafts = [row[1: 1 + n].tolist() for row, n in zip(plan.input_grid, plan.num_draft)]
        chain_rows = None if chain is None else (chain.src, chain.dst)
        # Built now, from the host state this step was planned on; sent when the step runs (job order).
        return replace(plan, tp_message=self._message("decode", self._sync.snapshot(seqs), plan.num_draft.copy(),
                                                      host_drafts, chain_rows, refill))

    def run_decode(self, plan: DecodePlan) -> StepOutput:
        if plan.tp_message is None:  # built by the wrapped engine directly: the followers would not know the step
            raise RuntimeError("at tensor-parallel size > 1 a decode step must be planned with plan_decode")
        self._send(plan.tp_message)
        return self.local.run_decode(plan)

    def fuses_mixed(self, plan: DecodePlan) -> bool:
        """The followers replay decode steps and prompt forwards: a mixed step runs as those two."""
        return False

    def run_mixed(self, plan: DecodePlan, seqs: list[SeqState], with_proposer: list[bool],
                  q_lens: list[int]) -> tuple[StepOutput, torch.Tensor]:
        raise RuntimeError("at tensor-parallel size > 1 a mixed step runs as a decode step and a prompt forward")

    def close(self, failed: bool = False) -> None:
        """Release the followers (they exit their loop) and leave the group. After a failure the followers may
        be inside a collective of a step the leader left: no stop message (it would pair with that collective),
        they are killed."""
        if failed:
            if self._group is not None:
                self._group.kill()
            return
        try:
            self._send(self._message(STOP))
        except Exception as e:  # noqa: BLE001 (a broken group at shutdown: report it, kill what is left)
            log.warning("tensor-parallel group already broken at shutdown: %s", e)
            if self._group is not None:
                self._group.kill()
            return
        if self._group is not None:
            self._group.stop()
        self.tp.close()


def follow(engine, tp: TPGroup) -> None:
    """A follower rank's loop: replay the leader's device calls until it says stop (or the group breaks, which
    raises here: the process exits and the supervisor restarts the whole group)."""
    mirror, last_out, expected = SeqMirror(), None, 1
    while True:
        message = tp.broadcast_object()
        seq, kind, *payload = message
        if seq != expected:
            raise RuntimeError(f"tensor-parallel message {seq} arrived, expected {expected}")
        expected += 1
        if kind == STOP:
            return
        if kind == "prefill":
            snapshot, with_proposer, q_lens = payload
            engine.prefill(mirror.apply(snapshot), with_proposer, q_lens)
        elif kind == "catch_up":
            snapshot, draft_lens = payload
            engine.catch_up(mirror.apply(snapshot), draft_lens)
        elif kind == "decode":
            snapshot, num_draft, host_drafts, chain_rows, refill = payload
            chain = None if chain_rows is None else Chain(prev=_Done(last_out), src=chain_rows[0], dst=chain_rows[1])
            plan = engine.decode_context(mirror.apply(snapshot), num_draft, host_drafts, chain, refill)
            last_out = engine.run_decode(plan)
        else:
            raise RuntimeError(f"unknown tensor-parallel message {kind!r}")


class LeaderDraft(Proposer):
    """A follower's stand-in for the draft model that runs on the leader only: it proposes by receiving the
    leader's drafts (`StepEngine.decode_body` broadcasts them) and keeps no state of its own: no pool, no network,
    nothing to plan (`Proposer`'s defaults)."""

    kind = "draft_model"
    has_model = True
    refills = True  # as the leader's draft model: every rank captures and replays the same graphs
    leader_only = True

    def __init__(self, kv_lookahead: int, device: torch.device) -> None:
        self.kv_lookahead = kv_lookahead  # the leader's draft writes past the verify window: same page widths
        self.device = device

    def propose(self, inputs: DecodeInputs) -> tuple[torch.Tensor, None]:
        return torch.zeros(inputs.batch_size, inputs.k, dtype=torch.long, device=self.device), None
