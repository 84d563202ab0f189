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
state. A step replays the graph of the smallest captured k at or above its own (`graph_for`), so start-up
captures only the (flavour, k) pairs steps form (`decode_graph_ids`) and every decode step that fits a bucket
replays one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from specstep.cuda_graphs.buckets import width_for
from specstep.cuda_graphs.contract import BufferSpec, GraphKey, StepKind
from specstep.engine.forward_batch import uniform_layout
from specstep.engine.kv_cache import DUMMY_PAGE
from specstep.engine.sampling_params import SamplingFlags, SamplingTensors
from specstep.engine.step_context import DecodeInputs, GraphTable, StepLayouts

if TYPE_CHECKING:
    from specstep.cuda_graphs.runner import GraphRunner
    from specstep.engine.step_engine import StepEngine

SAMPLING = ("greedy", "sampled", "general")


def flavour(st: SamplingTensors | SamplingFlags, refill: bool) -> str:
    kind = "greedy" if st.all_greedy else "general" if st.needs_filter else "sampled"
    return kind + ("" if refill else "_norefill")


def graph_kind(flavour_name: str, width: int, widths: tuple[int, ...]) -> str:
    """The registered name of a flavour's graphs at page-table width `width` (one of `widths`)."""
    return flavour_name if width == widths[-1] else f"{flavour_name}.kv{width}"


def graph_for(engine: StepEngine, flags: SamplingFlags, refill: bool, tables: list[list[int]], k: int
              ) -> tuple[str | None, int, int | None]:
    """(graph kind, k, width) of the captured graph a decode step of k drafts replays, else (None, k, None):
    eager. It is the graph of the smallest captured k at or above the step's own, so a step whose drafts were
    cut (to the room left in its requests, or to nothing for want of pages) still replays one: lanes past their
    num_draft are masked, as is any lane drafting fewer than its batch's k. A step whose refill flag changes
    no work (`refills`) replays the refill flavour."""
    name = flavour(flags, refill or not refills(engine))
    for kg in (kg for kg in engine.graph_ks if kg >= k):
        width = graph_width(engine, tables, kg)
        kind = graph_kind(name, width, engine.graph_widths)
        if engine.graphs.has_graph(kind, kg + 1, len(tables)):
            return kind, kg, width
    return None, k, None


def refills(engine: StepEngine) -> bool:
    """Whether a step's refill flag changes its work: the proposer's to say (`Proposer.refills`)."""
    return engine.proposer is not None and engine.proposer.refills


def graph_width(engine: StepEngine, tables: list[list[int]], k: int) -> int:
    """The narrowest captured page-table width for these lanes at k. A uniform lane writes k + 1 verify
    positions and the proposer's look-ahead from its start even where it drafts fewer (and reserved fewer
    pages): those land past its own pages, on the table's dummy-page padding, which must exist. Positions
    never pass max_model_len's width, the widest."""
    lookahead = engine.proposer.kv_lookahead if engine.proposer else 0
    widths = engine.graph_widths
    need = max(len(t) for t in tables) + -(-(k + 1 + lookahead) // engine.page_size)
    return width_for(widths, min(need, widths[-1]))


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


def graph_inputs(inputs: DecodeInputs) -> dict[str, torch.Tensor]:
    """A replay's inputs (`decode_inputs`' buffers) from the host side of the step, whose layout is the page table."""
    assert isinstance(inputs.layout, GraphTable), "an eager step's inputs: it replays no graph"
    st = inputs.st
    return {"start": inputs.start, "grid": inputs.grid, "page_table": inputs.layout.page_table,
            "slots": inputs.slots, "num_draft": inputs.num_draft, "temperature": st.temperature, "top_k": st.top_k,
            "top_p": st.top_p, "greedy": st.greedy, "seeds": st.seeds}


def decode_step_fn(engine: StepEngine):
    """fn(static inputs, key) -> {"out_tokens", "num_accepted"}: StepEngine's decode body on uniform layouts."""
    ps = engine.page_size

    def step(inp: Mapping[str, torch.Tensor], key: GraphKey) -> dict[str, torch.Tensor]:
        name = key.kind
        greedy = name.startswith("greedy")
        st = SamplingTensors(temperature=inp["temperature"], top_k=inp["top_k"], top_p=inp["top_p"],
                             greedy=inp["greedy"], seeds=inp["seeds"], all_greedy=greedy, any_greedy=True,
                             needs_filter=name.startswith("general"))
        layouts = StepLayouts(verify=uniform_layout(inp["page_table"], key.q, ps, inp["num_draft"] + 1),
                              single=uniform_layout(inp["page_table"], 1, ps))
        inputs = DecodeInputs(k=key.q - 1, start=inp["start"], st=st, slots=inp["slots"], num_draft=inp["num_draft"],
                              grid=inp["grid"], layout=layouts, refill=not name.endswith("norefill"), uniform=True)
        out, accepted = engine.decode_body(inputs)
        return {"out_tokens": out, "num_accepted": accepted}
    return step


def decode_graph_ids(ks: tuple[int, ...], drops_refill: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(flavour, q values) to capture at each width and bucket: what decode steps form, given that a step
    replays the graph of the smallest captured k at or above its own (`graph_for`; lanes drafting fewer than
    the graph's k are masked by num_draft, as in any batch):

        refill flavours   q = k + 1 for k in ks; without k = 0 when the policy drops refills (a step then
                          refills only where someone drafts; one whose drafts were cut for want of pages
                          keeps its refill and rounds up to the smallest k, nobody drafting)
        _norefill         only when the policy drops refills (`PolicyConfig.drops_refill`; the fixed policy
                          never does), and only at q = 1: the refill is dropped only where nobody drafts
    A proposer whose steps' refill flag changes nothing (`refills`) never drops it: `drops_refill` False."""
    refill_ks = tuple(k for k in ks if k > 0) if drops_refill and max(ks) > 0 else ks
    ids = [(name, tuple(k + 1 for k in refill_ks)) for name in SAMPLING]
    return ids + ([(f"{name}_norefill", (1,)) for name in SAMPLING] if drops_refill else [])


def register_decode_graphs(runner: GraphRunner, engine: StepEngine, ks: tuple[int, ...],
                           widths: tuple[int, ...], scratch_slot: int, drops_refill: bool) -> None:
    """`decode_graph_ids` at every page-table width in `widths` (ascending; the last covers max_model_len)."""
    for width in widths:
        specs = decode_inputs(width, engine.vocab_size, scratch_slot)
        for name, q_values in decode_graph_ids(ks, drops_refill and refills(engine)):
            refill = not name.endswith("norefill")
            prepare = (lambda key, refill=refill: engine.plan_graph_padding(key.q - 1, key.batch, refill))
            runner.register(StepKind(graph_kind(name, width, widths), decode_step_fn(engine), specs,
                                     q_values=q_values, prepare=prepare if engine.plans_attention else None))
