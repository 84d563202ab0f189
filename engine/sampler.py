"""One sampling path for every step and every proposer: logits -> processed distribution -> token.

Temperature, then top-k, then top-p (renormalised after top-k), as in Hugging Face and vLLM. Sampling is
Gumbel/exponential-race: argmax(p / E) with E ~ Exp(1) is a draw from p, needs no cumsum search and no
host sync; E comes from `engine.random`, so each request's draws depend only on its seed and positions.
"""

from __future__ import annotations

import torch

from specstep.engine.random import SAMPLE, exponential
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
    """One draw per row of `probs` [N, V]; noise keyed by (seed, position, stream) per row."""
    e = exponential(seeds, positions, stream, probs.shape[-1])
    return (probs.double() / e).argmax(dim=-1)


def sample(logits: torch.Tensor, st: SamplingTensors, positions: torch.Tensor) -> torch.Tensor:
    """Next token per request. logits [B, V]; positions [B] = position the sampled token will occupy."""
    greedy_ids = logits.argmax(dim=-1)
    if st.all_greedy:
        return greedy_ids
    sampled = sample_from_probs(processed_probs(logits, st), st.seeds, positions, SAMPLE)
    return torch.where(st.greedy, greedy_ids, sampled) if st.any_greedy else sampled
