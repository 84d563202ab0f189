"""`engine.rejection_sampler.rejection_sample` on constructed tensors: greedy and sampling rows, drafts right for
exactly the first j positions, fewer drafts than k, and the lossless rule checked statistically (one row per seed,
chi-square at level ALPHA, acceptance rate against its exact value sum_x min(p(x), q(x)))."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specstep.engine.rejection_sampler import rejection_sample
from specstep.engine.sampling_params import SamplingParams, SamplingTensors
from tests.fixtures_stats import assert_distribution, reference_probs

ALPHA = 1e-4
V = 10


def st_for(params: list[SamplingParams], seeds=None) -> SamplingTensors:
    return SamplingTensors.build(params, list(seeds if seeds is not None else range(len(params))), V, "cpu")


def peaked_logits(argmax: torch.Tensor, height: float = 40.0) -> torch.Tensor:
    """[B, k + 1, V] logits whose softmax is (numerically) one-hot at `argmax` [B, k + 1]."""
    return torch.zeros(*argmax.shape, V).scatter_(-1, argmax.unsqueeze(-1), height)


def drafts_right_for(target_argmax: torch.Tensor, j: list[int], k: int) -> torch.Tensor:
    """Drafts equal to the target's argmax at positions < j[b] and different from it from j[b] on."""
    d = target_argmax[:, :k].clone()
    for b, jb in enumerate(j):
        d[b, jb:] = (d[b, jb:] + 1) % V
    return d


K = 4
ARGMAX = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3], [5, 8, 9, 7, 9], [3, 2, 3, 8, 4], [6, 2, 6, 4, 3]])


@pytest.mark.parametrize("mode", ["greedy", "sampling_one_hot_q", "sampling_with_q", "mixed"])
def test_accepts_exactly_the_first_j_right_drafts(mode):
    j = [0, 1, 2, 3, 4]  # row b is right for exactly its first j[b] positions
    drafts = drafts_right_for(ARGMAX, j, K)
    num_draft = torch.full((5,), K)
    params = {"greedy": [SamplingParams(temperature=0.0)] * 5,
              "mixed": [SamplingParams(temperature=0.0 if b % 2 else 1.0) for b in range(5)]
              }.get(mode, [SamplingParams(temperature=1.0)] * 5)
    q = None
    if mode == "sampling_with_q":  # q puts 0.3 on each draft (so p/q >= 1 where right, ~0 where wrong)
        q = torch.full((5, K, V), 0.7 / (V - 1)).scatter_(-1, drafts.unsqueeze(-1), 0.3)
    out, acc = rejection_sample(drafts, q, peaked_logits(ARGMAX), num_draft, st_for(params), torch.arange(5) * 10)
    assert acc.tolist() == j
    for b in range(5):
        # accepted drafts, then the target's own token (corrected at a rejection, bonus after K accepts)
        assert out[b, : j[b] + 1].tolist() == ARGMAX[b, : j[b] + 1].tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fewer_drafts_than_k(temperature):
    """Row b drafts only num_draft[b] tokens: acceptance stops there even if the padding 'drafts' match, and the
    token after the last draft is the bonus from p[num_draft]."""
    drafts = ARGMAX[:, :K].clone()  # all right, including positions past num_draft
    num_draft = torch.tensor([0, 1, 2, 3, 4])
    st = st_for([SamplingParams(temperature=temperature)] * 5)
    out, acc = rejection_sample(drafts, None, peaked_logits(ARGMAX), num_draft, st, torch.zeros(5, dtype=torch.long))
    assert acc.tolist() == num_draft.tolist()
    for b in range(5):
        assert out[b, : b + 1].tolist() == ARGMAX[b, : b + 1].tolist()


def test_greedy_ignores_draft_probabilities_and_seed():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, K + 1, V, generator=g)
    drafts = logits[:, :K].argmax(-1)
    drafts[:, 2] = (drafts[:, 2] + 1) % V
    q = torch.rand(6, K, V, generator=g).softmax(-1)
    st = st_for([SamplingParams(temperature=0.0)] * 6, seeds=range(100, 106))
    out, acc = rejection_sample(drafts, q, logits, torch.full((6,), K), st, torch.zeros(6, dtype=torch.long))
    assert acc.tolist() == [2] * 6
    assert torch.equal(out[:, :3], logits[:, :3].argmax(-1))


# ---- the lossless rule, statistically ----------------------------------------------------------------------

N = 40_000


