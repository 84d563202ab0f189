"""How many OpenMP threads a C++ kernel call takes (`gguf_kernel`, `cpu_attention`, `decode_layers`), chosen by
timing both on the engine's own calls.

Waking a sleeping OpenMP thread is not free: with `OMP_WAIT_POLICY=PASSIVE` (which the engine needs, or spinning
threads starve the other core) it cost 0.2-0.3 ms on an AVX2 EPYC host, as much as a 576 x 576 Q4_1 linear's
whole work at one row. Whether a second thread pays depends on the shape, the rows, whether the weights are in
cache and whether the other core is busy, which no fixed figure knows: a fixed threshold of 0.5 M weight-row
products woke the second thread three times a layer at batch 1, and a SmolLM2 decode step ran 1.2-1.5x slower
than with one thread (`bench_steps`, same host), while a batch-8 verify step needs both threads.

So each call (a kind, e.g. a kernel's shape, and a size, its rows) times its first calls with one and with all
of the threads, alternating, and then takes the faster by the median. A kernel's results never depend on its
thread count (every kernel splits output rows, never a sum), so trying both on real calls changes nothing but
time. Calls whose work is far past any wake-up (`ALWAYS_ALL` multiply-adds, by default) take every thread
without timing.

Sizes of one kind are ordered: a call's cost of waking and meeting the other thread does not grow with its rows,
its work does. So only the smallest size of a kind that has not settled on one thread is timed: every larger
size takes all threads untimed, while it times both (unless it has not been called for `STALE` calls of the
kind: a size met a few times and never again) and once it settles on all of them. Timing each size on its
own cost most where it is least needed: under the adaptive speculation policy a batch-8 run meets a dozen row
counts a few times each, and half of each one's first calls ran on one thread at ~1.8x a step's cost. The
converse (a size settled on one thread gives smaller sizes one) is not used: a choice made while the other core
was briefly busy would reach sizes that were never timed, and stay until the size that made it is called often
enough to be re-timed.

A choice follows the load: the count not chosen is timed once more after `RECHECK_FIRST` calls, then after twice
as many each time the choice stands, up to every `RECHECK` calls; a choice that changes starts over at
`RECHECK_FIRST`, so one made while the host was briefly busy is undone within tens of calls, not hundreds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

TRIALS = 3  # timed calls of each thread count before choosing
# Calls of a kind after which a size still timing both (met a few times, never again) stops giving larger sizes
# every thread: they time themselves. Not much shorter: under the adaptive policy a batch-8 run meets its smallest
# row count (no lane drafting) only every few dozen calls, and at 12 the sizes above it took turns timing
# themselves (13-20 calls on one thread a run against 2 with no limit, measured).
STALE = 64
RECHECK_FIRST = 16  # calls after a choice (or a change of it) before the other count is timed again
RECHECK = 256  # the longest interval between re-timings of the count not chosen
KEEP = 3  # latest timings kept per count: their median decides
# Work (multiply-adds, or a kernel's own unit) from which every thread pays on any host: not timed. A batch-8
# verify's largest linear (40 rows x 3072 x 576) is 71 M; a batch-1 step's lm_head (49152 x 576) 28 M, timed.
ALWAYS_ALL = 1 << 26


def size_of(rows: int) -> int:
    """The size a call of `rows` rows is timed as: itself up to 64 (steps), else the power of two above it (prompts'
    row counts: fewer sizes to time)."""
    return rows if rows <= 64 else 1 << rows.bit_length()


@dataclass
class _Timings:
    seconds: dict[int, list[float]] = field(default_factory=dict)
    calls: int = 0
    last: int = 0  # the kind's call count at this size's latest timed call
    chosen: int | None = None  # the count the timings settled on, once both have TRIALS
    interval: int = RECHECK_FIRST  # calls from one re-timing of the other count to the next
    next_check: int = 0  # the call that re-times the other count

    def median(self, threads: int) -> float:
        return statistics.median(self.seconds[threads])


class ThreadChoice:
    """Per-call choice between one thread and `max_threads` (torch's count at the call) by live timing."""

    def __init__(self, always_all: int = ALWAYS_ALL) -> None:
        self.always_all = always_all  # work (the kernel's own unit) from which every thread is taken untimed
        self._kinds: dict[Hashable, dict[int, _Timings]] = {}
        self._kind_calls: dict[Hashable, int] = {}

    def run(self, kind: Hashable, size: int, work: int, max_threads: int, call: Callable[[int], int]) -> int:
        """`call(threads)` with the thread count a call of this kind and size (its rows: larger takes at least
        as much work) should take now; returns the call's return code."""
        if max_threads <= 1 or work >= self.always_all:
            return call(max(1, max_threads))
        sizes = self._kinds.setdefault(kind, {})
        now = self._kind_calls[kind] = self._kind_calls.get(kind, 0) + 1
        own = sizes.get(size)
        if own is None or own.chosen is None:
            implied = self._implied(sizes, size, max_threads, now)
            if implied is not None:
                return call(implied)
        t = sizes.setdefault(size, _Timings())
        t.last = now
        threads = self._pick(t, max_threads)
        start = time.perf_counter()
        rc = call(threads)
        samples = t.seconds.setdefault(threads, [])
        samples.append(time.perf_counter() - start)
        del samples[:-KEEP]
        t.calls += 1
        self._settle(t, max_threads)
        return rc

    def choice(self, kind: Hashable, size: int, max_threads: int = 2) -> int | None:
        """The count a call of this kind and size takes without timing it now (`max_threads` at most): its own
        settled choice, or the one a smaller size of its kind implies (None while it would still time both)."""
        sizes = self._kinds.get(kind, {})
        own = sizes.get(size)
        if own is not None and own.chosen in (1, max_threads):
            return own.chosen
        return self._implied(sizes, size, max_threads, self._kind_calls.get(kind, 0))

    @staticmethod
    def _implied(sizes: dict[int, _Timings], size: int, max_threads: int, now: int) -> int | None:
        """All threads if a smaller size of the kind settled on them, or is timing both (called within the
        kind's last STALE calls); None (time this size) otherwise."""
        for other, t in sizes.items():
            timing = t.chosen is None and now - t.last <= STALE
            if other < size and (timing or t.chosen not in (None, 1)):
                return max_threads
        return None

    @staticmethod
    def _short(t: _Timings, counts: tuple[int, int]) -> list[int]:
        """The counts still short of their TRIALS timings."""
        return [c for c in counts if len(t.seconds.get(c, ())) < TRIALS]

    @staticmethod
    def _settle(t: _Timings, max_threads: int) -> None:
        """Once both counts have their trials: the faster by the median; a new choice (the first, or the load
        changed it) has the other count re-timed soon."""
        counts = (1, max_threads)
        if ThreadChoice._short(t, counts):
            return
        best = min(counts, key=t.median)
        if best != t.chosen:
            t.chosen, t.interval, t.next_check = best, RECHECK_FIRST, t.calls + RECHECK_FIRST

    @staticmethod
    def _pick(t: _Timings, max_threads: int) -> int:
        counts = (1, max_threads)
        if t.chosen not in (None, *counts):  # torch's thread count changed since: time the new count first
            t.chosen = None
        short = ThreadChoice._short(t, counts)
        if short or t.chosen is None:
            return short[t.calls % len(short)] if short else counts[1]
        if t.calls >= t.next_check:
            t.interval = min(2 * t.interval, RECHECK)
            t.next_check = t.calls + t.interval
            return counts[1] if t.chosen == counts[0] else counts[0]
        return t.chosen
