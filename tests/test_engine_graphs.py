"""The engine's decode step through the GraphRunner (CPU stand-in, which checks the graph contract on every
capture and early replays): same tokens as the eager engine, greedy and sampled, for every proposer."""

from __future__ import annotations

import pytest

from specstep.engine.sampling_params import SamplingParams
from tests.fixtures_models import make_mtp_head
from tests.helpers import make_checkpoint, make_core, run_to_completion

PROMPTS = [[5, 9, 11, 3, 7], [4, 2], [8] * 11, [17, 4, 9, 21, 5, 6, 7]]


def outputs(model, params, **cfg):
    core = make_core(model, page_size=4, max_batch_size=4, max_model_len=96, spec_policy="fixed", **cfg)
    reqs = run_to_completion(core, PROMPTS, params)
    core.stream.close()
    return [r.output_token_ids for r in reqs], core


@pytest.mark.parametrize("spec", ["none", "draft_model", "mtp", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graph_replay_matches_eager(tiny_target, tiny_draft, tmp_path, spec, temperature):
    draft = {"draft_model": str(tiny_draft), "mtp": str(make_mtp_head(tmp_path / "head", tiny_target))}.get(spec)
    params = SamplingParams(temperature=temperature, max_tokens=20, ignore_eos=True)
    eager, _ = outputs(tiny_target, params, spec=spec, draft=draft, num_spec_tokens=3, graphs="off")
    graph, core = outputs(tiny_target, params, spec=spec, draft=draft, num_spec_tokens=3, graph_standin=True)
    assert graph == eager
    assert core.engine.graphs is not None and core.engine.graphs.buckets == (1, 2, 4)
    assert core.engine.graphs.replays > 0  # decode steps really were replays (not eager behind a graph flag)


def test_batch_above_the_largest_bucket_runs_eagerly(tiny_target):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    core = make_core(tiny_target, page_size=4, max_batch_size=8, max_model_len=96, graph_standin=True)
    core.engine.graphs.buckets = (1, 2)  # pretend the memory budget kept only small buckets
    eager_core = make_core(tiny_target, page_size=4, max_batch_size=8, max_model_len=96, graphs="off")
    assert ([r.output_token_ids for r in run_to_completion(core, PROMPTS, params)]
            == [r.output_token_ids for r in run_to_completion(eager_core, PROMPTS, params)])


@pytest.mark.parametrize("spec", ["draft_model", "mtp"])
def test_graph_lanes_near_max_model_len(tiny_target, tiny_draft, tmp_path, spec):
    """A request one token short of max_model_len drafts nothing, but its graph lane still feeds k + 1 verify
    positions (and the draft model's look-ahead): the captured page-table width must cover them."""
    draft = {"draft_model": str(tiny_draft), "mtp": str(make_mtp_head(tmp_path / "head", tiny_target))}[spec]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [[3] * 29, [5, 9, 11], [4, 2, 8, 8]]
    outs = []
    for graphs in ("off", "on"):
        core = make_core(tiny_target, page_size=4, max_batch_size=4, max_model_len=32, spec_policy="fixed",
                         spec=spec, draft=draft, num_spec_tokens=3, graph_standin=graphs == "on")
        outs.append([r.output_token_ids for r in run_to_completion(core, prompts, params)])
        core.stream.close()
    assert outs[0] == outs[1]
    assert len(outs[0][0]) == 3  # stopped at max_model_len; the others kept speculating alongside it


def test_graph_lanes_past_the_rotary_table(tmp_path):
    """max_model_len = max_position_embeddings (the default): a uniform graph lane near the limit feeds
    positions past the rotary table (results discarded); they must not index past it."""
    target = make_checkpoint(tmp_path / "t", seed=0, max_position_embeddings=32)
    draft = make_checkpoint(tmp_path / "d", seed=1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = []
    for graphs in ("off", "on"):
        core = make_core(target, page_size=4, max_batch_size=4, spec="draft_model", draft=str(draft),
                         num_spec_tokens=3, spec_policy="fixed", graph_standin=graphs == "on")
        outs.append([r.output_token_ids for r in run_to_completion(core, [[3] * 29, [5, 9, 11], [4, 2, 8]], params)])
        core.stream.close()
    assert outs[0] == outs[1] and len(outs[0][0]) == 3


def test_a_draft_with_a_shorter_context_stops_drafting_past_it(tmp_path):
    """Target 64 positions, draft 32: requests past the draft's context decode without it, same tokens."""
    target = make_checkpoint(tmp_path / "t", seed=0, max_position_embeddings=64)
    draft = make_checkpoint(tmp_path / "d", seed=1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = make_core(target, page_size=4, graphs="off")
    spec = make_core(target, page_size=4, spec="draft_model", draft=str(draft), num_spec_tokens=3,
                     spec_policy="fixed", graphs="off")
    assert spec.config.max_model_len == 64 and spec.config.spec_max_len == 32
    decisions, decide = [], spec.scheduler.decide

    def recording(reqs, pending=None, lag=None):
        d = decide(reqs, pending, lag)
        decisions.extend(zip([len(r.token_ids) for r in reqs], d.num_draft.tolist()))
        return d
    spec.scheduler.decide = recording
    prompts = [[3] * 24, [5, 9, 11]]
    reqs = run_to_completion(spec, prompts, params)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in run_to_completion(plain, prompts, params)]
    assert any(n > 0 for _, n in decisions)  # it drafted while requests fitted the draft's context ...
    assert any(length >= 32 for length, _ in decisions)
    assert all(n == 0 for length, n in decisions if length + n + 1 > 32)  # ... and never past it


@pytest.mark.parametrize("policy", ["adaptive", "fixed"])
def test_graphs_are_captured_only_where_they_replay(tiny_target, tmp_path, policy):
    """The adaptive policy drops the refill only when nobody drafts, so a _norefill graph replays only with one
    token a lane, and a refill graph never at q = 1 (a step whose drafts were cut for want of pages rounds up
    to q = 2). The fixed policy never drops the refill: no _norefill graphs at all."""
    core = make_core(tiny_target, spec="mtp", draft=str(make_mtp_head(tmp_path / "head", tiny_target)),
                     num_spec_tokens=4, graph_standin=True, max_batch_size=4, spec_policy=policy)
    graphs, adaptive = core.engine.graphs, policy == "adaptive"
    norefill = [graphs.has_graph(f, q, b) for f in ("greedy_norefill", "general_norefill") for b in (1, 2, 4)
                for q in (1, 2, 3, 5)]
    assert norefill == [adaptive and q == 1 for _ in range(2) for _ in range(3) for q in (1, 2, 3, 5)]
    assert all(graphs.has_graph("greedy", q, 1) for q in (2, 3, 5))
    assert graphs.has_graph("greedy", 1, 1) == (not adaptive)
    core.stream.close()


@pytest.mark.parametrize(("params", "flavour", "sorts"), [
    (SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True), "sampled", False),
    (SamplingParams(temperature=1.0, top_k=20, max_tokens=8, ignore_eos=True), "general", True),
])
def test_temperature_only_graphs_do_not_sort_the_vocabulary(tiny_target, tmp_path, params, flavour, sorts):
    """Only rows that ask for top-k / top-p need the full-vocabulary sort; a batch without them replays the
    `sampled` flavour, which has none."""
    import torch

    core = make_core(tiny_target, spec="mtp", draft=str(make_mtp_head(tmp_path / "head", tiny_target)),
                     num_spec_tokens=2, graph_standin=True, max_batch_size=4, overlap=False)
    from specstep.scheduler.core.request import Request

    for i in range(2):
        core.add_request(Request(str(i), [3, 1, 4, 1, 5], params, seed=i))
    core.step()  # prefill
    runs = []
    run = core.engine.graphs.run
    core.engine.graphs.run = lambda name, *a, **kw: (runs.append(name), run(name, *a, **kw))[1]
    with torch.profiler.profile() as prof:
        core.step()
    assert runs and runs[0] == flavour
    assert any(e.key == "aten::sort" for e in prof.key_averages()) == sorts


def test_a_graph_step_uploads_only_the_page_table_of_its_layout(tiny_target, monkeypatch):
    """The captured step derives its layouts on device from the page table: the host uploads nothing else of
    the layout (before: all six layout arrays, five of them unused)."""
    import numpy as np

    from specstep.engine.step_context import GraphTable
    from specstep.scheduler.core.request import Request

    core = make_core(tiny_target, graph_standin=True, max_batch_size=4, overlap=False)
    for i in range(2):
        core.add_request(Request(str(i), [3, 1, 4, 1, 5], SamplingParams(temperature=0.0, max_tokens=4), seed=i))
    core.step()  # prefill
    uploads = []
    upload = core.engine.staging.upload
    monkeypatch.setattr(core.engine.staging, "upload", lambda arrays: (uploads.append(len(arrays)), upload(arrays))[1])
    ctx = core.engine.plan_decode(core.running, np.zeros(2, np.int64))
    assert ctx.graph and isinstance(ctx.inputs.layout, GraphTable) and ctx.inputs.layout.page_table.shape[0] == 2
    # One upload: start, slots, num_draft, the token grid, five sampling rows, the page table.
    assert uploads == [10], uploads
    out = core.engine.run_decode(ctx)
    assert out.out_tokens.shape == (2, 1)


def test_graph_stand_in_takes_prepacked_onednn_weights(tiny_target):
    """oneDNN-prepacked weights have no storage pointer: the CPU stand-in's contract checks must still run
    (they failed on the pretrained default under the stand-in)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[3, 1, 4, 1, 5], [2, 7]]
    out = [r.output_token_ids for r in run_to_completion(
        make_core(tiny_target, graph_standin=True, cpu_linear="onednn", max_batch_size=2), prompts, params)]
    ref = [r.output_token_ids for r in run_to_completion(
        make_core(tiny_target, graphs="off", cpu_linear="onednn", max_batch_size=2), prompts, params)]
    assert out == ref
