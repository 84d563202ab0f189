"""Lossless acceptance of draft tokens, batched, fixed-shape, on device (no host sync).

Request b drafted d[0..k) (only the first num_draft[b] count) from distributions q; the target scored
k + 1 positions, giving p[0..k]. For j = 0, 1, ...:
    greedy rows:   accept d[j] while d[j] == argmax p[j]; the emitted token at the stop is argmax p[j].
    sampling rows: accept d[j] with probability min(1, p[j][d[j]] / q[j][d[j]]);
                   at the first rejection j, emit a draw from norm(max(p[j] - q[j], 0));
                   if all num_draft drafts are accepted, emit the bonus token from p[num_draft].
This is the rule of Leviathan et al. / Chen et al.: the emitted sequence is distributed exactly as the
target's own samples. `p` is processed (temperature, top-k, top-p) exactly as in plain decoding.

Outputs (both on device):
    out_tokens   [B, k + 1]: out[:a] = accepted drafts, out[a] = the corrected/bonus token, rest undefined
    num_accepted [B]       : a, the number of accepted drafts (tokens emitted this step = a + 1)
"""

from __future__ import annotations

import torch

from specstep.engine.argmax import argmax, greedy_accept
from specstep.engine.random import ACCEPT, SAMPLE, uniform
from specstep.engine.sampler import processed_probs, sample_from_probs
from specstep.engine.sampling_params import SamplingTensors


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row of `accept` [B, k]."""
    return accept.long().cumprod(dim=-1).sum(dim=-1)


def rejection_sample(
    draft_tokens: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V]; None: drafts were deterministic (q is one-hot)
    target_logits: torch.Tensor,  # [B, k + 1, V]
    num_draft: torch.Tensor,  # [B] long, <= k
    st: SamplingTensors,
    positions: torch.Tensor,  # [B] position of out[:, 0]
) -> tuple[torch.Tensor, torch.Tensor]:
    b, k = draft_tokens.shape
    if st.all_greedy:
        fused = greedy_accept(target_logits, draft_tokens, num_draft)  # CPU: one pass, to the first rejection
        if fused is not None:
            return fused
    j = torch.arange(k + 1, device=draft_tokens.device)
    in_draft = j[:k].unsqueeze(0) < num_draft.unsqueeze(1)  # [B, k]

    greedy_out = argmax(target_logits)  # [B, k + 1]
    greedy_acc = _accepted_prefix((draft_tokens == greedy_out[:, :k]) & in_draft)
    if st.all_greedy:
        return greedy_out, greedy_acc

    rows = torch.arange(b, device=draft_tokens.device).repeat_interleave(k + 1)
    p = processed_probs(target_logits.reshape(b * (k + 1), -1), st, rows).view(b, k + 1, -1)
    p_draft = p[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # p[j][d[j]]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        q = torch.zeros_like(p[:, :k]).scatter_(-1, draft_tokens.unsqueeze(-1), 1.0)
    else:
        q = draft_probs.float()
        q_draft = q.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    pos = positions.unsqueeze(1) + j  # position each out[:, j] would occupy
    u = uniform(st.seeds.unsqueeze(1).expand(b, k + 1), pos, ACCEPT).squeeze(-1)[:, :k]
    # u < p/q  <=>  u * q < p (q > 0 wherever the draft sampled). Written without division.
    sampled_acc = _accepted_prefix((u * q_draft < p_draft) & in_draft)

    # Residual distribution at every position (only the one at the stop is used): norm(max(p - q, 0)) where a
    # draft was rejected, p itself for the bonus position. An all-zero residual (p == q up to rounding) falls
    # back to p.
    q_full = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1)
    q_full = torch.where((j.unsqueeze(0) < num_draft.unsqueeze(1)).unsqueeze(-1), q_full, 0.0)
    residual = (p - q_full).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual, p)
    seeds = st.seeds.unsqueeze(1).expand(b, k + 1).reshape(-1)
    # The corrected/bonus draw uses the plain-decoding stream: independent of the ACCEPT and DRAFT draws at the
    # same positions, and a request that drafted nothing this step samples exactly as plain decoding would.
    corrected = sample_from_probs(residual.view(b * (k + 1), -1), seeds, pos.reshape(-1), SAMPLE).view(b, k + 1)
    drafts_padded = torch.cat([draft_tokens, draft_tokens[:, :1]], dim=1)
    sampled_out = torch.where(j.unsqueeze(0) < sampled_acc.unsqueeze(1), drafts_padded, corrected)

    if not st.any_greedy:
        return sampled_out, sampled_acc
    g = st.greedy
    return torch.where(g.unsqueeze(1), greedy_out, sampled_out), torch.where(g, greedy_acc, sampled_acc)
