"""The kernels' thread count chosen by timing both on live calls (`engine/thread_choice.py`): the faster count is
taken, the other is re-timed so a choice follows the load (soon after a choice, rarely once it stands), only the
smallest unsettled size of a kind is timed (larger ones take every thread), large calls skip the timing, and the
GGUF kernel's calls settle on a count without changing a bit of their results."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from specstep.engine import thread_choice
from specstep.engine.models import gguf_kernel
from specstep.engine.thread_choice import ThreadChoice


class FakeKernel:
    """A call that takes `cost[threads]` seconds (a busy wait: sleeping is too coarse for a few hundred us)."""

    def __init__(self, cost: dict[int, float]) -> None:
        self.cost, self.calls = dict(cost), []

    def __call__(self, threads: int) -> int:
        self.calls.append(threads)
        end = time.perf_counter() + self.cost[threads]
        while time.perf_counter() < end:
            pass
        return 0


@pytest.mark.parametrize("faster", [1, 2])
def test_the_faster_count_is_taken_after_timing_both(faster):
    choice, kernel = ThreadChoice(always_all=1 << 30), FakeKernel({faster: 2e-4, 3 - faster: 1e-3})
    trials, first = 2 * thread_choice.TRIALS, thread_choice.RECHECK_FIRST
    for _ in range(trials + first + 1):
        assert choice.run("linear", 1, 1000, 2, kernel) == 0
    assert kernel.calls[:trials].count(1) == thread_choice.TRIALS  # both timed first
    assert choice.choice("linear", 1) == faster
    assert kernel.calls[trials:] == [faster] * first + [3 - faster]  # then the other once, RECHECK_FIRST later


def test_a_choice_follows_the_load():
    """The other core gets busy: one thread becomes the faster; the periodic re-timing finds it."""
    choice, kernel = ThreadChoice(always_all=1 << 30), FakeKernel({1: 1e-3, 2: 2e-4})
    for _ in range(20):
        choice.run("linear", 1, 1000, 2, kernel)
    assert choice.choice("linear", 1) == 2
    kernel.cost = {1: 2e-4, 2: 6e-4}  # still faster than one thread was: only re-timing one thread finds it
    for _ in range(thread_choice.RECHECK * (thread_choice.KEEP + 1)):
        choice.run("linear", 1, 1000, 2, kernel)
    assert choice.choice("linear", 1) == 1


def test_a_choice_made_while_the_host_was_busy_is_undone_within_tens_of_calls():
    """Both threads look slow for the first calls (the other core busy a moment), then are the faster for good:
    the re-timing after RECHECK_FIRST calls, then twice as long, finds it long before RECHECK calls; once the
    choice stands, the slower count is timed ever more rarely."""
    choice, kernel = ThreadChoice(always_all=1 << 30), FakeKernel({1: 4e-4, 2: 1e-3})
    for _ in range(2 * thread_choice.TRIALS):
        choice.run("stack", 1, 1000, 2, kernel)
    assert choice.choice("stack", 1) == 1
    kernel.cost = {1: 4e-4, 2: 1e-4}
    calls = 0
    while choice.choice("stack", 1) != 2:
        choice.run("stack", 1, 1000, 2, kernel)
        calls += 1
        assert calls < thread_choice.RECHECK // 2, "still on one thread"
    kernel.calls.clear()
    for _ in range(500):
        choice.run("stack", 1, 1000, 2, kernel)
    retimed = [i for i, c in enumerate(kernel.calls) if c == 1]
    # one thread re-timed 16 calls after the choice changed, then 32, 64, 128, then every 256
    first = thread_choice.RECHECK_FIRST
    gaps = [b - a for a, b in zip(retimed, retimed[1:], strict=False)]
    assert gaps == [2 * first, 4 * first, 8 * first, thread_choice.RECHECK][: len(gaps)] and len(gaps) >= 3


def test_only_the_smallest_unsettled_size_of_a_kind_is_timed():
    """Rows 1 times both threads and settles on both: 2 to 40 rows of the kind, met in between and after, take
    both from their first call (none spent on one thread); another kind times its own. Rows 40 settled on one
    thread: a smaller size times itself (one thread is never taken untimed), and while it does, the sizes between
    take both."""
    choice, kernel = ThreadChoice(always_all=1 << 30), FakeKernel({1: 3e-4, 2: 1e-4})
    for rows in [1, 5, 1, 12, 1, 1, 40, 1, 1, *range(2, 41)]:
        choice.run("stack", rows, 1000 * rows, 2, kernel)
    assert kernel.calls.count(1) == thread_choice.TRIALS  # rows 1's trials only
    assert all(choice.choice("stack", rows) == 2 for rows in range(1, 41))
    choice.run("lm_head", 2, 1000, 2, kernel)  # its own kind: timed, and only sizes above it follow
    assert choice.choice("lm_head", 2) is None and choice.choice("lm_head", 1) is None
    assert choice.choice("lm_head", 3) == 2

    choice, kernel = ThreadChoice(always_all=1 << 30), FakeKernel({1: 1e-4, 2: 3e-4})
    for _ in range(2 * thread_choice.TRIALS):
        choice.run("stack", 40, 1000, 2, kernel)
    assert choice.choice("stack", 40) == 1
    assert choice.choice("stack", 39) is None and choice.choice("stack", 41) is None
    kernel.calls.clear()
    for rows in [8, 20, 8, 30]:
        choice.run("stack", rows, 1000, 2, kernel)
    assert kernel.calls == [1, 2, 2, 2]  # rows 8 times both (one, then all); 20 and 30 take all meanwhile


def test_a_size_met_a_few_times_and_never_again_stops_holding_larger_sizes_on_every_thread():
    """Rows 1 settle on one thread; rows 2 are met twice (still timing both) and never again: rows 6 take every
    thread while rows 2 might still settle, then time themselves and settle on the faster one thread."""
    choice, kernel = ThreadChoice(always_all=1 << 30), FakeKernel({1: 1e-4, 2: 3e-4})
    for _ in range(2 * thread_choice.TRIALS):
        choice.run("stack", 1, 1000, 2, kernel)
    for _ in range(2):
        choice.run("stack", 2, 1000, 2, kernel)
    kernel.calls.clear()
    for _ in range(thread_choice.STALE + 2 * thread_choice.TRIALS + 5):
        choice.run("stack", 6, 1000, 2, kernel)
    assert choice.choice("stack", 6) == 1
    assert kernel.calls[: thread_choice.STALE - 2] == [2] * (thread_choice.STALE - 2)
    assert kernel.calls[-5:] == [1] * 5


def test_a_change_of_torchs_thread_count_never_runs_a_count_it_no_longer_has():
    """Torch's threads go 2 -> 4 -> 2: settled on 2, then on 4 (timed against 1), then back at 2 no call runs 4
    threads and the size settles on 2 again."""
    choice, kernel = ThreadChoice(always_all=1 << 30), FakeKernel({1: 3e-4, 2: 2e-4, 4: 1e-4})
    for threads in (2, 4):
        for _ in range(2 * thread_choice.TRIALS):
            choice.run("stack", 1, 1000, threads, kernel)
        assert choice.choice("stack", 1, max_threads=threads) == threads
    kernel.calls.clear()
    for _ in range(2 * thread_choice.TRIALS):
        choice.run("stack", 1, 1000, 2, kernel)
    assert 4 not in kernel.calls and choice.choice("stack", 1) == 2


def test_large_calls_and_one_thread_skip_the_timing():
    choice, kernel = ThreadChoice(always_all=1 << 20), FakeKernel({1: 0.0, 2: 0.0})
    choice.run("big", 1, 1 << 20, 2, kernel)
    choice.run("small", 1, 10, 1, kernel)
    assert kernel.calls == [2, 1] and choice.choice("big", 1) is None and choice.choice("small", 1) is None


@pytest.mark.skipif(bool(gguf_kernel.unavailable()), reason="GGUF kernel unavailable")
def test_gguf_calls_settle_on_a_count_and_their_bits_do_not_depend_on_it(monkeypatch):
    import gguf

    monkeypatch.setattr(gguf_kernel, "THREADS", ThreadChoice(always_all=1 << 40))
    w = np.random.default_rng(0).standard_normal((96, 64)).astype(np.float32)
    blocks = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1))
    x = torch.randn(3, 64)
    want = gguf_kernel.gguf_linear(x, blocks, 96, "Q4_1", threads=1)
    with_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(4 * thread_choice.TRIALS):
            assert torch.equal(gguf_kernel.gguf_linear(x, blocks, 96, "Q4_1"), want)
    finally:
        torch.set_num_threads(with_threads)
    assert gguf_kernel.THREADS.choice(("Q4_1", 96, 64), 3) in (1, 2)
