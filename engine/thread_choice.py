"""How many OpenMP threads a C++ kernel call takes (`gguf_kernel`, `cpu_attention`), chosen by timing both on the
engine's own calls.

Waking a sleeping OpenMP thread is not free: with `OMP_WAIT_POLICY=PASSIVE` (which the engine needs, or spinning
threads starve the other core) it cost 0.2-0.3 ms on an AVX2 EPYC host, as much as a 576 x 576 Q4_1 linear's
whole work at one row. Whether a second thread pays depends on the shape, the rows, whether the weights are in
cache and whether the other core is busy, which no fixed figure knows: a fixed threshold of 0.5 M weight-row
products woke the second thread three times a layer at batch 1, and a SmolLM2 decode step ran 1.2-1.5x slower
than with one thread (`bench_steps`, same host), while a batch-8 verify step needs both threads.

So each kind of call (a key: a kernel's shape and row count) times its first calls with one and with all of the
threads, alternating, and then takes the faster by the median; every `RECHECK` calls it times the other count
once more, so a choice follows the load. A kernel's results never depend on its thread count (both kernels split
output rows, never a sum), so trying both on real calls changes nothing but time. Calls whose work is far past
any wake-up (`ALWAYS_ALL` multiply-adds, by default) take every thread without timing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

TRIALS = 3  # timed calls of each thread count before choosing
RECHECK = 256  # calls between re-timings of the count not chosen
KEEP = 3  # latest timings kept per count: their median decides
# Work (multiply-adds, or a kernel's own unit) from which every thread pays on any host: not timed. A batch-8
# verify's largest linear (40 rows x 3072 x 576) is 71 M; a batch-1 step's lm_head (49152 x 576) 28 M, timed.
ALWAYS_ALL = 1 << 26


@dataclass
class _Timings:
    seconds: dict[int, list[float]] = field(default_factory=dict)
    calls: int = 0

    def median(self, threads: int) -> float:
        return statistics.median(self.seconds[threads])


class ThreadChoice:
    """Per-key choice between one thread and `max_threads` (torch's count at the call) by live timing."""

    def __init__(self, always_all: int = ALWAYS_ALL) -> None:
        self.always_all = always_all  # work (the kernel's own unit) from which every thread is taken untimed
        self._keys: dict[Hashable, _Timings] = {}

    def run(self, key: Hashable, work: int, max_threads: int, call: Callable[[int], int]) -> int:
        """`call(threads)` with the thread count this key should take now; returns the call's return code."""
        if max_threads <= 1 or work >= self.always_all:
            return call(max(1, max_threads))
        t = self._keys.setdefault(key, _Timings())
        threads = self._pick(t, max_threads)
        start = time.perf_counter()
        rc = call(threads)
        samples = t.seconds.setdefault(threads, [])
        samples.append(time.perf_counter() - start)
        del samples[:-KEEP]
        t.calls += 1
        return rc

    def choice(self, key: Hashable) -> int | None:
        """The count a key has settled on (None while it is still timing both)."""
        t = self._keys.get(key)
        if t is None or len(t.seconds) < 2 or min(len(s) for s in t.seconds.values()) < TRIALS:
            return None
        return min(t.seconds, key=t.median)

    @staticmethod
    def _pick(t: _Timings, max_threads: int) -> int:
        counts = (1, max_threads)
        short = [c for c in counts if len(t.seconds.get(c, ())) < TRIALS]
        if short:
            return short[t.calls % len(short)]
        best = min(counts, key=t.median)
        if t.calls % RECHECK == RECHECK - 1:
            return counts[1] if best == counts[0] else counts[0]
        return best
