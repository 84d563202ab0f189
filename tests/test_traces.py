"""Trace recorder, nesting check and `specstep trace report` figures."""

from __future__ import annotations

import json
import os
import threading

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

from specstep.engine.stream import ThreadStream  # noqa: E402
from specstep.scheduler.cli import main as cli_main  # noqa: E402
from specstep.traces import ranges  # noqa: E402
from specstep.traces.report import Span, analyze, assert_nested, load_trace, nesting_errors, spans_from_events  # noqa: E402
from specstep.traces.tracer import NULL_TRACER, Tracer, TraceRecorder  # noqa: E402


def _x(name: str, tid: int, ts: float, dur: float, **args) -> dict:
    ev = {"ph": "X", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}
    if args:
        ev["args"] = args
    return ev


SCHED, DEV = 10, 20
HAND_MADE = [
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": SCHED, "args": {"name": "scheduler"}},
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": DEV, "args": {"name": ranges.DEVICE_TRACK}},
    # CPU: prep [0, 100] with a nested plan (counted once), prep [200, 300], a wait [240, 250]
    _x(ranges.BUILD_BATCH, SCHED, 0, 100),
    _x(ranges.PLAN, SCHED, 20, 30),
    _x(ranges.BUILD_BATCH, SCHED, 200, 100),
    _x(ranges.WAIT, SCHED, 300, 10),
    _x(ranges.WAIT, SCHED, 420, 5),
    # device: steps [50, 250], [300, 400], [400, 500]; stages nested in the first
    _x(ranges.DECODE, DEV, 50, 200, batch=8, k=3),
    _x(ranges.DRAFT, DEV, 50, 50),
    _x(ranges.VERIFY, DEV, 100, 100),
    _x(ranges.DECODE, DEV, 300, 100, batch=8, k=3),
    _x(ranges.PREFILL, DEV, 400, 100, batch=2),
]


def test_hand_made_trace_exact_figures():
    spans = spans_from_events(HAND_MADE)
    assert nesting_errors(spans) == []
    r = analyze(spans)
    # prep = [0, 100] ∪ [200, 300] = 200 us; device busy covers [50, 100] and [200, 250] of it: 100 us.
    assert r.prep_us == 200.0 and r.prep_hidden_us == 100.0 and r.hidden_fraction == 0.5
    assert r.num_steps == 3 and r.device_busy_us == 400.0 and r.wall_us == 500.0
    # gaps: 300 - 250 = 50, 400 - 400 = 0
    assert r.idle_gap_count == 1 and r.idle_gap_total_us == 50.0
    # wait ending at 310 is charged to the step [300, 400], the one ending at 425 to [400, 500]
    assert r.host_syncs == 2 and r.host_sync_us == 15.0 and r.max_syncs_per_step == 1
    assert r.syncs_per_step == pytest.approx(2 / 3)
    decode = next(s for s in r.per_kind if s.kind == ranges.DECODE)
    assert (decode.batch, decode.k, decode.count, decode.total_us) == (8, 3, 2, 300.0)
    assert {s.kind for s in r.per_kind} == {ranges.DECODE, ranges.DRAFT, ranges.VERIFY, ranges.PREFILL}
    verify = next(s for s in r.per_kind if s.kind == ranges.VERIFY)  # a stage takes its step's batch and k
    assert (verify.batch, verify.k, verify.count, verify.total_us) == (8, 3, 1, 100.0)


