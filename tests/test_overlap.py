"""The overlap is real: with the CPU worker-thread stream, batch preparation for step N+1 runs while step N's
device work runs. Asserted on recorded intervals, never on wall-clock speed."""

from __future__ import annotations

import pytest

from specstep.engine.sampling_params import SamplingParams
from specstep.traces import ranges
from specstep.traces.report import analyze, spans_from_events
from specstep.traces.tracer import Tracer, TraceRecorder
from tests.helpers import make_checkpoint, run_to_completion


def traced_run(model, draft, overlap: bool, spec: str = "draft_model"):
    recorder = TraceRecorder()
    from specstep.engine.engine_config import EngineConfig
    from specstep.scheduler.build import build_engine

    core, _, _ = build_engine(EngineConfig(model=str(model), spec=spec, draft=str(draft), num_spec_tokens=3,
                                           spec_policy="fixed", overlap=overlap, device="cpu",
                                           kv_cache_tokens=4096), Tracer(recorder))
    prompts = [[5 + i, 7, 9, 11 + i] * (2 + i) for i in range(4)]
    reqs = run_to_completion(core, prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    core.stream.close()
    return recorder, reqs


def overlapping_builds(spans) -> int:
    """BUILD_BATCH ranges on the scheduler thread that run at the same time as a device DECODE range."""
    device = [s for s in spans if s.track == ranges.DEVICE_TRACK and s.name == ranges.DECODE]
    builds = [s for s in spans if s.track != ranges.DEVICE_TRACK and s.name == ranges.BUILD_BATCH]
    return sum(any(d.start < b.end and b.start < d.end for d in device) for b in builds)


@pytest.fixture(scope="module")
def heavier_target(tmp_path_factory):
    """Device steps long enough (milliseconds of real matmul) that the GIL, not the design, is not what decides
    whether the scheduler thread's work overlaps them."""
    return make_checkpoint(tmp_path_factory.mktemp("heavier"), seed=3, hidden_size=256, intermediate_size=768,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=2048)


def test_batch_preparation_runs_under_device_work(heavier_target, tiny_draft):
    recorder, reqs = traced_run(heavier_target, heavier_target, overlap=True)
    spans = spans_from_events(recorder.to_json()["traceEvents"])
    builds = sum(s.name == ranges.BUILD_BATCH for s in spans)
    # Most builds overlap device work (not all: a loaded machine may run the worker thread late).
    assert overlapping_builds(spans) >= builds // 2, "steps were not built while the previous one ran"
    report = analyze(spans)
    assert report.prep_hidden_us > 0 and report.hidden_fraction > 0.3
    assert report.num_steps > 5


def test_no_overlap_hides_nothing_and_gives_the_same_tokens(tiny_target, tiny_draft):
    rec_on, on = traced_run(tiny_target, tiny_draft, overlap=True)
    rec_off, off = traced_run(tiny_target, tiny_draft, overlap=False)
    assert [r.output_token_ids for r in on] == [r.output_token_ids for r in off]
    spans = spans_from_events(rec_off.to_json()["traceEvents"])
    assert overlapping_builds(spans) == 0
    assert analyze(spans).prep_hidden_us == 0.0


def test_one_host_sync_per_decode_step(tiny_target, tiny_draft):
    recorder, _ = traced_run(tiny_target, tiny_draft, overlap=True)
    spans = spans_from_events(recorder.to_json()["traceEvents"])
    waits = [s for s in spans if s.name == ranges.WAIT]
    steps = [s for s in spans if s.track == ranges.DEVICE_TRACK and s.name in (ranges.DECODE, ranges.PREFILL)]
    assert len(waits) == len(steps)
