"""A host proposer's plain step can be chained: `StepEngine.can_chain` says yes for an n-gram
engine when no lane drafts, and such a step, built blind on the previous step's device outputs, emits exactly
the tokens of one built after the previous step was read back."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from specstep.engine.sampling_params import SamplingParams
from specstep.engine.step_context import Chain
from tests.helpers import make_core

PROMPTS = [[7, 8, 9, 10] * 3, [1, 2, 3, 4, 5] * 2 + [6], [11, 40, 3]]
STEPS = 4


@dataclass
class Seq:
    token_ids: list[int]
    page_table: list[int]
    params: SamplingParams
    seed: int
    slot: int
    num_computed: int = 0
    out: list[int] = field(default_factory=list)


class Done:
    """A finished step's handle (`Chain.prev`): what the core's stream hands the next step."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def _seqs(core, params: SamplingParams) -> list[Seq]:
    return [Seq(list(p), core.allocator.allocate(core.allocator.pages_for(len(p) + 2 * STEPS + 8)), params,
                seed=100 + i, slot=i) for i, p in enumerate(PROMPTS)]


def _prefill(engine, seqs: list[Seq]) -> None:
    first = engine.prefill(seqs).tolist()
    for s, t in zip(seqs, first):
        s.num_computed = len(s.token_ids)
        s.token_ids.append(t)
        s.out.append(t)


def _apply(seqs: list[Seq], out) -> None:
    accepted, tokens = out.read()
    for s, a, row in zip(seqs, accepted, tokens):
        new = row[: a + 1]
        s.num_computed += len(new)
        s.token_ids += new
        s.out += new


def _run(core, params: SamplingParams, chained: bool) -> list[list[int]]:
    engine = core.engine
    seqs = _seqs(core, params)
    _prefill(engine, seqs)
    plain = np.zeros(len(seqs), dtype=np.int64)
    out = engine.run_decode(engine.plan_decode(seqs, plain))
    for _ in range(STEPS - 1):
        if chained:
            # Planned before `out` is read: the host's token_ids and num_computed are one step stale.
            rows = np.arange(len(seqs), dtype=np.int64)
            nxt = engine.run_decode(engine.plan_decode(seqs, plain, Chain(prev=Done(out), src=rows, dst=rows)))
            _apply(seqs, out)
            out = nxt
        else:
            _apply(seqs, out)
            out = engine.run_decode(engine.plan_decode(seqs, plain))
    _apply(seqs, out)
    for s in seqs:
        core.allocator.free(s.page_table)
    return [s.out for s in seqs]


@pytest.fixture(scope="module")
def ngram_core(tiny_target):
    return make_core(tiny_target, spec="ngram", num_spec_tokens=3)


def test_can_chain(ngram_core, tiny_target):
    engine = ngram_core.engine
    assert engine.can_chain(np.zeros(3, dtype=np.int64))
    assert not engine.can_chain(np.array([0, 2, 0]))
    assert make_core(tiny_target).engine.can_chain(np.array([0, 2, 0]))  # no proposer: nothing drafts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chained_plain_step_matches_unchained(ngram_core, temperature):
    params = SamplingParams(temperature=temperature, max_tokens=64, ignore_eos=True)
    ref = _run(ngram_core, params, chained=False)
    got = _run(ngram_core, params, chained=True)
    assert got == ref
    assert all(len(o) == STEPS + 1 for o in ref)
