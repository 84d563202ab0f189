"""The device stream: every piece of device work goes through one in-order queue.

CUDA: work is launched from the calling thread into a dedicated torch.cuda.Stream, bracketed by events; the
launch returns at once and `wait()` synchronises on the end event.
CPU: a single worker thread runs submitted work in order. Torch ops release the GIL, so the scheduler thread
really does prepare the next batch while the "device" computes, and the overlap logic, traces and analysis
are exercised on machines without a GPU. Both record each job's device interval for the trace.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


class StepHandle(Generic[T]):
    """A submitted job: its result once done, and its device interval (perf_counter seconds) for tracing."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self.device_start: float = 0.0
        self.device_end: float = 0.0
        self._end_event: Any = None
        self._start_event: Any = None
        # The job, with every input tensor its closure holds, until the job is known complete. On CUDA the
        # launch returns before the device reads those inputs; were they freed when the caller's references go,
        # the caching allocator would hand their blocks to the next step's inputs while this step still reads
        # them (wrong tokens, wrong KV slots). Released by `wait()`.
        self._retained: Any = None

    def done(self) -> bool:
        if self._end_event is not None:
            return bool(self._end_event.query())
        return self._done.is_set()

    def device_seconds(self) -> float:
        """Device time of the job (call after wait): CUDA event timing, or the worker thread's wall time."""
        if self._end_event is not None:
            return self._start_event.elapsed_time(self._end_event) / 1e3
        return self.device_end - self.device_start

    def result(self) -> T:
        """The outputs without waiting: valid for a later job on the same stream (which runs after this one
        completes, CPU) or right after submit (CUDA: outputs are allocated at launch)."""
        if self._error is not None:
            raise self._error
        return self._result

    def wait(self) -> T:
        """Block until the job's device work is complete; re-raise its error if it failed."""
        if self._end_event is not None:
            self._end_event.synchronize()
        else:
            self._done.wait()
        self._retained = None  # complete: its inputs may be freed and their blocks reused
        if self._error is not None:
            raise self._error
        return self._result


class DeviceStream(ABC):
    @abstractmethod
    def submit(self, name: str, fn: Callable[[], T]) -> StepHandle[T]:
        """Enqueue `fn` (device work only: no host syncs inside) and return at once."""

    def close(self) -> None:
        pass


class ThreadStream(DeviceStream):
    """CPU stand-in for a CUDA stream: one worker thread, FIFO."""

    # The worker's "device" work is torch ops dispatched from Python, so it needs the GIL to start each op; the
    # default 5 ms switch interval lets the scheduler thread's Python (output processing, batch building) hold
    # it long enough to idle the device between steps. A short interval hands it over promptly.
    SWITCH_INTERVAL_S = 2e-4

    # Not "device": that is the trace's device track, made of the explicit DEVICE_TRACK ranges; host work the
    # worker does (e.g. an attention plan) belongs on a CPU track of its own.
    def __init__(self, name: str = "device-stream", clock: Callable[[], float] = time.perf_counter) -> None:
        sys.setswitchinterval(min(sys.getswitchinterval(), self.SWITCH_INTERVAL_S))
        self._clock = clock  # for the handles' device intervals: a trace's clock, which a test may make virtual
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, name: str, fn: Callable[[], T]) -> StepHandle[T]:
        handle: StepHandle[T] = StepHandle(name)
        self._queue.put((handle, fn))
        return handle

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, fn = item
            handle.device_start = self._clock()
            try:
                with torch.inference_mode():
                    handle._result = fn()
            except BaseException as e:  # noqa: BLE001 (delivered to the waiter)
                handle._error = e
            handle.device_end = self._clock()
            item = fn = None  # do not hold the finished job's inputs until the next job arrives
            handle._done.set()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


class InlineStream(DeviceStream):
    """Runs work synchronously on the caller's thread: overlap off (debugging, and measuring what it buys)."""

    def submit(self, name: str, fn: Callable[[], T]) -> StepHandle[T]:
        handle: StepHandle[T] = StepHandle(name)
        handle.device_start = time.perf_counter()
        try:
            with torch.inference_mode():
                handle._result = fn()
        except BaseException as e:  # noqa: BLE001
            handle._error = e
        handle.device_end = time.perf_counter()
        handle._done.set()
        return handle


class CudaStream(DeviceStream):
    """Launches into a side CUDA stream from the calling thread; events time the device interval."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device)

    def submit(self, name: str, fn: Callable[[], T]) -> StepHandle[T]:
        handle: StepHandle[T] = StepHandle(name)
        handle._start_event = torch.cuda.Event(enable_timing=True)
        handle._end_event = torch.cuda.Event(enable_timing=True)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream), torch.inference_mode():
            handle._start_event.record()
            handle._result = fn()
            handle._end_event.record()
        handle._retained = fn  # its inputs were allocated on the launching stream: alive until wait()
        return handle


def make_stream(device: torch.device, overlap: bool) -> DeviceStream:
    if not overlap:
        return InlineStream()
    return CudaStream(device) if device.type == "cuda" else ThreadStream()
