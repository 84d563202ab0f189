"""The decode step as a captured graph: registration with the GraphRunner and the graph-safe step function.

One graph per (flavour, batch bucket, q = k + 1) runs the whole speculative step (draft loop, verify,
rejection sampling, refill) from static buffers, so a step is one replay and its only host sync stays the
read of the accepted lengths. Host-known flags that change the work are in the flavour name:

    greedy            every request greedy (argmax only)
    sampled           greedy and temperature rows, nobody asks for top-k / top-p (no vocabulary sort)
    general           any mix of greedy / temperature / top-k / top-p rows (computes every path)
    ..._norefill      the draft's KV refill dropped by the policy

Graphs need a fixed shape, so every lane feeds q = k + 1 verify tokens (num_draft masks the unused tail:
those KV writes land in look-ahead slots the request reserved, or on the dummy page, and the next step
overwrites them) and the page table has a fixed width. With the torch attention backend, which gathers every
key of that width, each flavour is captured at a few widths (`cuda_graphs.buckets.kv_page_buckets`: 512
tokens x 4^i up to max_model_len) and a step replays the narrowest that holds its lanes, so its attention work
follows the batch's lengths, not max_model_len; the widest keeps the flavour's plain name, a narrower one is
`{flavour}.kv{pages}`. Padding lanes point at the dummy page and at a scratch row of the proposer's carried
state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from specstep.cuda_graphs.contract import BufferSpec, GraphKey, StepKind
from specstep.cuda_graphs.steps import uniform_layout
from specstep.engine.kv_cache import DUMMY_PAGE
from specstep.engine.sampling_params import SamplingFlags, SamplingTensors
from specstep.engine.step_context import DecodeContext

if TYPE_CHECKING:
    from specstep.cuda_graphs.runner import GraphRunner
    from specstep.engine.step_engine import StepEngine

SAMPLING = ("greedy", "sampled", "general")
FLAVOURS = (*SAMPLING, *(f"{s}_norefill" for s in SAMPLING))


def flavour(st: SamplingTensors | SamplingFlags, refill: bool) -> str:
    kind = "greedy" if st.all_greedy else "general" if st.needs_filter else "sampled"
    return kind + ("" if refill else "_norefill")


def graph_kind(flavour_name: str, width: int, widths: tuple[int, ...]) -> str:
    """The registered name of a flavour's graphs at page-table width `width` (one of `widths`)."""
    return flavour_name if width == widths[-1] else f"{flavour_name}.kv{width}"


def decode_inputs(max_pages: int, vocab_size: int, scratch_slot: int):
    def specs(q: int) -> dict[str, BufferSpec]:
        return {
            "start": BufferSpec(),
            "grid": BufferSpec(trailing=(q,)),
            "page_table": BufferSpec(trailing=(max_pages,), pad=DUMMY_PAGE),
            "slots": BufferSpec(pad=scratch_slot),
            "num_draft": BufferSpec(),
            "temperature": BufferSpec(dtype=torch.float32, pad=1.0),
            "top_k": BufferSpec(pad=vocab_size),
            "top_p": BufferSpec(dtype=torch.float32, pad=1.0),
            "greedy": BufferSpec(dtype=torch.bool, pad=True),
            "seeds": BufferSpec(),
        }
    return specs


def graph_inputs(ctx: DecodeContext, grid: torch.Tensor, page_table: torch.Tensor) -> dict[str, torch.Tensor]:
    st = ctx.st
    return {"start": ctx.start, "grid": grid, "page_table": page_table, "slots": ctx.slots,
            "num_draft": ctx.num_draft_dev, "temperature": st.temperature, "top_k": st.top_k, "top_p": st.top_p,
            "greedy": st.greedy, "seeds": st.seeds}


def decode_step_fn(engine: StepEngine):
    """fn(static inputs, key) -> {"out_tokens", "num_accepted"}: StepEngine's decode body on uniform layouts."""
    ps = engine.page_size

    def step(inp: Mapping[str, torch.Tensor], key: GraphKey) -> dict[str, torch.Tensor]:
        name = key.kind
        greedy = name.startswith("greedy")
        st = SamplingTensors(temperature=inp["temperature"], top_k=inp["top_k"], top_p=inp["top_p"],
                             greedy=inp["greedy"], seeds=inp["seeds"], all_greedy=greedy, any_greedy=True,
                             needs_filter=name.startswith("general"))
        ctx = DecodeContext(
            seqs=None, k=key.q - 1, num_draft=None, base_pos=None, start=inp["start"], st=st, slots=inp["slots"],
            verify_layout=uniform_layout(inp["page_table"], key.q, ps, inp["num_draft"] + 1),
            single_layout=uniform_layout(inp["page_table"], 1, ps), device=inp["start"].device, input_grid=None,
            num_draft_dev=inp["num_draft"], refill=not name.endswith("norefill"), graph=True)
        out, accepted = engine.decode_body(ctx, inp["grid"])
        return {"out_tokens": out, "num_accepted": accepted}
    return step


def register_decode_graphs(runner: GraphRunner, engine: StepEngine, ks: tuple[int, ...],
                           widths: tuple[int, ...], scratch_slot: int) -> None:
    """Every flavour at every page-table width in `widths` (ascending; the last covers max_model_len)."""
    flavours = FLAVOURS if engine.has_draft_model else SAMPLING
    for width in widths:
        specs = decode_inputs(width, engine.vocab_size, scratch_slot)
        for name in flavours:
            refill = not name.endswith("norefill")
            prepare = (lambda key, refill=refill: engine.plan_graph_padding(key.q - 1, key.batch, refill))
            # The refill is dropped only in steps where nobody drafts (`AdaptivePolicy._refill`), and a stale
            # draft cannot propose: a _norefill graph only ever replays with q = 1.
            q_values = tuple(k + 1 for k in ks) if refill else (1,)
            runner.register(StepKind(graph_kind(name, width, widths), decode_step_fn(engine), specs,
                                     q_values=q_values, prepare=prepare if engine.plans_attention else None))
