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
from collections import OrderedDict

import numpy as np
import torch

from specstep.engine.proposers.base import Proposer
from specstep.engine.step_context import SeqState


def ngram_lookup(tokens: np.ndarray, k: int, min_n: int = 1, max_n: int = 4, match_ratio: float = 0.0
                 ) -> list[int]:
    """The draft for `tokens` (an integer array): what followed the most recent earlier occurrence of its longest
    suffix of min_n..max_n tokens, min_n >= 1 (an occurrence ends before the last token), at most k tokens, and at
    most ceil(match_ratio x the match's length) where match_ratio > 0.

    One pass over the sequence: the earlier positions holding the last token are the ends of every 1-token
    match; those whose previous token also agrees end the 2-token matches, and so on, so n-gram matches are
    filtered out of (n - 1)-gram ones instead of each n scanning the whole sequence (4 scans of every window).
    The proposer's call for a request (its `HostTokens` copy extended, then this) took 10.5 / 14 / 18 us at 224 /
    4,000 / 16,000 tokens of code, where the windowed scans over a list converted at each call took 68 / 230 /
    550 us."""
    length = len(tokens)
    top = min(max_n, length - 1)
    if top < min_n:
        return []
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])  # ascending: the last is the most recent
    n = 1
    while ends.size and n < top:
        longer = ends[ends >= n]
        longer = longer[tokens[longer - n] == tokens[length - 1 - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    if not ends.size or n < min_n:
        return []
    hit = int(ends[-1]) - n + 1  # the match's start
    draft = tokens[hit + n:hit + n + k]
    if match_ratio > 0:
        draft = draft[:math.ceil(match_ratio * match_length(tokens, hit, n, math.ceil(k / match_ratio)))]
    return draft.tolist()


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


class HostTokens:
    """int64 copies of requests' token lists for the lookup, each extended by what its list gained since it was
    last asked for, so a step converts its new tokens instead of the whole context (at 16,000 tokens, converting a
    list took 235 us; the lookup alone on the copy, 12). For the scheduler thread, which alone grows the lists.

    Entries hold their list, so an id seen again is the same list. A batch keeps at most 2 x its lanes + 8 copies,
    the least recently asked for going first: every drafting step asks for all running requests, so what goes is a
    finished request's copy (its list and buffer: ~50 bytes a token), and memory follows the running batch."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._arrays: OrderedDict[int, tuple[list[int], np.ndarray, int]] = OrderedDict()  # id -> list, buffer, len

    def __len__(self) -> int:
        return len(self._arrays)

    def batch(self, lists: list[list[int]], running: int) -> list[np.ndarray]:
        """Copies of `lists`, `running` the lanes of the step asking (some may have been looked up already)."""
        self.capacity = 2 * running + 8
        return [self.array(t) for t in lists]

    def array(self, tokens: list[int]) -> np.ndarray:
        key, length = id(tokens), len(tokens)
        entry = self._arrays.pop(key, None)
        # A cheap guard, not a proof: token lists only grow, so a list's copy stays a prefix of it
        if entry is not None and entry[0] is tokens and entry[2] <= length and (
                entry[2] == 0 or entry[1][entry[2] - 1] == tokens[entry[2] - 1]):
            _, buf, have = entry
            if length > buf.size:  # room for many steps' tokens: amortised O(1) a token
                buf = np.concatenate([buf[:have], np.empty(max(length, 2 * buf.size) - have, np.int64)])
            buf[have:length] = tokens[have:length]
        else:
            buf = np.array(tokens, dtype=np.int64)
        self._arrays[key] = (tokens, buf, length)  # the most recently asked for
        while len(self._arrays) > self.capacity:
            self._arrays.popitem(last=False)
        return buf[:length]


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
        self._arrays = HostTokens()

    @staticmethod
    def _key(tokens: list[int]) -> tuple:
        # the same token list, unchanged since (token lists only grow)
        return id(tokens), len(tokens), tokens[-1] if tokens else None

    def _lookups(self, lists: list[list[int]], k: int) -> list[list[int]]:
        got = [self._looked_up.get(self._key(t)) for t in lists]
        todo = [t for t, g in zip(lists, got) if g is None or g[0] < k]
        found = iter([ngram_lookup(a, k, self.min_n, self.max_n, self.match_ratio)
                      for a in self._arrays.batch(todo, len(lists))] if todo else [])
        return [g[1][:k] if g is not None and g[0] >= k else next(found) for g in got]

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
        # (kept, so the step's own lookup is not run twice)
        drafts = self._lookups(token_ids, k)
        self._looked_up = {self._key(t): (k, d) for t, d in zip(token_ids, drafts)}
        return np.array([len(d) for d in drafts], dtype=np.int64)

    def propose_host(self, seqs: list[SeqState], k: int) -> list[list[int]]:
        if k <= 0:  # a plain step (speculation off) must not pay the lookup (10-18 us a request, 224-16,000 tokens)
            return [[] for _ in seqs]
        return self._lookups([s.token_ids for s in seqs], k)
