"""A CUDA launch returns before the device reads the job's inputs: `CudaStream` must keep every tensor the job
closes over alive until `wait()` says the job is complete (else the caching allocator reuses their blocks for
the next step's inputs while this one still reads them). Checked on CPU by running `CudaStream`'s own code
over stand-ins for torch.cuda's Stream and Event, with weak references to the inputs."""

from __future__ import annotations

import contextlib
import gc
import weakref

import torch

from specstep.engine import stream as stream_mod


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.recorded = False

    def record(self, stream=None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.recorded

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


class FakeStream:
    def __init__(self, device=None) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


class FakeCuda:
    Stream, Event = FakeStream, FakeEvent

    @staticmethod
    def current_stream():
        return FakeStream()

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()


def test_cuda_stream_keeps_a_jobs_inputs_until_wait(monkeypatch):
    monkeypatch.setattr(stream_mod.torch, "cuda", FakeCuda)
    s = stream_mod.CudaStream(torch.device("cpu"))

    def launch():
        inputs = torch.arange(8)  # what a step builds on the host side: only the job's closure holds it
        ref = weakref.ref(inputs)
        return s.submit("decode", lambda: inputs * 2), ref
    handle, ref = launch()
    gc.collect()
    assert ref() is not None, "the job's inputs were released before the job was known complete"
    assert handle.wait().tolist() == list(range(0, 16, 2))
    gc.collect()
    assert ref() is None, "a completed job's inputs are still held"


def test_cpu_streams_release_inputs_after_wait():
    for s in (stream_mod.InlineStream(), stream_mod.ThreadStream()):
        inputs = torch.arange(4)
        ref = weakref.ref(inputs)
        handle = s.submit("decode", lambda x=inputs: x + 1)
        del inputs
        handle.wait()
        gc.collect()
        assert ref() is None
        s.close()
