"""Whole engines with `--attention flashinfer` on the CPU, over tests/fake_flashinfer.py: every forward is
planned with the right slot, lengths and lanes (prefill, verify, draft loop, refill, catch-up; eager and graph
replays; chained steps that plan only once the previous step's lengths are known), so the tokens equal the
torch backend's. The real kernels are checked by tests/test_gpu.py."""

from __future__ import annotations

import pytest

from specstep.engine.sampling_params import SamplingParams
from tests import fake_flashinfer
from tests.fixtures_models import make_mtp_head
from tests.helpers import make_core, run_to_completion

PROMPTS = [[5, 9, 11, 3, 7], [4, 2], [8] * 11, [17, 4, 9, 21, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6]]


def generate(model, params, **cfg):
    core = make_core(model, page_size=4, max_batch_size=4, max_model_len=96, spec_policy="fixed", **cfg)
    reqs = run_to_completion(core, PROMPTS, params)
    core.stream.close()
    return [r.output_token_ids for r in reqs], core


@pytest.mark.parametrize("graphs", ["off", "on"])
@pytest.mark.parametrize("spec", ["none", "draft_model", "mtp", "ngram"])
def test_flashinfer_engine_matches_torch(monkeypatch, tiny_target, tiny_draft, tmp_path, spec, graphs):
    fake_flashinfer.install(monkeypatch)
    draft = {"draft_model": str(tiny_draft), "mtp": str(make_mtp_head(tmp_path / "head", tiny_target))}.get(spec)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cfg = dict(spec=spec, draft=draft, num_spec_tokens=3, graph_standin=graphs == "on")
    ref, _ = generate(tiny_target, params, attention="torch", **cfg)
    out, core = generate(tiny_target, params, attention="flashinfer", **cfg)
    assert out == ref
    eng = core.engine
    assert eng.plans_attention and core.overlap  # chained steps ran (they plan after the wait)
    wrappers = eng.target.attention._wrappers
    if graphs == "on":  # verify ran as graph replays, each planned into the wrapper its graph captured
        graph_plans = [w.plans for key, w in wrappers.items() if key[0] == "verify" and key[1] is not None]
        assert graph_plans and max(graph_plans) > 2
    if eng.has_draft_model:
        assert {"prefill", "refill", "draft.1", "draft.2"} <= set(eng.proposer.attention._planned)
    # One int workspace per slot however many wrappers (the fake's kernels check that none was overwritten).
    for att in [eng.target.attention] + ([eng.proposer.attention] if eng.has_draft_model else []):
        int_ws = {w._int_workspace_buffer.untyped_storage().data_ptr() for w in att._wrappers.values()}
        assert len(int_ws) == len(att._slots) <= len(att._wrappers)


@pytest.mark.parametrize("spec", ["draft_model", "mtp"])
def test_flashinfer_chunked_prefill_matches_torch(monkeypatch, tiny_target, tiny_draft, tmp_path, spec):
    """Mixed steps (decode rows beside prompt chunks, a budget of 6 tokens) planned as one ragged prefill for
    the target and for the proposer's chunk, graphs on for the decode-only steps."""
    fake_flashinfer.install(monkeypatch)
    draft = {"draft_model": str(tiny_draft), "mtp": str(make_mtp_head(tmp_path / "head", tiny_target))}[spec]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cfg = dict(spec=spec, draft=draft, num_spec_tokens=3, graph_standin=True)
    ref, _ = generate(tiny_target, params, attention="torch", **cfg)
    out, core = generate(tiny_target, params, attention="flashinfer", max_num_batched_tokens=6, **cfg)
    assert out == ref
    assert "prefill" in core.engine.proposer.attention._planned


def test_flashinfer_engine_sampled_matches_torch(monkeypatch, tiny_target, tiny_draft):
    fake_flashinfer.install(monkeypatch)
    params = SamplingParams(temperature=1.0, top_k=40, max_tokens=20, ignore_eos=True)
    cfg = dict(spec="draft_model", draft=str(tiny_draft), num_spec_tokens=2)
    assert generate(tiny_target, params, attention="flashinfer", **cfg)[0] == \
        generate(tiny_target, params, attention="torch", **cfg)[0]


def test_flashinfer_engine_catch_up_after_dropped_refill(monkeypatch, tiny_target, tiny_draft):
    """Adaptive policy with a draft model: the refill can be dropped and the draft later catches up on host
    tokens (its own "catch_up" plan)."""
    fake_flashinfer.install(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cfg = dict(spec="draft_model", draft=str(tiny_draft), num_spec_tokens=3)
    ref, _ = generate(tiny_target, params, attention="torch", **cfg)
    core = make_core(tiny_target, page_size=4, max_batch_size=4, max_model_len=96, spec_policy="adaptive",
                     attention="flashinfer", **cfg)
    reqs = run_to_completion(core, PROMPTS, params)
    core.stream.close()
    assert [r.output_token_ids for r in reqs] == ref
    assert "catch_up" in core.engine.proposer.attention._planned


def test_flashinfer_chained_steps_show_their_extra_sync_in_the_trace(monkeypatch, tiny_target, tiny_draft):
    """With a planning backend a chained step waits for the previous step's lengths before it plans: the trace
    shows it as a second host sync per decode step (and the report counts it), ranges still nest."""
    from specstep.traces import ranges
    from specstep.traces.report import analyze, spans_from_events
    from specstep.traces.tracer import Tracer, TraceRecorder

    fake_flashinfer.install(monkeypatch)
    from specstep.engine.engine_config import EngineConfig
    from specstep.scheduler.build import build_engine

    recorder = TraceRecorder()
    core, _, _ = build_engine(EngineConfig(model=str(tiny_target), spec="draft_model", draft=str(tiny_draft),
                                           num_spec_tokens=3, spec_policy="fixed", device="cpu",
                                           kv_cache_tokens=4096, attention="flashinfer"), Tracer(recorder))
    run_to_completion(core, PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    core.stream.close()
    spans = spans_from_events(recorder.to_json()["traceEvents"])
    chained_waits = [s for s in spans if s.name == ranges.WAIT and s.args.get("chained")]
    plans = [s for s in spans if s.name == ranges.PLAN]
    report = analyze(spans)
    assert chained_waits and len(plans) >= report.num_steps - 3  # every decode step planned (prefills: ragged)
    # (Which step a wait is attributed to goes by time, so per-step maxima vary with scheduling; totals do not.)
    assert report.host_syncs == len([s for s in spans if s.name == ranges.WAIT])
    assert 1.0 < report.syncs_per_step <= 2.0
