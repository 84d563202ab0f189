"""`ngram`: prompt lookup. Find the most recent earlier occurrence of the request's longest recent suffix
(max_n down to min_n tokens) and propose the tokens that followed it. No model, no KV, proposes on the host.

How far to trust a match: at most ceil(match_ratio x m) tokens, m the length of the match (the suffix found,
extended backwards while the earlier occurrence keeps agreeing), as SuffixDecoding bounds its speculation by the
pattern's length. A long match predicts its continuation far better than a short one: on 32 held-out code
prompts (SmolLM2's greedy outputs, 96 tokens each), a draft's first token was accepted 35% of the time after a
1-token match, 59% after 2, 79% after 4-7, 88% after 8-15 and 98% after 16 or more. A verify row costs 10-15%
of a decode step at batch 1 on CPU (more at batch 8), so short matches' long drafts cost more than they return:
replaying those outputs, match_ratio 1 gave 1.77 / 1.65 / 1.54 tokens per decode step's cost at 0.10 / 0.15 /
0.20 a verify row (k = 4) where drafting all k gave 1.74 / 1.56 / 1.41; 0 turns the bound off.

Its drafts are deterministic, so q is one-hot at each draft: acceptance is min(1, p(x)) and the residual is p
with x removed, which keeps sampling lossless.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from specstep.engine.proposers.base import Proposer
from specstep.engine.step_context import SeqState


def ngram_lookup(tokens: np.ndarray, k: int, min_n: int = 1, max_n: int = 4, match_ratio: float = 0.0
                 ) -> list[int]:
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        windows = sliding_window_view(tokens[: length - 1], n)  # every earlier n-gram, excluding the suffix
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            hit = int(hits[-1])
            draft = tokens[hit + n:hit + n + k]
            if match_ratio > 0:
                draft = draft[:math.ceil(match_ratio * match_length(tokens, hit, n, math.ceil(k / match_ratio)))]
            return draft.tolist()
    return []


def match_length(tokens: np.ndarray, hit: int, n: int, most: int) -> int:
    """How many tokens before the end of `tokens` agree with those before `hit + n` (n of them known to), counted
    up to `most`."""
    if n >= most:
        return n
    span = min(most - n, hit)  # tokens before the earlier occurrence
    earlier = tokens[hit - span:hit][::-1]
    later = tokens[len(tokens) - n - span:len(tokens) - n][::-1]
    differ = np.flatnonzero(earlier != later)
    return n + (int(differ[0]) if differ.size else span)


class NgramProposer(Proposer):
    kind = "ngram"
    has_model = False
    drafts_on_host = True

    def __init__(self, device: torch.device, min_n: int = 1, max_n: int = 4, match_ratio: float = 1.0) -> None:
        self.device = device
        self.min_n, self.max_n, self.match_ratio = min_n, max_n, match_ratio
        # draft_limits' lookups (k, draft), which the step then drafts: a lookup at fewer drafts is a prefix of
        # one at more (the same match; the bound ceil(ratio x m) does not depend on k)
        self._looked_up: dict[tuple, tuple[int, list[int]]] = {}

    @staticmethod
    def _key(tokens: list[int]) -> tuple:
        # the same token list, unchanged since (token lists only grow)
        return id(tokens), len(tokens), tokens[-1] if tokens else None

    def _lookup(self, tokens: list[int], k: int) -> list[int]:
        got = self._looked_up.get(self._key(tokens))
        if got is not None and got[0] >= k:
            return got[1][:k]
        return ngram_lookup(np.asarray(tokens, dtype=np.int64), k, self.min_n, self.max_n, self.match_ratio)

    def can_chain(self, num_draft: np.ndarray) -> bool:
        # The lookup reads each request's latest tokens on the host; a plain step (no drafts) reads none.
        return not np.any(np.asarray(num_draft) > 0)

    def plan_drafts(self, seqs: list[SeqState], num_draft: np.ndarray, refill: bool
                    ) -> tuple[np.ndarray, list[list[int]]]:
        # No KV to fall behind: a dropped refill changes nothing. A request drafts what its lookup found.
        drafts = self.propose_host(seqs, int(num_draft.max(initial=0)))
        return np.minimum(num_draft, [len(d) for d in drafts]), drafts

    def draft_limits(self, token_ids: list[list[int]], k: int) -> np.ndarray:
        # The policy's view of a lane before it decides: what the lookup finds now is what the step would draft
        # (kept, so the step's own lookup is not run twice: 0.1-0.4 ms a request on long contexts)
        drafts = [self._lookup(t, k) for t in token_ids]
        self._looked_up = {self._key(t): (k, d) for t, d in zip(token_ids, drafts)}
        return np.array([len(d) for d in drafts], dtype=np.int64)

    def propose_host(self, seqs: list[SeqState], k: int) -> list[list[int]]:
        if k <= 0:  # a plain step (speculation off) must not pay the lookup: 0.1-0.4 ms a request on long contexts
            return [[] for _ in seqs]
        return [self._lookup(s.token_ids, k) for s in seqs]
