"""Where CPU work is hidden, as numbers: the analysis behind `specstep trace report`.

Input: a Chrome trace-event JSON as written by `TraceRecorder` (or any file with "X" complete events and
"thread_name" metadata). Definitions, all in microseconds:

  device steps   top-level ranges on the device track (ranges nested in another device range are stages)
  device busy    union of the device steps
  CPU prep       per CPU track, the union of the CPU_PREP ranges (so PLAN nested in BUILD_BATCH counts once),
                 summed over tracks
  hidden         the part of CPU prep that overlaps device busy time; hidden fraction = hidden / CPU prep

      CPU   [== prep ==]        [== prep ==]
      dev         [=========== step ===]
                  |-----|        |-----|      hidden (here 50%)

  idle gaps      max(0, start[i+1] - end[i]) between consecutive device steps; count is the number of
                 positive gaps, p99 is over all consecutive pairs
  host syncs     WAIT ranges; each is charged to the device step running when it ended (or the last one
                 started before it), giving syncs per step (mean and max)
  per kind       every device range grouped by (kind, batch, k): kind = args["kind"] or the range name; a stage
                 without its own batch / k takes its step's
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specstep.traces.ranges import CPU_PREP, DEVICE_TRACK, WAIT

EPS_US = 1e-3  # timestamps are floats in microseconds; tolerate rounding when comparing ends


@dataclass(frozen=True, slots=True)
class Span:
    name: str
    track: str
    start: float  # us
    end: float  # us
    args: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def dur(self) -> float:
        return self.end - self.start


def spans_from_events(events: list[dict[str, Any]]) -> list[Span]:
    """Complete ("X") events as spans; a track is a thread name, made unique per (pid, tid) when two threads
    share one (traces merged from the frontend and scheduler processes both have a MainThread)."""
    names: dict[tuple[Any, Any], str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name"))
    counts: dict[str, int] = defaultdict(int)
    for name in names.values():
        counts[name] += 1
    names = {k: (n if counts[n] == 1 else f"{n} [{k[0]}:{k[1]}]") for k, n in names.items()}
    spans = []
    for e in events:
        if e.get("ph") != "X":
            continue
        key = (e.get("pid"), e.get("tid"))
        start = float(e["ts"])
        spans.append(Span(str(e["name"]), names.get(key, f"{key[0]}:{key[1]}"), start,
                          start + float(e.get("dur", 0.0)), dict(e.get("args") or {})))
    return spans


def load_trace(path: str | Path) -> list[Span]:
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return spans_from_events(events)


# ---- interval arithmetic -------------------------------------------------------------------------------------

def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint cover of the given intervals."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def measure(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def intersection_measure(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of (union a) ∩ (union b); both arguments already disjoint and sorted (see `union`)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# ---- nesting -------------------------------------------------------------------------------------------------

def nesting_errors(spans: list[Span]) -> list[str]:
    """Ranges on each track must nest: any two are disjoint or one contains the other."""
    errors = []
    by_track: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        if s.end < s.start:
            errors.append(f"{s.track}: {s.name!r} at {s.start:.3f} has negative duration")
        by_track[s.track].append(s)
    for track, items in by_track.items():
        stack: list[Span] = []
        for s in sorted(items, key=lambda x: (x.start, -x.end)):
            while stack and stack[-1].end <= s.start + EPS_US:
                stack.pop()
            if stack and s.end > stack[-1].end + EPS_US:
                p = stack[-1]
                errors.append(f"{track}: {s.name!r} [{s.start:.3f}, {s.end:.3f}] overlaps {p.name!r} "
                              f"[{p.start:.3f}, {p.end:.3f}] without nesting in it")
                continue
            stack.append(s)
    return errors


def assert_nested(spans: list[Span]) -> None:
    errors = nesting_errors(spans)
    if errors:
        raise ValueError("trace ranges do not nest:\n  " + "\n  ".join(errors[:20]))


# ---- the report ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class KindStats:
    kind: str
    batch: int | None
    k: int | None
    count: int
    total_us: float
    mean_us: float
    p50_us: float
    p99_us: float


@dataclass(frozen=True, slots=True)
class TraceReport:
    wall_us: float
    num_steps: int
    device_busy_us: float
    prep_us: float
    prep_hidden_us: float
    hidden_fraction: float  # prep_hidden_us / prep_us (0 when there is no prep)
    idle_gap_count: int
    idle_gap_total_us: float
    idle_gap_p99_us: float
    host_syncs: int
    host_sync_us: float
    syncs_per_step: float
    max_syncs_per_step: int
    per_kind: list[KindStats]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        ms = 1e-3
        lines = [
            f"wall {self.wall_us * ms:.2f} ms, {self.num_steps} device steps, device busy "
            f"{self.device_busy_us * ms:.2f} ms ({_pct(self.device_busy_us, self.wall_us)})",
            f"CPU batch preparation {self.prep_us * ms:.2f} ms, hidden behind device work "
            f"{self.prep_hidden_us * ms:.2f} ms ({self.hidden_fraction:.1%})",
            f"device idle gaps: {self.idle_gap_count}, total {self.idle_gap_total_us * ms:.2f} ms, "
            f"p99 {self.idle_gap_p99_us:.1f} us",
            f"host syncs: {self.host_syncs} ({self.host_sync_us * ms:.2f} ms waiting), "
            f"{self.syncs_per_step:.2f} per step, max {self.max_syncs_per_step}",
            "",
            f"{'kind':<14}{'batch':>6}{'k':>4}{'count':>8}{'total ms':>11}{'mean us':>10}{'p50 us':>10}"
            f"{'p99 us':>10}",
        ]
        for s in self.per_kind:
            lines.append(f"{s.kind:<14}{_opt(s.batch):>6}{_opt(s.k):>4}{s.count:>8}{s.total_us * ms:>11.2f}"
                         f"{s.mean_us:>10.1f}{s.p50_us:>10.1f}{s.p99_us:>10.1f}")
        return "\n".join(lines)


def _pct(a: float, b: float) -> str:
    return f"{a / b:.1%}" if b > 0 else "n/a"


def _opt(x: int | None) -> str:
    return "-" if x is None else str(x)


def _p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else 0.0


def _top_level(spans: list[Span]) -> list[Span]:
    """Spans not contained in an earlier-starting span of the same list (input: one track)."""
    out: list[Span] = []
    for s in sorted(spans, key=lambda x: (x.start, -x.end)):
        if out and s.end <= out[-1].end + EPS_US and s.start >= out[-1].start:
            continue
        out.append(s)
    return out


def _int_arg(args: dict[str, Any], name: str) -> int | None:
    v = args.get(name)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def analyze(spans: list[Span], device_track: str = DEVICE_TRACK) -> TraceReport:
    device = [s for s in spans if s.track == device_track]
    cpu = [s for s in spans if s.track != device_track]
    steps = _top_level(device)
    busy = union([(s.start, s.end) for s in steps])

    prep = hidden = 0.0
    for track in {s.track for s in cpu}:
        prep_u = union([(s.start, s.end) for s in cpu if s.track == track and s.name in CPU_PREP])
        prep += measure(prep_u)
        hidden += intersection_measure(prep_u, busy)

    gaps = [max(0.0, b.start - a.end) for a, b in zip(steps, steps[1:])]
    waits = [s for s in cpu if s.name == WAIT]
    per_step = [0] * len(steps)
    starts = np.array([s.start for s in steps])
    for w in waits:
        i = int(np.searchsorted(starts, w.end, side="right")) - 1
        if i >= 0:
            per_step[i] += 1

    groups: dict[tuple[str, int | None, int | None], list[float]] = defaultdict(list)
    for s in device:
        top = steps[max(int(np.searchsorted(starts, s.start, side="right")) - 1, 0)] if steps else s
        args = {**top.args, **s.args} if top.start <= s.start and s.end <= top.end + EPS_US else s.args
        groups[(str(s.args.get("kind", s.name)), _int_arg(args, "batch"), _int_arg(args, "k"))].append(s.dur)
    per_kind = [KindStats(kind, b, k, len(d), float(sum(d)), float(np.mean(d)), float(np.percentile(d, 50)),
                          float(np.percentile(d, 99)))
                for (kind, b, k), d in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0,
                                                                               kv[0][2] or 0))]
    wall = (max(s.end for s in spans) - min(s.start for s in spans)) if spans else 0.0
    return TraceReport(
        wall_us=wall, num_steps=len(steps), device_busy_us=measure(busy), prep_us=prep, prep_hidden_us=hidden,
        hidden_fraction=hidden / prep if prep > 0 else 0.0,
        idle_gap_count=sum(g > 0 for g in gaps), idle_gap_total_us=float(sum(gaps)), idle_gap_p99_us=_p99(gaps),
        host_syncs=len(waits), host_sync_us=float(sum(w.dur for w in waits)),
        syncs_per_step=len(waits) / len(steps) if steps else 0.0, max_syncs_per_step=max(per_step, default=0),
        per_kind=per_kind,
    )


def report_file(path: str | Path) -> TraceReport:
    return analyze(load_trace(path))
