"""The greedy readout (`engine/argmax.cpp`): the indices torch.argmax(dim=-1) returns, ties, NaNs and infinities
included, on one thread and both; and the samplers read their greedy tokens through it."""

from __future__ import annotations

import pytest
import torch

from specstep.engine import argmax as am
from specstep.engine.rejection_sampler import rejection_sample
from specstep.engine.sampler import sample
from specstep.engine.sampling_params import SamplingParams, SamplingTensors

pytestmark = pytest.mark.skipif(am._build() is None, reason="the C++ kernels cannot run here")

NAN, INF = float("nan"), float("inf")


def test_special_rows_give_torchs_index():
    x = torch.tensor([
        [1.0, NAN, 3.0, NAN, 9.0, 2.0, 0.0, 1.0, 5.0],  # a NaN wins, the first one
        [-0.0, 0.0, -1.0, -0.0, -5.0, -2.0, -3.0, -4.0, -9.0],  # signed zeros tie: the first
        [-INF] * 9,  # nothing but -inf: index 0
        [2.0, 5.0, 5.0, 1.0, 5.0, 0.0, 0.0, 0.0, 5.0],  # ties: the first
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, INF],  # +inf in the scalar tail
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, NAN],  # a NaN in the tail
    ])
    assert torch.equal(am.argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("shape", [(1, 49152), (8, 49152), (40, 49152), (3, 7), (2, 3, 17), (5, 1), (4, 8)])
def test_random_rows_give_torchs_index(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g)
    x.view(-1, shape[-1])[:, -1] = x.max() + 1  # one row's max in its last element (the scalar tail, or a lane 7)
    x.view(-1, shape[-1])[::2, 0] = x.max() + 2  # others' at 0
    assert torch.equal(am.argmax(x), x.argmax(dim=-1))
    q = torch.randint(0, 4, shape, generator=g).float()  # many ties a row
    assert torch.equal(am.argmax(q), q.argmax(dim=-1))


def test_non_contiguous_inputs_and_both_thread_counts(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 2, 4099, generator=g)
    for view in (x[:, 0], x.transpose(0, 1), x[:, :, ::3]):
        assert torch.equal(am.argmax(view), view.argmax(dim=-1))
    monkeypatch.setattr(am, "THREADED_ELEMENTS", 1)  # every call splits its rows over torch's threads
    assert torch.equal(am.argmax(x), x.argmax(dim=-1))


def test_other_dtypes_and_empty_rows_take_torch():
    x = torch.randn(3, 10, dtype=torch.float64)
    assert torch.equal(am.argmax(x), x.argmax(dim=-1))
    assert torch.equal(am.argmax(x.half()), x.half().argmax(dim=-1))
    assert am.argmax(torch.empty(0, 10)).shape == (0,)


def test_greedy_sampling_and_acceptance_read_the_argmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 101, generator=g)
    st = SamplingTensors.build([SamplingParams(temperature=0.0)] * 3, [0, 1, 2], 101, "cpu")
    want = logits.argmax(dim=-1)
    drafts = want[:, :4].clone()
    drafts[1, 2] += 1  # request 1 rejects its third draft
    out, acc = rejection_sample(drafts, None, logits, torch.full((3,), 4), st, torch.zeros(3, dtype=torch.long))
    assert torch.equal(out, want) and acc.tolist() == [4, 2, 4]
    assert torch.equal(sample(logits[:, 0], st, torch.zeros(3, dtype=torch.long)), want[:, 0])


def test_a_compiled_step_traces_torchs_argmax():
    """`--graphs compiled` traces the samplers with fullgraph=True: the kernel must not break the trace."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 101, generator=g)
    st = SamplingTensors.build([SamplingParams(temperature=0.0)] * 2, [0, 1], 101, "cpu")
    pos = torch.zeros(2, dtype=torch.long)
    drafts = logits.argmax(dim=-1)[:, :4]
    torch._dynamo.reset()
    step = torch.compile(lambda lg, d: (sample(lg[:, 0], st, pos), rejection_sample(d, None, lg, torch.full((2,), 4),
                                                                                     st, pos)),
                         backend="eager", fullgraph=True)
    first, (out, acc) = step(logits, drafts)
    assert torch.equal(first, logits[:, 0].argmax(dim=-1)) and torch.equal(out, logits.argmax(dim=-1))
    assert acc.tolist() == [4, 4]
