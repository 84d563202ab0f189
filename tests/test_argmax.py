"""The greedy readout (`engine/kernels/argmax.cpp`): the indices torch.argmax(dim=-1) returns, ties, NaNs and infinities
included, on one thread and both; the samplers read their greedy tokens through it; and greedy acceptance in one
pass gives the torch rule's tokens and counts."""

from __future__ import annotations

import pytest
import torch

from specstep.engine import argmax as am
from specstep.engine import rejection_sampler as rs
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
    assert acc.tolist() == [4, 2, 4]
    assert torch.equal(out[[0, 2]], want[[0, 2]]) and torch.equal(out[1, :3], want[1, :3])
    assert out[1, 3:].tolist() == [want[1, 2].item()] * 2  # past the stop: the corrected token again
    assert torch.equal(sample(logits[:, 0], st, torch.zeros(3, dtype=torch.long)), want[:, 0])


def torch_rule(logits, drafts, num_draft):
    """The greedy rule in torch (the definition): every row's argmax, the accepted prefix of in-draft matches."""
    k = drafts.shape[1]
    want = logits.argmax(dim=-1)
    in_draft = torch.arange(k).unsqueeze(0) < num_draft.unsqueeze(1)
    acc = ((drafts == want[:, :k]) & in_draft).long().cumprod(dim=-1).sum(dim=-1)
    return want, acc


@pytest.mark.parametrize("threaded", [False, True])
def test_greedy_accept_gives_the_rules_tokens_and_counts(monkeypatch, threaded):
    if threaded:
        monkeypatch.setattr(am, "THREADED_ELEMENTS", 1)  # requests split over torch's threads
    g = torch.Generator().manual_seed(5)
    for trial in range(300):
        b, k = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        v = int(torch.randint(2, 300, (1,), generator=g))
        logits = torch.randn(b, k + 1, v, generator=g)
        if trial % 3 == 0:  # few values: ties, the first maximum wins
            logits = torch.randint(0, 3, (b, k + 1, v), generator=g).float()
        if trial % 7 == 0:
            logits[0, int(torch.randint(0, k + 1, (1,), generator=g)), v // 2] = float("nan")
        want, _ = torch_rule(logits, torch.zeros(b, k, dtype=torch.long), torch.zeros(b, dtype=torch.long))
        # drafts agree with the target with probability 0.7 a position: prefixes of every length
        agree = torch.rand(b, k, generator=g) < 0.7
        grid = torch.randint(0, v, (b, k + 1), generator=g)
        grid[:, 1:] = torch.where(agree, want[:, :k], (want[:, :k] + 1) % v)
        drafts = grid[:, 1:]  # a strided view, as the engine's grid hands them over
        num_draft = torch.randint(0, k + 1, (b,), generator=g)
        out, acc = am.greedy_accept(logits, drafts, num_draft)
        ref_out, ref_acc = torch_rule(logits, drafts, num_draft)
        assert torch.equal(acc, ref_acc), trial
        for i in range(b):
            a = int(acc[i])
            assert torch.equal(out[i, : a + 1], ref_out[i, : a + 1]), trial
            assert (out[i, a + 1:] == out[i, a]).all(), trial


def test_rejection_sampling_of_greedy_rows_takes_the_one_pass_form(monkeypatch):
    """All-greedy batches on CPU: the same tokens and counts as the torch form, where the kernel ran."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 5, 257, generator=g)
    st = SamplingTensors.build([SamplingParams(temperature=0.0)] * 4, [0, 1, 2, 3], 257, "cpu")
    drafts = logits.argmax(dim=-1)[:, :4].clone()
    drafts[0, 0] += 1
    drafts[2, 3] += 1
    num_draft, pos = torch.tensor([4, 4, 4, 2]), torch.zeros(4, dtype=torch.long)
    calls = []
    monkeypatch.setattr(rs, "greedy_accept", lambda *a: calls.append(1) or am.greedy_accept(*a))
    out, acc = rejection_sample(drafts, None, logits, num_draft, st, pos)
    monkeypatch.setattr(rs, "greedy_accept", lambda *a: None)  # the torch form
    ref_out, ref_acc = rejection_sample(drafts, None, logits, num_draft, st, pos)
    assert calls and acc.tolist() == ref_acc.tolist() == [0, 4, 3, 2]
    for i, a in enumerate(acc.tolist()):
        assert torch.equal(out[i, : a + 1], ref_out[i, : a + 1])


def test_greedy_accept_declines_what_it_does_not_cover():
    logits = torch.randn(2, 3, 11)
    drafts, nd = torch.zeros(2, 2, dtype=torch.long), torch.full((2,), 2)
    assert am.greedy_accept(logits.double(), drafts, nd) is None
    assert am.greedy_accept(logits, drafts.int(), nd) is None
    assert am.greedy_accept(logits, drafts[:, :1], nd) is None
    assert am.greedy_accept(logits[0], drafts, nd) is None
