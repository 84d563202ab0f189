"""Per-lane facts a speculation decision needs, from the requests' host state (no policy, no engine): how many
drafts each lane may make, how far each lane's draft lags, and which stale drafts a step must bring current.

`pending`: tokens a step still in flight may add to each lane (upper bound: all its drafts and the bonus
token); a chained step is planned over it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from specstep.scheduler.core.request import Request
from specstep.scheduler.spec.decision import Decision


def draft_room(reqs: Sequence[Request], pending: np.ndarray, max_len: int,
               step_tokens: Callable[[int, int], int]) -> np.ndarray:
    """[B] the most drafts each lane may make: none past max_tokens, nor past `max_len` (the model's or the
    draft's context). A step in flight surely adds one token, which counts against max_tokens (its upper bound
    would forbid too much); `step_tokens(n, k)` is the allocator's rule for the positions a step writes."""
    return np.array([min(r.params.max_tokens - r.num_output_tokens - min(int(e), 1) - 1,
                         max_len - step_tokens(len(r.token_ids) + int(e), 0))
                     for r, e in zip(reqs, pending)], dtype=np.int64)


def draft_lag(reqs: Sequence[Request], pending: np.ndarray, current: set[int]) -> np.ndarray:
    """[B] tokens each lane's draft must catch up before it drafts: none for lanes in `current` (ids of requests
    whose draft the step in flight keeps current), else what it skipped while its refill was dropped."""
    return np.array([0 if id(r) in current else len(r.token_ids) + int(p) - r.draft_len
                     for r, p in zip(reqs, pending)], dtype=np.int64)


def stale_lanes(batch: Sequence[Request], decision: Decision) -> tuple[Request, ...]:
    """The stale drafts a step needs current: every one when it refills, or only those a probe drafts with
    (`Decision.catch_up`); the others stay behind (the refill over them is wasted, and they catch up from
    their own `draft_len` when they next draft)."""
    if not decision.refill:
        return ()
    lanes = decision.catch_up if decision.catch_up is not None else np.ones(len(batch), dtype=bool)
    return tuple(r for r, c in zip(batch, lanes) if c and r.draft_len < len(r.token_ids))