def test_same_thread_name_in_two_processes_are_two_tracks():
    meta = [{"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "MainThread"}}
            for pid in (1, 2)]
    events = meta + [_x(ranges.SEND, 1, 0, 10), {**_x(ranges.BUILD_BATCH, 1, 5, 10), "pid": 2}]
    spans = spans_from_events(events)
    assert len({s.track for s in spans}) == 2 and nesting_errors(spans) == []


def test_kind_arg_overrides_name():
    spans = [Span("step", ranges.DEVICE_TRACK, 0, 10, {"kind": "verify", "batch": 4, "k": 4})]
    (s,) = analyze(spans).per_kind
    assert (s.kind, s.batch, s.k, s.count) == ("verify", 4, 4, 1)


def test_nesting_check_catches_partial_overlap():
    bad = spans_from_events(HAND_MADE + [_x(ranges.SEND, SCHED, 90, 20)])  # [90, 110] straddles [0, 100]
    errors = nesting_errors(bad)
    assert len(errors) == 1 and "send" in errors[0] and "build_batch" in errors[0]
    with pytest.raises(ValueError, match="do not nest"):
        assert_nested(bad)
    # touching ends and identical intervals nest
    ok = [Span("a", "t", 0, 10), Span("b", "t", 10, 20), Span("c", "t", 10, 20), Span("d", "t", 12, 20)]
    assert nesting_errors(ok) == []


def _brute_force(spans: list[Span]) -> tuple[float, float, float]:
    """(prep, hidden, device busy) by sweeping every elementary segment between event boundaries."""
    cuts = sorted({t for s in spans for t in (s.start, s.end)})
    dev = [s for s in spans if s.track == ranges.DEVICE_TRACK]
    prep = [s for s in spans if s.track != ranges.DEVICE_TRACK and s.name in ranges.CPU_PREP]
    tracks = {s.track for s in prep}
    p = h = busy = 0.0
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        on_dev = any(s.start <= mid < s.end for s in dev)
        busy += (b - a) * on_dev
        for t in tracks:
            if any(s.track == t and s.start <= mid < s.end for s in prep):
                p += b - a
                h += (b - a) * on_dev
    return p, h, busy


class VirtualClock:
    """Seconds that move only when a thread advances them: a recorded run's figures follow from the order of its
    events, whatever the machine's load."""

    def __init__(self) -> None:
        self._now = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


BUILD_S, STEP_S = 0.002, 0.004


def test_recorded_run_agrees_with_intervals(tmp_path):
    """Scheduler thread prepares while a worker-thread stream runs steps; the report matches the record.

    Six steps on a virtual clock. An even step is left running: it holds the device (its range open) until the
    scheduler has built the next batch, so that build is hidden behind it. An odd step is waited for, so the build
    after it finds the device idle. Hence, exactly: 6 builds of 2 ms, 3 of them hidden; device steps of 2 + 4 ms
    (even) and 4 ms (odd)."""
    clock = VirtualClock()
    rec = TraceRecorder(clock)
    tr = Tracer(rec)
    stream = ThreadStream(clock=clock)
    on_device = [threading.Event() for _ in range(6)]
    release = [threading.Event() for _ in range(6)]
    handles = []

    def step(i: int):
        def fn():
            with tr.range(ranges.DECODE, track=ranges.DEVICE_TRACK, batch=4, k=i % 2):
                with tr.range(ranges.VERIFY, track=ranges.DEVICE_TRACK):
                    on_device[i].set()
                    assert release[i].wait(timeout=60)
                    clock.advance(STEP_S)
        return fn

    try:
        for i in range(6):
            running = i % 2 == 1  # step i - 1 (even) was left running
            if running:
                assert on_device[i - 1].wait(timeout=60)
            with tr.range(ranges.SCHEDULE):
                with tr.range(ranges.BUILD_BATCH, batch=4):
                    clock.advance(BUILD_S)
            if running:
                release[i - 1].set()
            handles.append(stream.submit("decode", step(i)))
            if i % 2:
                release[i].set()
                with tr.range(ranges.WAIT):
                    handles[-1].wait()
        for h in handles:
            h.wait()
    finally:
        for e in release:
            e.set()
        stream.close()
    path = tmp_path / "run.trace.json"
    rec.save(path)
    spans = load_trace(path)
    assert_nested(spans)
    r = analyze(spans)
    prep, hidden, busy = _brute_force(spans)
    assert r.prep_us == pytest.approx(prep) and r.prep_hidden_us == pytest.approx(hidden)
    assert r.device_busy_us == pytest.approx(busy)
    assert r.prep_us == pytest.approx(6 * BUILD_S * 1e6) and r.prep_hidden_us == pytest.approx(3 * BUILD_S * 1e6)
    assert r.hidden_fraction == pytest.approx(0.5)  # the builds after the steps left running, and only those
    assert r.device_busy_us == pytest.approx((3 * (BUILD_S + STEP_S) + 3 * STEP_S) * 1e6)
    assert r.num_steps == 6 and r.host_syncs == 3
    # The device track's steps are the stream's own intervals (the worker thread records inside them).
    for h, s in zip(handles, sorted((s for s in spans if s.name == ranges.DECODE), key=lambda s: s.start)):
        assert h.device_start * 1e6 <= s.start and s.end <= h.device_end * 1e6
    assert sum(s.count for s in r.per_kind if s.kind == ranges.DECODE) == 6


def test_cli_report_and_check(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"traceEvents": HAND_MADE}))
    assert cli_main(["trace", "report", str(good)]) == 0
    out = capsys.readouterr().out
    assert "hidden behind device work" in out and "50.0%" in out
    assert cli_main(["trace", "report", str(good), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hidden_fraction"] == 0.5
    assert cli_main(["trace", "check", str(good)]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(HAND_MADE + [_x(ranges.SEND, SCHED, 90, 20)]))
    assert cli_main(["trace", "check", str(bad)]) == 1
    assert cli_main(["trace", "report", str(tmp_path / "missing.json")]) == 2


def test_null_tracer_records_nothing_and_ranges_are_reentrant():
    with NULL_TRACER.range(ranges.SCHEDULE, batch=1):
        pass
    rec = TraceRecorder()
    tr = Tracer(rec, nvtx=False)
    with tr.range("outer"):
        with tr.range("inner", x=1):
            pass
        tr.device_interval(ranges.DECODE, 1.0, 1.5, batch=2)
    names = [e["name"] for e in rec.to_json()["traceEvents"] if e["ph"] == "X"]
    assert sorted(names) == ["decode", "inner", "outer"]
    dev = next(e for e in rec.events if e["name"] == ranges.DECODE)
    assert dev["ts"] == 1e6 and dev["dur"] == pytest.approx(0.5e6) and dev["args"] == {"batch": 2}
    spans = spans_from_events(rec.to_json()["traceEvents"])
    assert {s.track for s in spans if s.name == ranges.DECODE} == {ranges.DEVICE_TRACK}
    assert_nested(spans)


def test_offline_generate_trace(tmp_path, capsys):
    """`specstep generate --trace` writes a trace whose ranges nest and whose report matches its intervals."""
    from tests.helpers import make_checkpoint

    target = make_checkpoint(tmp_path / "t", seed=0)
    draft = make_checkpoint(tmp_path / "d", seed=1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_token_ids": [5, 6, 7, i]}) for i in range(4)))
    trace = tmp_path / "run.trace.json"
    assert cli_main(["generate", "--model", str(target), "--spec", "draft_model", "--draft", str(draft),
                     "--prompts", str(prompts), "--max-tokens", "8", "--kv-cache-tokens", "1024", "--device", "cpu",
                     "--trace", str(trace), "--output", str(tmp_path / "out.jsonl")]) == 0
    spans = load_trace(trace)
    assert_nested(spans)
    r = analyze(spans)
    prep, hidden, busy = _brute_force(spans)
    assert r.prep_us == pytest.approx(prep) and r.prep_hidden_us == pytest.approx(hidden)
    assert r.device_busy_us == pytest.approx(busy)
    steps = [s for s in spans if s.track == ranges.DEVICE_TRACK and s.name in ranges.DEVICE_STEPS]
    assert r.num_steps == len(steps) > 1 and r.host_syncs >= 1
    assert {ranges.PREFILL, ranges.DECODE, ranges.VERIFY} <= {s.kind for s in r.per_kind}
    capsys.readouterr()
    assert cli_main(["trace", "report", str(trace)]) == 0 and "hidden behind device work" in capsys.readouterr().out
