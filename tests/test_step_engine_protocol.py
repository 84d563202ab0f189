"""Engines and proposers are reached through declared interfaces: the tensor-parallel leader implements every
member of `StepEngineProtocol` itself (no `__getattr__` forwarding), and every proposer answers the members
callers use, with the documented defaults where it has no network."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from specstep.engine.engine_config import EngineConfig
from specstep.engine.kv_cache import KVPool
from specstep.engine.parallel.group import SINGLE
from specstep.engine.parallel.tp_engine import LeaderDraft, LeaderEngine
from specstep.engine.proposers.base import Proposer
from specstep.engine.proposers.ngram import NgramProposer
from specstep.engine.step_engine import StepEngine
from specstep.engine.step_engine_protocol import StepEngineProtocol
from specstep.scheduler.build import build_step_engine
from tests.fixtures_models import make_mtp_head

MEMBERS = ({n for n in vars(StepEngineProtocol) if not n.startswith("_")}
           | set(StepEngineProtocol.__annotations__))
PROPOSER_MEMBERS = ("kind", "has_model", "drafts_on_host", "leader_only", "kv_lookahead", "shift", "pool", "network",
                    "max_context", "plan_attention", "plan_padding", "after_prefill", "prefill", "can_chain",
                    "plan_drafts", "propose_host", "propose", "after_verify", "refill", "keep_prefill", "keep",
                    "catch_up", "carried_state")


def local_engine(model, **cfg) -> StepEngine:
    cfg = EngineConfig(model=str(model), device="cpu", kv_cache_tokens=512, max_batch_size=2, **cfg)
    return build_step_engine(cfg).step_engine


def test_the_protocol_lists_what_the_scheduler_calls():
    assert MEMBERS == {"tp", "proposer", "vocab_size", "has_draft_model", "prefill", "catch_up", "plan_decode",
                       "can_chain", "run_decode", "fuses_mixed", "run_mixed", "close"}


def test_the_leader_implements_each_member_itself(tiny_target):
    local = local_engine(tiny_target)
    leader = LeaderEngine(local, SINGLE)
    assert all("__getattr__" not in vars(c) for c in LeaderEngine.__mro__)
    assert LeaderEngine.__getattribute__ is object.__getattribute__
    for name in MEMBERS:
        inspect.getattr_static(leader, name)  # raises AttributeError where only forwarding would find it
    assert isinstance(leader, StepEngineProtocol)
    assert (leader.proposer, leader.vocab_size, leader.has_draft_model, leader.tp) == (None, local.vocab_size,
                                                                                        False, SINGLE)


def test_the_local_engine_implements_each_member(tiny_target):
    local = local_engine(tiny_target)
    missing = {name for name in MEMBERS if not _has_static(local, name)}
    assert not missing, missing


def test_the_local_engine_satisfies_the_protocol(tiny_target):
    assert isinstance(local_engine(tiny_target), StepEngineProtocol)


def _has_static(obj, name: str) -> bool:
    try:
        inspect.getattr_static(obj, name)
    except AttributeError:
        return False
    return True


@pytest.mark.parametrize("make", ["ngram", "leader_draft"])
def test_proposers_without_a_network_have_the_documented_defaults(make):
    device = torch.device("cpu")
    proposer = NgramProposer(device) if make == "ngram" else LeaderDraft(1, device)
    assert (proposer.network, proposer.pool, proposer.shift, proposer.max_context) == (None, None, 0, None)
    assert proposer.plan_attention(None, np.zeros(1, np.int64), np.ones(1, np.int64), None) is None
    assert proposer.plan_padding(2, 4, True) is None
    # Nothing to consume after a prefill, nothing to refill or keep after a verify: no device work at all.
    calls = []
    for name in ("prefill", "keep_prefill", "refill", "keep"):
        setattr(proposer, name, lambda *a, name=name: calls.append(name))
    proposer.after_prefill([], np.zeros(1, np.int64), np.ones(1, np.int64), np.ones(1, bool), np.array([0, 1]),
                           torch.zeros(1, 4), torch.zeros(1, dtype=torch.long), np.ones(1, bool),
                           lambda arrays: calls.append("upload"))
    proposer.after_verify(None, torch.zeros(1, 1), torch.zeros(1), torch.zeros(1, 4), None)
    assert calls == []
    # The n-gram proposer drafts on the host and everywhere; the leader's draft model on the device, rank 0 only.
    assert (proposer.drafts_on_host, proposer.leader_only) == ((True, False) if make == "ngram" else (False, True))


class _Seq:
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids


def test_plan_drafts_caps_each_request_at_what_its_proposer_can_draft(tiny_target, tmp_path):
    seqs = [_Seq([1, 2, 3, 1, 2, 3, 1]), _Seq([5, 6, 7])]  # a repeat to look up, and none
    ngram = NgramProposer(torch.device("cpu"))
    for refill in (True, False):  # no KV of its own: a dropped refill changes nothing
        num_draft, drafts = ngram.plan_drafts(seqs, np.array([2, 2]), refill)
        assert num_draft.tolist() == [2, 0] and drafts == [[2, 3], []]
    head = make_mtp_head(tmp_path / "head", tiny_target)
    mtp = local_engine(tiny_target, spec="mtp", draft=str(head)).proposer
    assert [(n.tolist(), d) for n, d in (mtp.plan_drafts(seqs, np.array([2, 1]), r) for r in (True, False))] \
        == [([2, 1], None), ([0, 0], None)]  # drafts on the device; stale without its refill


def test_model_proposers_answer_the_same_members(tiny_target, tiny_draft, tmp_path):
    head = make_mtp_head(tmp_path / "head", tiny_target)
    for spec, draft, shift in (("draft_model", tiny_draft, 0), ("mtp", head, 1)):
        proposer = local_engine(tiny_target, spec=spec, draft=str(draft)).proposer
        for name in PROPOSER_MEMBERS:
            assert _has_static(proposer, name), (spec, name)
        assert isinstance(proposer.pool, KVPool) and isinstance(proposer.network, torch.nn.Module)
        assert proposer.shift == shift and proposer.max_context == proposer.network.cfg.max_position_embeddings
    for name in PROPOSER_MEMBERS:  # declared on the interface itself, not only where a subclass has it
        assert _has_static(Proposer, name), name
