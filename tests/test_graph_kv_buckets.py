"""Graph steps' attention work follows the batch's KV lengths, not max_model_len (torch attention backend).

A captured graph has a fixed page-table width, and the torch backend gathers every key of that width for every
lane: with one width of max_model_len, short requests on a long-context model paid for the whole context at
every step. Graphs are captured at a few widths and a step replays the narrowest that holds its lanes.
"""

from __future__ import annotations

import pytest

from specstep.cuda_graphs.buckets import kv_page_buckets, width_for
from specstep.engine.attention import torch_backend
from specstep.engine.sampling_params import SamplingParams
from tests.fixtures_models import make_mtp_head
from tests.helpers import make_checkpoint, make_core, run_to_completion

PROMPTS = [[5, 9, 11, 3, 7], [4, 2], [8] * 11]


def test_kv_page_buckets():
    assert kv_page_buckets(33, 16) == (33,)  # max_model_len 512: one width
    assert kv_page_buckets(2049, 16) == (32, 128, 512, 2049)
    assert kv_page_buckets(40, 16) == (40,)  # 32 is within 1.5x of 40: not worth a graph set of its own
    assert width_for((32, 128, 2049), 33) == 128 and width_for((32, 128), 129) is None


@pytest.fixture
def gathered_keys(monkeypatch):
    """Keys each paged-attention call gathers per lane (the width of the page table it attends over)."""
    seen: list[int] = []
    real = torch_backend.paged_attention

    def recording(q, k_cache, v_cache, meta, num_heads, scale, *rest):
        seen.append(meta.keys)
        return real(q, k_cache, v_cache, meta, num_heads, scale, *rest)
    monkeypatch.setattr(torch_backend, "paged_attention", recording)
    return seen


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_graph_key_count_does_not_follow_max_model_len(tmp_path, gathered_keys, spec):
    """Same short prompts, max_model_len 512 and 32768: the graph steps gather within 1.25x as many keys."""
    target = make_checkpoint(tmp_path / "t", seed=0, max_position_embeddings=32768)
    draft = str(make_mtp_head(tmp_path / "head", target)) if spec == "mtp" else None
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    keys, outs = {}, {}
    for max_len in (512, 32768):
        core = make_core(target, page_size=16, max_batch_size=4, max_model_len=max_len, graph_standin=True, spec=spec,
                         draft=draft, num_spec_tokens=3, spec_policy="fixed")
        gathered_keys[:] = []  # capture is done: count the requests' steps only
        outs[max_len] = [r.output_token_ids for r in run_to_completion(core, PROMPTS, params)]
        keys[max_len] = sum(gathered_keys)
        assert core.engine.graphs.replays > 0
        core.stream.close()
    assert outs[512] == outs[32768]
    assert keys[32768] <= 1.25 * keys[512], keys


@pytest.mark.parametrize("spec", ["draft_model", "mtp"])
def test_replays_across_widths_match_eager(tiny_target, tiny_draft, tmp_path, monkeypatch, spec):
    """Requests growing through three captured widths (24, 40 tokens and max_model_len, page size 4) give the
    tokens of the eager engine, and steps replayed graphs of more than one width."""
    from specstep.engine import step_engine

    monkeypatch.setattr(step_engine, "kv_page_buckets", lambda max_pages, ps: (6, 10, max_pages))
    draft = {"draft_model": str(tiny_draft), "mtp": str(make_mtp_head(tmp_path / "head", tiny_target))}[spec]
    params = SamplingParams(temperature=0.0, max_tokens=44, ignore_eos=True)
    prompts = [[3, 1, 4], [5, 9], [2, 6, 5, 3, 5]]  # 1-2 pages at first, 12-13 at the end
    outs, kinds = [], []
    for graphs in ("off", "on"):
        core = make_core(tiny_target, page_size=4, max_batch_size=4, max_model_len=96, spec=spec, draft=draft,
                         num_spec_tokens=3, spec_policy="fixed", graph_standin=graphs == "on")
        if graphs == "on":
            run = core.engine.graphs.run
            core.engine.graphs.run = lambda name, *a, run=run, **kw: (kinds.append(name), run(name, *a, **kw))[1]
        outs.append([r.output_token_ids for r in run_to_completion(core, prompts, params)])
        core.stream.close()
    assert outs[0] == outs[1]
    assert {"greedy.kv6", "greedy.kv10", "greedy"} <= set(kinds), set(kinds)


def test_a_lane_drafting_less_than_k_has_padding_for_its_uniform_writes(tmp_path, monkeypatch):
    """Past the draft's 32-position context a request drafts nothing and reserves pages for one token, yet its
    graph lane writes k + 1 verify positions and the draft's look-ahead: the chosen width must leave padding
    pages for them, whichever width its own pages end at (here: a width at every page it passes)."""
    from specstep.engine import step_engine

    monkeypatch.setattr(step_engine, "kv_page_buckets", lambda max_pages, ps: (8, 9, 10, max_pages))
    target = make_checkpoint(tmp_path / "t", seed=0, max_position_embeddings=64)
    draft = make_checkpoint(tmp_path / "d", seed=1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [[3] * 26, [5, 9, 11]]
    outs = []
    for graphs in ("off", "on"):
        core = make_core(target, page_size=4, max_batch_size=2, spec="draft_model", draft=str(draft),
                         num_spec_tokens=3, spec_policy="fixed", graph_standin=graphs == "on", overlap=False)
        outs.append([r.output_token_ids for r in run_to_completion(core, prompts, params)])
        core.stream.close()
    assert outs[0] == outs[1]
