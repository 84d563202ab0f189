"""Tracer: NVTX ranges for Nsight Systems plus, optionally, the same ranges recorded to a Chrome trace.

Passed explicitly to whoever traces (no global state). Without a profiler and without a recorder a range is one
call returning a shared no-op context manager (`benchmarks/nvtx_overhead.py` measures it). NVTX is used only
when a tool is attached: `nsys profile` injects one before the process starts, and without it the `nvtx`
package hands out a no-op DummyDomain, which `nvtx_active()` checks. Ranges then go to the "specstep" domain
with one registered attribute set per name, the cheapest NVTX path the `nvtx` package offers.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specstep.traces.ranges import DEVICE_TRACK

try:  # nvtx is a declared dependency, but tracing must never be why the engine fails to start
    import nvtx as _nvtx
except ImportError:  # pragma: no cover
    _nvtx = None

NVTX_DOMAIN = "specstep"
_TRACK_TID_BASE = 1 << 40  # named tracks get tids far from real thread idents


def nvtx_active() -> bool:
    """True when an NVTX tool (Nsight Systems) is attached: the `nvtx` package then hands out a real domain
    instead of its no-op DummyDomain."""
    return (_nvtx is not None and bool(_nvtx.enabled())
            and type(_nvtx.get_domain(NVTX_DOMAIN)).__name__ != "DummyDomain")


class TraceRecorder:
    """Collects Chrome trace events ("X" complete events, "i" instants, "C" counters), thread-safe.

    Timestamps are microseconds of `clock` (seconds; perf_counter, or a virtual clock a test advances itself, so
    that what overlaps what follows from the order of events, never from how fast a loaded machine ran). Each CPU
    thread is a track (its thread name); named tracks (e.g. "device") get their own tid, so the trace viewer and
    `traces.report` see them as separate rows. Complete events are kept as tuples on the hot path and turned into
    dicts only when exported.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._complete: list[tuple[str, float, float, int, dict[str, Any] | None]] = []
        self._other: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._threads: dict[int, str] = {}
        self._named: dict[str, int] = {}
        self.resolvers: list = []  # called before export: turn pending device timings (CUDA events) into events

    def _tid(self, track: str | None) -> int:
        if track is not None:
            tid = self._named.get(track)
            if tid is None:
                with self._lock:
                    tid = self._named.setdefault(track, _TRACK_TID_BASE + len(self._named))
                    self._threads[tid] = track
            return tid
        tid = threading.get_ident()
        if tid not in self._threads:
            with self._lock:
                self._threads[tid] = threading.current_thread().name
        return tid

    def now_us(self) -> float:
        return self.clock() * 1e6

    def complete(self, name: str, start_us: float, end_us: float, track: str | None = None, **args: Any) -> None:
        self._complete.append((name, start_us, end_us, self._tid(track), args or None))  # atomic under the GIL

    def instant(self, name: str, track: str | None = None, **args: Any) -> None:
        self._other.append({"ph": "i", "s": "t", "name": name, "ts": self.now_us(), "pid": self._pid,
                            "tid": self._tid(track), "args": args})

    def counter(self, name: str, **values: float) -> None:
        self._other.append({"ph": "C", "name": name, "ts": self.now_us(), "pid": self._pid, "tid": 0, "args": values})

    @property
    def events(self) -> list[dict[str, Any]]:
        """All recorded events as Chrome trace-event dicts (unsorted, no metadata)."""
        for resolve in self.resolvers:
            resolve()
        out = []
        for name, start, end, tid, args in list(self._complete):
            ev = {"ph": "X", "name": name, "ts": start, "dur": max(end - start, 0.0), "pid": self._pid, "tid": tid}
            if args:
                ev["args"] = args
            out.append(ev)
        return out + list(self._other)

    def to_json(self) -> dict[str, Any]:
        # Parents before children at equal timestamps (longer first), so viewers and the nesting check agree.
        events = sorted(self.events, key=lambda e: (e["ts"], -e.get("dur", 0.0)))  # resolving may add tracks
        meta = [{"ph": "M", "name": "thread_name", "pid": self._pid, "tid": tid, "args": {"name": name}}
                for tid, name in list(self._threads.items())]
        return {"traceEvents": meta + events, "displayTimeUnit": "ms"}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))


# One shared stdlib null context: a range costs one call when nothing records and no profiler is attached.
_NULL_RANGE = contextlib.nullcontext()


