"""Counter-based randomness: noise is a pure function of (request seed, token position, stream).

Why not torch.Generator: one generator per request costs a launch per request and cannot be captured in a
graph; a global generator makes a request's output depend on who else is in the batch. Hashing the counter
gives per-request seeds, batch-independent results, reproducibility after preemption (for plain sampling; a
speculating request's draws depend on what was drafted and accepted, so only its distribution is fixed), and
no host sync. (The sampler inverts a float64 CDF at this noise; on CUDA the cumsum's rounding may depend on the
number of rows, so a draw that lands within about 1e-16 of a CDF step could change with the batch.)
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF

# Streams keep the draws for different purposes independent at the same position.
SAMPLE, ACCEPT, DRAFT = 0, 1, 3


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), exact in int64 (16-bit halves: no signed overflow)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche finaliser (lowbias32 constants)."""
    x = x & M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """One 32-bit key per row from a 63-bit seed, a position and a stream id."""
    k = mix32(seeds & M32)
    k = mix32(k ^ ((seeds >> 32) & M32))
    k = mix32(k ^ (positions & M32))
    return mix32(k ^ stream)


def uniform(seeds: torch.Tensor, positions: torch.Tensor, stream: int, width: int = 1) -> torch.Tensor:
    """Uniform noise in (0, 1), float64, shape [*seeds.shape, width]."""
    keys = row_keys(seeds, positions, stream).unsqueeze(-1)
    cols = mix32(torch.arange(width, device=seeds.device, dtype=torch.int64) + 0x9E3779B9)
    h = mix32(keys ^ cols)
    return (h.double() + 0.5) * (1.0 / 2**32)
