"""The kernels' thread count chosen by timing both on live calls (`engine/thread_choice.py`): the faster count is
taken, the other is re-timed so a choice follows the load, large calls skip the timing, and the GGUF kernel's
calls settle on a count without changing a bit of their results."""

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
    for _ in range(40):
        assert choice.run("linear", 1000, 2, kernel) == 0
    assert kernel.calls[: 2 * thread_choice.TRIALS].count(1) == thread_choice.TRIALS  # both timed first
    assert choice.choice("linear") == faster
    assert kernel.calls[2 * thread_choice.TRIALS:] == [faster] * (40 - 2 * thread_choice.TRIALS)


def test_a_choice_follows_the_load():
    """The other core gets busy: one thread becomes the faster; the periodic re-timing finds it."""
    choice, kernel = ThreadChoice(always_all=1 << 30), FakeKernel({1: 1e-3, 2: 2e-4})
    for _ in range(20):
        choice.run("linear", 1000, 2, kernel)
    assert choice.choice("linear") == 2
    kernel.cost = {1: 2e-4, 2: 6e-4}  # still faster than one thread was: only re-timing one thread finds it
    for _ in range(thread_choice.RECHECK * (thread_choice.KEEP + 1)):
        choice.run("linear", 1000, 2, kernel)
    assert choice.choice("linear") == 1


def test_large_calls_and_one_thread_skip_the_timing():
    choice, kernel = ThreadChoice(always_all=1 << 20), FakeKernel({1: 0.0, 2: 0.0})
    choice.run("big", 1 << 20, 2, kernel)
    choice.run("small", 10, 1, kernel)
    assert kernel.calls == [2, 1] and choice.choice("big") is None and choice.choice("small") is None


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
    assert gguf_kernel.THREADS.choice(("Q4_1", 96, 64, 3)) in (1, 2)
