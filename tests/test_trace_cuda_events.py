"""On CUDA a device-track range is timed by CUDA events on the stream it launches into (the launching thread's
clock would call launch time device time); its host interval goes to the thread's own track as NAME.launch.
Checked with a stand-in for torch.cuda whose device clock the test moves."""

from __future__ import annotations

from specstep.traces.ranges import DEVICE_TRACK
from specstep.traces.tracer import Tracer, TraceRecorder


class FakeCuda:
    def __init__(self) -> None:
        self.device_ms = 0.0  # the device's clock
        self.capturing = False
        cuda = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.t = None

            def record(self) -> None:
                self.t = cuda.device_ms

            def synchronize(self) -> None:
                assert self.t is not None

            def elapsed_time(self, other) -> float:
                return other.t - self.t
        self.Event = Event

    def synchronize(self) -> None:
        pass

    def is_current_stream_capturing(self) -> bool:
        return self.capturing


def spans(rec: TraceRecorder, tid_name: str | None = None):
    names = {ev["tid"]: ev["args"]["name"] for ev in rec.to_json()["traceEvents"] if ev["ph"] == "M"}
    return [(names.get(ev["tid"]), ev["name"], ev["dur"]) for ev in rec.events if ev["ph"] == "X"]


def test_device_ranges_come_from_cuda_events_and_launches_from_the_host():
    rec, cuda = TraceRecorder(), FakeCuda()
    tr = Tracer(rec, nvtx=False)
    tr.use_cuda_events(cuda)
    with tr.range("decode", track=DEVICE_TRACK, batch=4):
        cuda.device_ms += 25.0  # the step's kernels take 25 ms on the device; the launch returns at once
    cuda.capturing = True
    with tr.range("verify", track=DEVICE_TRACK):  # inside a graph capture: no events
        pass
    got = spans(rec)
    device = [(n, d) for track, n, d in got if track == DEVICE_TRACK]
    assert device == [("decode", 25_000.0)]
    launches = {n for track, n, _ in got if track != DEVICE_TRACK}
    assert launches == {"decode.launch", "verify.launch"}
    assert all(d < 25_000.0 for track, n, d in got if n == "decode.launch")


def test_cpu_device_ranges_stay_host_timed():
    rec = TraceRecorder()
    tr = Tracer(rec, nvtx=False)
    with tr.range("decode", track=DEVICE_TRACK):
        pass
    assert [(t, n) for t, n, _ in spans(rec)] == [(DEVICE_TRACK, "decode")]
