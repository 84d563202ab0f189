"""Start-up captures the graphs decode steps replay: every decode step that fits a captured bucket replays one
(the CPU stand-in checks each against the graph contract) and gives the eager engine's tokens, including steps
whose drafts were cut below a captured k, which replay the next captured k up. The ready line says how many
graphs start-up captured and how long that took."""

from __future__ import annotations

import numpy as np
import pytest

from specstep.engine.engine_config import EngineConfig
from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler.build import build_engine
from specstep.scheduler.core.request import Request
from tests import fake_flashinfer
from tests.fixtures_models import make_mtp_head
from tests.helpers import make_core, run_to_completion

PROMPTS = [[5, 9, 11, 3, 7], [4, 2], [8] * 11, [17, 4, 9, 21, 5, 6, 7]]
# Requests end at different steps (a step drafts at most the room its requests have left: k below k_max), and
# the batch's flavour moves from general (top-k) through sampled (temperature) to greedy as they finish.
PARAMS = [SamplingParams(temperature=1.0, top_k=20, max_tokens=7, ignore_eos=True),
          SamplingParams(temperature=0.8, max_tokens=13, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)]


def run(model, **cfg):
    """Outputs, and (batch, replayed a graph?, the step's k, most drafts a lane made) per decode step."""
    core = make_core(model, page_size=4, max_batch_size=4, max_model_len=96, num_spec_tokens=4, **cfg)
    steps = []
    run_decode = core.engine.run_decode

    def recording(ctx):
        steps.append((ctx.batch_size, ctx.graph, ctx.k, int(ctx.num_draft.max(initial=0))))
        return run_decode(ctx)
    core.engine.run_decode = recording
    outs = [r.output_token_ids for r in run_to_completion(core, PROMPTS, PARAMS)]
    core.stream.close()
    return outs, steps, core


@pytest.mark.parametrize(("spec", "policy", "attention"), [
    ("mtp", "fixed", "torch"), ("mtp", "adaptive", "torch"), ("ngram", "fixed", "torch"),
    ("draft_model", "fixed", "flashinfer"),  # planned at the graph's k (tests/fake_flashinfer.py)
])
def test_every_decode_step_replays_a_captured_graph(tiny_target, tiny_draft, tmp_path, monkeypatch, spec, policy,
                                                    attention):
    draft = {"draft_model": str(tiny_draft), "mtp": str(make_mtp_head(tmp_path / "head", tiny_target))}.get(spec)
    eager, _, _ = run(tiny_target, spec=spec, draft=draft, spec_policy=policy, graphs="off")
    if attention == "flashinfer":
        fake_flashinfer.install(monkeypatch)
    outs, steps, core = run(tiny_target, spec=spec, draft=draft, spec_policy=policy, graph_standin=True,
                            attention=attention)
    if policy == "adaptive":
        # The adaptive policy prices each k by the steps' measured (wall-clock) costs, so the two runs may draft
        # differently; a sampled request's draws then differ (the same distribution, other samples). Greedy
        # requests' tokens are the target's whatever was drafted.
        greedy = [i for i, p in enumerate(PARAMS) if p.temperature == 0.0]
        outs, eager = [outs[i] for i in greedy], [eager[i] for i in greedy]
    assert outs == eager
    assert steps and all(graph for _, graph, _, _ in steps), [s for s in steps if not s[1]]
    assert core.engine.graphs.replays == len(steps)
    if policy == "fixed":  # k_max = 4, captured k = 0, 1, 2, 4: a step of 3 drafts replays k = 4
        assert any(k == 4 and drafted == 3 for _, _, k, drafted in steps), steps


def test_a_refill_step_without_drafts_replays_the_smallest_k(tiny_target, tmp_path):
    """The adaptive policy refills only where someone drafts, so no refill graph is captured at q = 1; a step
    whose drafts were all cut for want of pages still refills, and replays q = 2 with nobody drafting."""
    head = str(make_mtp_head(tmp_path / "head", tiny_target))
    tokens = []
    for graphs in ("off", "on"):
        core = make_core(tiny_target, spec="mtp", draft=head, spec_policy="adaptive", num_spec_tokens=4,
                         max_batch_size=4, graph_standin=graphs == "on", overlap=False)
        for i, p in enumerate(PROMPTS[:3]):
            core.add_request(Request(str(i), list(p), SamplingParams(temperature=0.0, max_tokens=8), seed=i))
        core.step()  # prefill
        nobody = np.zeros(3, np.int64)
        assert core.scheduler.reserve_pages(core.running, nobody)
        ctx = core.engine.plan_decode(core.running, nobody, refill=True)
        assert (ctx.graph, ctx.k, ctx.graph_kind) == ((True, 1, "greedy") if graphs == "on" else (False, 0, None))
        accepted, rows = core.engine.run_decode(ctx).read()
        tokens.append([row[: a + 1] for row, a in zip(rows, accepted)])
        core.stream.close()
    assert tokens[0] == tokens[1]


def test_ready_line_states_graph_count_and_capture_seconds(tiny_target):
    from specstep.scheduler.generate_cmd import ready_text
    from specstep.scheduler.server.scheduler_process import ready_message

    core, _, info = build_engine(EngineConfig(model=str(tiny_target), device="cpu", graph_standin=True,
                                              max_batch_size=2, max_model_len=64, kv_cache_tokens=1024))
    # spec none: greedy, sampled, general at q = 1, buckets 1 and 2, one page-table width
    line = ready_text(info)
    assert "; 6 graphs captured in " in line and " s (cpu-standin)" in line, line
    ready = ready_message(core, info, None)
    assert ready.graphs.startswith("6 graphs captured in ") and info.graphs["seconds"] > 0
    off_core, _, off = build_engine(EngineConfig(model=str(tiny_target), device="cpu", graphs="off",
                                                 kv_cache_tokens=1024))
    assert ready_message(off_core, off, None).graphs == ""


@pytest.mark.parametrize(("spec", "policy"), [("none", "fixed"), ("mtp", "fixed"), ("mtp", "adaptive")])
def test_the_memory_plan_counts_the_graphs_capture_makes(tiny_target, tmp_path, spec, policy):
    """The CUDA memory plan reserves a graph pool per graph (`memory_probe.graph_count_estimate`) before any is
    captured: it must count what capture then makes (counted high, it took KV cache from every CUDA start-up;
    low, capture runs out of memory)."""
    from specstep.engine.memory_probe import graph_count_estimate

    extra = {"draft": str(make_mtp_head(tmp_path / "head", tiny_target))} if spec == "mtp" else {}
    core = make_core(tiny_target, spec=spec, spec_policy=policy, graph_standin=True, page_size=4, max_batch_size=4,
                     max_model_len=96, num_spec_tokens=3 if spec != "none" else 0, **extra)
    eng = core.engine
    estimate = graph_count_estimate(4, eng.graph_ks, eng.has_draft_model, len(eng.graph_widths))
    assert estimate == len(eng.graphs._graphs) > 0
    core.stream.close()
