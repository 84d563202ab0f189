"""Batch buckets: which batch sizes get graphs, under a memory budget.

Each captured graph keeps its static outputs alive (logits are lanes * q * vocab floats: at vocab 128k a
64-lane verify graph at q = 5 holds 160 MB) plus the driver's graph object. Intermediates come from the one
shared pool and are reused across graphs, so they are paid once. Speculation multiplies the graph count
(draft, verify, refill per bucket), so the budget matters.

When over budget, the *largest* buckets go first: a graph saves a roughly constant launch overhead per step,
which matters most for small batches (launch-bound) and least for large ones (compute-bound); batches above
the largest kept bucket run eagerly.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 16 up to max_batch (always including max_batch)."""
    small = [b for b in (1, 2, 4, 8) if b <= max_batch]
    return tuple(sorted(set(small + list(range(16, max_batch + 1, 16)) + [max_batch])))


def bucket_for(buckets: tuple[int, ...], batch: int) -> int | None:
    """Smallest bucket holding `batch` lanes (buckets sorted ascending); None: run eagerly."""
    i = bisect.bisect_left(buckets, batch)
    return buckets[i] if i < len(buckets) else None


def plan_buckets(candidates: Iterable[int], bytes_per_lane: Iterable[int], budget: int | None,
                 overhead_per_graph: int) -> tuple[int, ...]:
    """Largest prefix of the sorted candidates whose graphs fit the budget.

    `bytes_per_lane` holds one entry per graph captured at each bucket (one per registered (kind, q)): its
    static output bytes per lane. A bucket b costs sum(bytes_per_lane) * b + len(bytes_per_lane) * overhead.
    """
    cands = sorted(set(candidates))
    per_lane = list(bytes_per_lane)
    if budget is None:
        return tuple(cands)
    cost: Callable[[int], int] = lambda b: sum(per_lane) * b + len(per_lane) * overhead_per_graph
    while cands and sum(cost(b) for b in cands) > budget:
        cands.pop()
    return tuple(cands)


# KV-length buckets (torch attention only). A graph's page table has a fixed width, and the torch backend
# gathers and masks every key of that width for every lane: at one width of max_model_len, a verify of short
# requests on a 128k-context model reads the whole 128k-position range of keys per lane. Graphs captured at a
# few widths, each step replaying the narrowest one that holds its lanes, keep a step's attention work within
# KV_BUCKET_FACTOR of its actual lengths. FlashInfer reads only the pages it is given: one width there.
KV_BUCKET_MIN_TOKENS = 512
KV_BUCKET_FACTOR = 4


def kv_page_buckets(max_pages: int, page_size: int, min_tokens: int = KV_BUCKET_MIN_TOKENS,
                    factor: int = KV_BUCKET_FACTOR) -> tuple[int, ...]:
    """Page-table widths to capture, ascending, always ending at `max_pages`: min_tokens x factor^i in pages,
    without a width within 1.5x of the next (not worth a graph set of its own)."""
    widths, w = [], -(-min_tokens // page_size)
    while w * 1.5 <= max_pages:
        widths.append(w)
        w *= factor
    return (*widths, max_pages)


def width_for(widths: tuple[int, ...], pages: int) -> int | None:
    """Narrowest width holding `pages` pages (None: wider than every captured graph)."""
    i = bisect.bisect_left(widths, pages)
    return widths[i] if i < len(widths) else None
