"""Tracer: NVTX ranges for Nsight Systems plus, optionally, the same ranges recorded to a Chrome trace.

Passed explicitly to whoever traces (no global state). With no recorder and no profiler attached it costs an
NVTX push/pop, which is a no-op call when no tool is injected.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

try:  # nvtx is a declared dependency, but tracing must never be why the engine fails to start
    import nvtx as _nvtx
except ImportError:  # pragma: no cover
    _nvtx = None


def _now_us() -> float:
    return time.perf_counter() * 1e6


class TraceRecorder:
    """Collects Chrome trace events ("X" complete events, "i" instants, "C" counters), thread-safe."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._threads: dict[int, str] = {}

    def _tid(self, track: str | None) -> int:
        if track is not None:
            tid = hash(track) & 0x7FFFFFFF
            name = track
        else:
            t = threading.current_thread()
            tid, name = t.ident or 0, t.name
        if tid not in self._threads:
            with self._lock:
                self._threads[tid] = name
        return tid

    def complete(self, name: str, start_us: float, end_us: float, track: str | None = None, **args: Any) -> None:
        ev = {"ph": "X", "name": name, "ts": start_us, "dur": max(end_us - start_us, 0.0), "pid": self._pid,
              "tid": self._tid(track)}
        if args:
            ev["args"] = args
        self.events.append(ev)  # list.append is atomic under the GIL

    def instant(self, name: str, track: str | None = None, **args: Any) -> None:
        self.events.append({"ph": "i", "s": "t", "name": name, "ts": _now_us(), "pid": self._pid,
                            "tid": self._tid(track), "args": args})

    def counter(self, name: str, **values: float) -> None:
        self.events.append({"ph": "C", "name": name, "ts": _now_us(), "pid": self._pid, "tid": 0, "args": values})

    def to_json(self) -> dict[str, Any]:
        meta = [{"ph": "M", "name": "thread_name", "pid": self._pid, "tid": tid, "args": {"name": name}}
                for tid, name in self._threads.items()]
        return {"traceEvents": meta + sorted(self.events, key=lambda e: e["ts"]), "displayTimeUnit": "ms"}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))


class Tracer:
    def __init__(self, recorder: TraceRecorder | None = None, nvtx: bool = True) -> None:
        self.recorder = recorder
        self._nvtx = _nvtx if nvtx else None

    @property
    def recording(self) -> bool:
        return self.recorder is not None

    @contextmanager
    def range(self, name: str, track: str | None = None, **args: Any) -> Iterator[None]:
        """A CPU range on the current thread (or on `track`, e.g. the device track of the CPU stream)."""
        if self._nvtx is not None:
            self._nvtx.push_range(name)
        start = _now_us() if self.recorder is not None else 0.0
        try:
            yield
        finally:
            if self.recorder is not None:
                self.recorder.complete(name, start, _now_us(), track, **args)
            if self._nvtx is not None:
                self._nvtx.pop_range()

    def device_interval(self, name: str, start_s: float, end_s: float, **args: Any) -> None:
        """A device interval measured elsewhere (stream timings / CUDA events), perf_counter seconds."""
        if self.recorder is not None:
            self.recorder.complete(name, start_s * 1e6, end_s * 1e6, "device", **args)

    def instant(self, name: str, **args: Any) -> None:
        if self.recorder is not None:
            self.recorder.instant(name, **args)

    def counter(self, name: str, **values: float) -> None:
        if self.recorder is not None:
            self.recorder.counter(name, **values)


NULL_TRACER = Tracer(None, nvtx=False)
