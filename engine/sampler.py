"""One sampling path for every step and every proposer: logits -> processed distribution -> token.

Temperature, then top-k, then top-p (renormalised after top-k), as in Hugging Face and vLLM. A draw inverts
the row's CDF at one uniform: token = first i with cumsum(p)[i] >= u x sum(p). The uniform comes from
`engine.random` keyed by (seed, position, stream), so each request's draws depend only on its seed and
positions, with no host sync. (It replaced an exponential race, argmax(p / E) with E ~ Exp(1) per token: the
same distribution, but V hashes a row, about 25 elementwise passes over [N, V]; this is one hash a row, one
float64 cumsum and a binary search.)
"""

from __future__ import annotations

import torch

from specstep.engine.argmax import argmax
from specstep.engine.random import SAMPLE, uniform
from specstep.engine.sampling_params import SamplingTensors


def processed_probs(logits: torch.Tensor, st: SamplingTensors, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Probabilities after temperature / top-k / top-p. logits [..., N, V]; `rows` maps each of the N rows to
    its request (default: row i is request i)."""
    temp = st.temperature if rows is None else st.temperature[rows]
    x = logits.float() / temp.unsqueeze(-1)
    if st.needs_filter:
        top_k = st.top_k if rows is None else st.top_k[rows]
        top_p = st.top_p if rows is None else st.top_p[rows]
        sorted_x, order = x.sort(dim=-1, descending=True)
        rank = torch.arange(x.shape[-1], device=x.device)
        sorted_x = sorted_x.masked_fill(rank >= top_k.unsqueeze(-1), float("-inf"))
        sorted_p = sorted_x.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
        before = sorted_p.cumsum(dim=-1) - sorted_p
        # (top_p == 1 keeps everything even where rounding pushes the cumulative mass past 1.)
        sorted_x = sorted_x.masked_fill((before >= top_p.unsqueeze(-1)) & (top_p < 1).unsqueeze(-1), float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    return x.softmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """One draw per row of `probs` [N, V] (unnormalised is fine); the uniform keyed by (seed, position, stream).
    A zero-probability token is never drawn: u x sum > 0 lies strictly inside some positive token's step of the
    CDF, and the search returns the first index reaching it."""
    cdf = probs.double().cumsum(dim=-1)
    x = uniform(seeds, positions, stream) * cdf[:, -1:]  # [N, 1], strictly below the total (u < 1)
    return torch.searchsorted(cdf, x).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def sample(logits: torch.Tensor, st: SamplingTensors, positions: torch.Tensor) -> torch.Tensor:
    """Next token per request. logits [B, V]; positions [B] = position the sampled token will occupy."""
    greedy_ids = argmax(logits)
    if st.all_greedy:
        return greedy_ids
    sampled = sample_from_probs(processed_probs(logits, st), st.seeds, positions, SAMPLE)
    return torch.where(st.greedy, greedy_ids, sampled) if st.any_greedy else sampled
