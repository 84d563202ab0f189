"""A drafter's reduced vocabulary: its `lm_head` covers only the N most frequent tokens of its training data.

On a small drafter the `lm_head` (V x d) is most of the work (SmolLM2's is 113 MB against a 10 MB head layer).
Restricting it to N rows cuts that by V / N. Lossless by construction: the drafter's logits are -inf outside the
subset, so its distribution q is exactly zero there and the rejection rule (accept x with min(1, p(x)/q(x)),
resample from norm(max(p - q, 0))) still yields the target's distribution; greedy drafting simply never proposes
a token outside the subset. Only acceptance can change, by the target mass the subset misses.

The subset lives in the drafter's folder as `draft_vocab.json` (`token_ids`, most frequent first), written
by `specstep train-head --draft-vocab N`, or by `write_draft_vocab` for any drafter.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specstep.engine.cpu_kernels import CpuKernels
from specstep.engine.errors import CheckpointError

FILE = "draft_vocab.json"  # not *.safetensors: the folder's weight files are every *.safetensors in it


class ReducedLMHead(nn.Module):
    """logits[..., ids] = hidden @ W[ids].T, -inf elsewhere: the full-vocabulary logits every sampler expects."""

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.register_buffer("token_ids", token_ids.to(device=weight.device, dtype=torch.long), persistent=False)
        self.proj = nn.Linear(weight.shape[1], len(token_ids), bias=False, device=weight.device, dtype=weight.dtype)
        self.proj.weight = nn.Parameter(weight.detach()[self.token_ids].clone(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        small = self.proj(hidden).float()
        out = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.token_ids, small)


def read_draft_vocab(folder: str | Path, vocab_size: int, limit: int | None = None) -> torch.Tensor | None:
    """The folder's token subset (its first `limit` ids if given), or None when it has none."""
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    try:
        ids = torch.tensor(json.loads(path.read_text())["token_ids"], dtype=torch.long)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: not a draft vocabulary ({e})") from None
    if ids.ndim != 1 or len(ids) == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise CheckpointError(f"{path}: token_ids must be a non-empty list of ids below {vocab_size}")
    if len(torch.unique(ids)) != len(ids):
        raise CheckpointError(f"{path}: token_ids repeat")
    return ids[:limit] if limit else ids


def write_draft_vocab(folder: str | Path, counts: torch.Tensor, size: int, always: tuple[int, ...] = ()) -> Path:
    """Keep the `size` most frequent tokens by `counts` [V] (plus `always`, e.g. EOS), most frequent first."""
    order = torch.argsort(counts.to(torch.float64), descending=True, stable=True)
    keep = list(dict.fromkeys([*always, *order.tolist()]))[:size]
    path = Path(folder) / FILE
    path.write_text(json.dumps({"token_ids": keep, "vocab_size": len(counts)}) + "\n")
    return path


def build_reduced_head(weight: torch.Tensor, folder: str | Path, vocab_size: int, limit: int | None,
                       cpu_linear: str | CpuKernels | None) -> ReducedLMHead | None:
    """The drafter's reduced head from its folder (None: full vocabulary), with CPU linears planned
    (`cpu_linear`: see `plan_linears`)."""
    if limit == 0:
        return None
    ids = read_draft_vocab(folder, vocab_size, limit)
    if ids is None:
        if limit:
            raise CheckpointError(f"{folder}: --draft-vocab {limit} given, but the folder has no {FILE}")
        return None
    head = ReducedLMHead(weight, ids, vocab_size)
    if cpu_linear is not None and weight.device.type == "cpu":
        from specstep.engine.models.cpu_linear import plan_linears

        plan_linears(head, cpu_linear)
    return head