class _Range:
    __slots__ = ("_tracer", "_name", "_track", "_args", "_start")

    def __init__(self, tracer: Tracer, name: str, track: str | None, args: dict[str, Any]) -> None:
        self._tracer, self._name, self._track, self._args = tracer, name, track, args
        self._start = 0.0

    def __enter__(self) -> None:
        tr = self._tracer
        if tr._domain is not None:
            tr._domain.push_range(tr._attributes(self._name))
        if tr.recorder is not None:
            self._start = tr.recorder.now_us()

    def __exit__(self, *exc: object) -> None:
        tr = self._tracer
        rec = tr.recorder
        if rec is not None:
            rec._complete.append((self._name, self._start, rec.now_us(), rec._tid(self._track), self._args or None))
        if tr._domain is not None:
            tr._domain.pop_range()


class _CudaRange(_Range):
    """A device-track range on CUDA: its device interval comes from a pair of CUDA events on the current stream
    (resolved after the work ran), its host interval (the launch) goes to the launching thread's track as
    NAME.launch. Inside a graph capture only the host side is kept (the replay's own range times the graph)."""

    __slots__ = ("_ev0", "_host0")

    def __enter__(self) -> None:
        tr = self._tracer
        if tr._domain is not None:
            tr._domain.push_range(tr._attributes(self._name))
        self._host0 = tr.recorder.now_us()
        cuda = tr._cuda
        self._ev0 = None if cuda.is_current_stream_capturing() else cuda.Event(enable_timing=True)
        if self._ev0 is not None:
            self._ev0.record()

    def __exit__(self, *exc: object) -> None:
        tr = self._tracer
        rec = tr.recorder
        if self._ev0 is not None:
            ev1 = tr._cuda.Event(enable_timing=True)
            ev1.record()
            tr._pending.append((self._name, self._ev0, ev1, self._args))
        rec._complete.append((self._name + ".launch", self._host0, rec.now_us(), rec._tid(None), self._args or None))
        if tr._domain is not None:
            tr._domain.pop_range()


class Tracer:
    def __init__(self, recorder: TraceRecorder | None = None, nvtx: bool = True) -> None:
        self.recorder = recorder
        self._domain = _nvtx.get_domain(NVTX_DOMAIN) if nvtx and nvtx_active() else None
        self._attrs: dict[str, Any] = {}
        self._cuda: Any = None  # torch.cuda once `use_cuda_events` was called
        self._pending: list[tuple[str, Any, Any, dict[str, Any]]] = []
        self._anchor: Any = None
        self._anchor_us = 0.0

    def use_cuda_events(self, cuda: Any) -> None:
        """Device-track ranges on a CUDA device: time them with events, not with the launching thread's clock
        (which would call launch time device time). `cuda` is `torch.cuda` (a stand-in in CPU tests)."""
        if self.recorder is None or self._cuda is not None:
            return
        cuda.synchronize()
        self._anchor = cuda.Event(enable_timing=True)
        self._anchor.record()
        self._anchor.synchronize()
        self._anchor_us = self.recorder.now_us()  # the anchor event's completion, on the recorder's clock
        self._cuda = cuda
        self.recorder.resolvers.append(self._resolve_device)

    def _resolve_device(self) -> None:
        pending, self._pending = self._pending, []
        for name, ev0, ev1, args in pending:
            ev1.synchronize()
            start = self._anchor_us + self._anchor.elapsed_time(ev0) * 1e3
            end = self._anchor_us + self._anchor.elapsed_time(ev1) * 1e3
            self.recorder.complete(name, start, end, DEVICE_TRACK, **args)

    @property
    def recording(self) -> bool:
        return self.recorder is not None

    @property
    def nvtx(self) -> bool:
        return self._domain is not None

    def _attributes(self, name: str) -> Any:
        attrs = self._attrs.get(name)
        if attrs is None:
            attrs = self._attrs[name] = self._domain.get_event_attributes(name)
        return attrs

    def range(self, name: str, track: str | None = None, **args: Any) -> _Range | contextlib.nullcontext:
        """A CPU range on the current thread (or on `track`, e.g. the device track of the CPU stream).

        Use as `with tracer.range(ranges.BUILD_BATCH, batch=8):`. `args` land in the trace event.
        """
        if self.recorder is None and self._domain is None:
            return _NULL_RANGE
        if track == DEVICE_TRACK and self._cuda is not None:
            return _CudaRange(self, name, track, args)
        return _Range(self, name, track, args)

    def device_interval(self, name: str, start_s: float, end_s: float, **args: Any) -> None:
        """A device interval measured elsewhere (stream timings / CUDA events), in seconds of the recorder's clock."""
        if self.recorder is not None:
            self.recorder.complete(name, start_s * 1e6, end_s * 1e6, DEVICE_TRACK, **args)

    def instant(self, name: str, **args: Any) -> None:
        if self.recorder is not None:
            self.recorder.instant(name, **args)

    def counter(self, name: str, **values: float) -> None:
        if self.recorder is not None:
            self.recorder.counter(name, **values)


NULL_TRACER = Tracer(None, nvtx=False)
