"""`ngram`: prompt lookup. Find the most recent earlier occurrence of the request's longest recent suffix
(max_n down to min_n tokens) and propose the tokens that followed it. No model, no KV, proposes on the host.

Its drafts are deterministic, so q is one-hot at each draft: acceptance is min(1, p(x)) and the residual is p
with x removed, which keeps sampling lossless.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from specstep.engine.proposers.base import Proposer
from specstep.engine.step_context import SeqState


def ngram_lookup(tokens: np.ndarray, k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        windows = sliding_window_view(tokens[: length - 1], n)  # every earlier n-gram, excluding the suffix
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    kind = "ngram"
    has_model = False
    drafts_on_host = True

    def __init__(self, device: torch.device, min_n: int = 1, max_n: int = 4) -> None:
        self.device = device
        self.min_n, self.max_n = min_n, max_n

    def can_chain(self, num_draft: np.ndarray) -> bool:
        # The lookup reads each request's latest tokens on the host; a plain step (no drafts) reads none.
        return not np.any(np.asarray(num_draft) > 0)

    def plan_drafts(self, seqs: list[SeqState], num_draft: np.ndarray, refill: bool
                    ) -> tuple[np.ndarray, list[list[int]]]:
        # No KV to fall behind: a dropped refill changes nothing. A request drafts what its lookup found.
        drafts = self.propose_host(seqs, int(num_draft.max(initial=0)))
        return np.minimum(num_draft, [len(d) for d in drafts]), drafts

    def propose_host(self, seqs: list[SeqState], k: int) -> list[list[int]]:
        if k <= 0:  # a plain step (speculation off) must not pay the lookup: 0.1-0.4 ms a request on long contexts
            return [[] for _ in seqs]
        return [ngram_lookup(np.asarray(s.token_ids, dtype=np.int64), k, self.min_n, self.max_n) for s in seqs]
