"""Per-request sampling parameters (validated at the boundary) and their batched tensor form."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specstep.engine.errors import InvalidRequestError

GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (and anything below GREEDY_BELOW_TEMPERATURE)
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32 and the distribution is argmax anyway.
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        if not (0.0 <= self.temperature <= 100.0):
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InvalidRequestError(f"seed must be in [0, 2^63), got {self.seed}")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(f"stop_token_ids outside the vocabulary [0, {vocab_size}): {bad}")
        return self


@dataclass(slots=True)
class SamplingTensors:
    """Rows are requests. Host knows `all_greedy`/`needs_filter` from the params, so fast paths cost no sync."""

    temperature: torch.Tensor  # [B] float32, 1.0 on greedy rows (their logits are argmax'ed instead)
    top_k: torch.Tensor  # [B] int64, vocab size where off
    top_p: torch.Tensor  # [B] float32
    greedy: torch.Tensor  # [B] bool
    seeds: torch.Tensor  # [B] int64
    all_greedy: bool
    any_greedy: bool
    needs_filter: bool

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], vocab_size: int,
              device: torch.device | str,
              upload: Callable[[Sequence[np.ndarray]], list[torch.Tensor]] | None = None) -> SamplingTensors:
        """`upload` (a step's `engine.staging.Staging.upload`) sends the five rows in one pinned copy a dtype;
        without it each is copied on its own (tests, one-off calls)."""
        arrays = cls.host_arrays(params, seeds, vocab_size)
        tensors = upload(arrays) if upload else [torch.from_numpy(a).to(device) for a in arrays]
        return cls.from_tensors(tensors, params, vocab_size)

    @staticmethod
    def host_arrays(params: Sequence[SamplingParams], seeds: Sequence[int], vocab_size: int) -> list[np.ndarray]:
        """temperature, top_k, top_p, greedy, seeds (the field order) as host arrays."""
        return [np.array([1.0 if p.greedy else p.temperature for p in params], dtype=np.float32),
                np.array([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], dtype=np.int64),
                np.array([p.top_p for p in params], dtype=np.float32),
                np.array([p.greedy for p in params], dtype=np.bool_),
                np.array(list(seeds), dtype=np.int64)]

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], params: Sequence[SamplingParams],
                     vocab_size: int) -> SamplingTensors:
        """From the device copies of `host_arrays` (in its order)."""
        temperature, top_k, top_p, greedy, seeds = tensors
        f = SamplingFlags.of(params, vocab_size)
        return cls(temperature, top_k, top_p, greedy, seeds, all_greedy=f.all_greedy, any_greedy=f.any_greedy,
                   needs_filter=f.needs_filter)


@dataclass(frozen=True, slots=True)
class SamplingFlags:
    """What the host knows of a batch's sampling without any tensor (it picks the step's graph flavour)."""

    all_greedy: bool
    any_greedy: bool
    needs_filter: bool  # some non-greedy row asks for top-k or top-p (the vocabulary sort)

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab_size: int) -> SamplingFlags:
        greedy = [p.greedy for p in params]
        return cls(all(greedy), any(greedy),
                   any(not p.greedy and (0 < p.top_k < vocab_size or p.top_p < 1.0) for p in params))
