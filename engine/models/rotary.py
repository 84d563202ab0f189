"""Rotary position embedding (neox / Hugging Face `rotate_half` layout) with linear and llama3 scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from specstep.engine.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    if scaling.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        mid = (1 - smooth) * inv / scaling.factor + smooth * inv
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(is_mid, mid, scaled)
    return inv


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling) -> None:
        super().__init__()
        self.args = (head_dim, max_positions, theta, scaling)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_tables()

    def build_tables(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the cos/sin tables; needed after constructing on the meta device."""
        head_dim, max_positions, theta, scaling = self.args
        inv = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64, device="cpu"), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().float().to(device or "cpu")
        self.sin = emb.sin().float().to(device or "cpu")

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for these positions, shaped to broadcast over [..., heads, head_dim]; computed once per
        forward and shared by every layer. Positions past the table are clamped (graph-safe): they occur in
        lanes whose results are discarded (a graph lane's unused verify tail near the model's length), and in
        a short-context draft's refill of requests past its context, which no longer draft."""
        positions = positions.clamp_max(self.cos.shape[0] - 1)
        return self.cos[positions].unsqueeze(-2).to(dtype), self.sin[positions].unsqueeze(-2).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., heads, head_dim]; rotate_half layout (first half paired with second half)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
