"""The host side of a decode step (`StepEngine.decode_context`): its input grid, layouts and sampling rows,
built on the scheduler thread (overlapping the previous step's device work when chained) and sent to the device
in one staged upload (one pinned copy per dtype on CUDA), not inside the device job.

    eager step   ragged layouts for verify (q = num_draft + 1) and for the draft loop (q = 1), from the host
    graph replay fixed shapes (q = k + 1 for every lane, the page table at the captured width): the step
                 function derives its layouts on device from the page table alone, so that is all it uploads
"""

from __future__ import annotations

import numpy as np

from specstep.engine.batch_builder import Upload, layout_arrays, layout_from, page_table_array
from specstep.engine.sampling_params import SamplingTensors
from specstep.engine.step_context import Chain, DecodeInputs, DecodePlan, GraphTable, SeqState, StepLayouts


def build_decode_plan(seqs: list[SeqState], num_draft: np.ndarray, host_drafts: list[list[int]] | None,
                      chain: Chain | None, refill: bool, k: int, graph_kind: str | None, width: int | None, *,
                      upload: Upload, page_size: int, vocab_size: int, host_tables: bool) -> DecodePlan:
    """A decode step of `k` drafts per lane in its layout (`num_draft[i]` <= k of request i; `host_drafts`: the
    drafts the host knows now, n-gram), eager or replaying `graph_kind` at page-table width `width`
    (`step_graphs.graph_for`); `host_tables`: the plan keeps a host copy of the page tables (attention backends
    that plan, FlashInfer)."""
    b = len(seqs)
    base = np.array([s.num_computed for s in seqs], dtype=np.int64)
    tables = [s.page_table for s in seqs]
    params = [s.params for s in seqs]
    graph = graph_kind is not None
    grid = np.zeros((b, k + 1), dtype=np.int64)
    grid[:, 0] = [s.token_ids[-1] for s in seqs]
    if host_drafts is not None and k > 0:
        for i, d in enumerate(host_drafts):
            grid[i, 1: 1 + num_draft[i]] = d[: num_draft[i]]
    # Named groups of arrays, uploaded together.
    host = {"inputs": [base, np.array([s.slot for s in seqs], dtype=np.int64), num_draft.astype(np.int64), grid],
            "sampling": SamplingTensors.host_arrays(params, [s.seed for s in seqs], vocab_size)}
    if graph:
        host["graph_table"] = [page_table_array(tables, width)]
    else:
        host["verify"], dense_v = layout_arrays(num_draft + 1, tables, page_size)
        if k > 0:  # without drafts the verify layout is the one-token layout: built and sent once
            host["single"], dense_s = layout_arrays(np.ones(b, np.int64), tables, page_size)
    if chain is not None:
        host["chain"] = [chain.src, chain.dst]
    flat = upload([a for group in host.values() for a in group])
    dev, i = {}, 0
    for name, group in host.items():
        dev[name], i = flat[i: i + len(group)], i + len(group)
    start, slots, num_draft_dev, grid_dev = dev["inputs"]
    chain_src, chain_dst = dev["chain"] if chain is not None else (None, None)
    if graph:
        layout = GraphTable(dev["graph_table"][0])
    else:
        verify = layout_from(dev["verify"], page_size, dense_v)
        layout = StepLayouts(verify=verify, single=layout_from(dev["single"], page_size, dense_s) if k > 0 else verify)
    inputs = DecodeInputs(
        k=k, start=start, st=SamplingTensors.from_tensors(dev["sampling"], params, vocab_size), slots=slots,
        num_draft=num_draft_dev, grid=grid_dev, layout=layout, refill=refill, uniform=graph,
        chain_src=chain_src, chain_dst=chain_dst)
    pt = page_table_array(tables, max(len(t) for t in tables)) if host_tables else None
    return DecodePlan(seqs=seqs, num_draft=num_draft, base_pos=base, input_grid=grid, inputs=inputs, chain=chain,
                      page_tables=pt, graph_kind=graph_kind)