def distributions(seed: int, k: int, sharp: float = 1.5):
    g = torch.Generator().manual_seed(seed)
    p_logits = sharp * torch.randn(k + 1, V, generator=g)
    q_logits = sharp * torch.randn(k, V, generator=g)
    return p_logits, q_logits


def run_rows(p_logits, q, drafts, num_draft, params):
    n = drafts.shape[0]
    st = st_for([params] * n, seeds=range(n))
    pos = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(5))
    return rejection_sample(drafts, q, p_logits.expand(n, -1, -1).contiguous(), num_draft, st, pos)


def binomial_ok(successes: int, n: int, p: float, alpha: float = ALPHA) -> bool:
    z = abs(successes - n * p) / math.sqrt(n * p * (1 - p))
    return math.erfc(z / math.sqrt(2)) >= alpha


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.7)],
                         ids=["T1", "topk", "topp"])
def test_emitted_tokens_are_distributed_as_the_target(params):
    """Drafts d_j ~ q_j. Whatever happens, out[0] ~ p_0; given d_0 was accepted, out[1] ~ p_1; given both were
    accepted, the bonus out[2] ~ p_2. The acceptance rate of d_0 is sum_x min(p_0(x), q_0(x))."""
    k = 2
    p_logits, q_logits = distributions(0, k)
    p = reference_probs(p_logits.numpy(), params.temperature, params.top_k, params.top_p)
    q = torch.softmax(q_logits, -1)  # q is whatever the drafter used; here it is not filtered like p
    g = torch.Generator().manual_seed(1)
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(k)], dim=1)
    out, acc = run_rows(p_logits, q.expand(N, -1, -1).contiguous(), drafts, torch.full((N,), k), params)
    out, acc = out.numpy(), acc.numpy()
    assert_distribution(np.bincount(out[:, 0], minlength=V), p[0], ALPHA, "first token")
    assert_distribution(np.bincount(out[acc >= 1, 1], minlength=V), p[1], ALPHA, "second token")
    assert_distribution(np.bincount(out[acc == 2, 2], minlength=V), p[2], ALPHA, "bonus token")
    rate0 = float(np.minimum(p[0], q[0].double().numpy()).sum())
    assert binomial_ok(int((acc >= 1).sum()), N, rate0), ((acc >= 1).mean(), rate0)
    if params.top_k:  # drafts outside the top k have p = 0 and are never accepted
        outside = ~np.isin(drafts[:, 0].numpy(), np.argsort(-p_logits[0].numpy())[: params.top_k])
        assert outside.any() and (acc[outside] == 0).all()


def test_deterministic_drafts_one_hot_q():
    """n-gram style: q is one-hot at a fixed draft x. Accept with probability p(x); out[0] ~ p_0 regardless."""
    p_logits, _ = distributions(2, 1)
    x = int(torch.softmax(p_logits[0], -1).argsort()[-3])  # a mid-probability token
    drafts = torch.full((N, 1), x)
    out, acc = run_rows(p_logits, None, drafts, torch.ones(N, dtype=torch.long), SamplingParams(temperature=1.0))
    p = reference_probs(p_logits.numpy())
    assert_distribution(np.bincount(out[:, 0].numpy(), minlength=V), p[0], ALPHA, "first token")
    assert binomial_ok(int(acc.sum()), N, float(p[0, x])), (acc.float().mean(), p[0, x])
    assert_distribution(np.bincount(out[acc.numpy() == 1, 1].numpy(), minlength=V), p[1], ALPHA, "bonus")


def test_mixed_num_draft_rows_bonus_from_the_right_position():
    """Rows with num_draft 0, 1, 2 in one batch of k = 2: the token after the last accepted draft comes from p at
    that row's own position."""
    k = 2
    p_logits, q_logits = distributions(3, k, sharp=2.0)
    q = torch.softmax(q_logits, -1)
    g = torch.Generator().manual_seed(4)
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(k)], dim=1)
    num_draft = torch.arange(N) % 3
    out, acc = run_rows(p_logits, q.expand(N, -1, -1).contiguous(), drafts, num_draft, SamplingParams())
    p = reference_probs(p_logits.numpy())
    out, acc, nd = out.numpy(), acc.numpy(), num_draft.numpy()
    assert (acc <= nd).all()
    assert_distribution(np.bincount(out[nd == 0, 0], minlength=V), p[0], ALPHA, "num_draft 0")
    full = (nd == 1) & (acc == 1)
    assert_distribution(np.bincount(out[full, 1], minlength=V), p[1], ALPHA, "num_draft 1 bonus")
