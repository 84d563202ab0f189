"""Reference step functions over the graph contract: the target's decode/verify, a draft model's and an MTP
head's greedy draft loops, the MTP refill, with their input specs.

They are the engine's step shapes with nothing else (no sampling, no acceptance, no proposer), so a test can
check `GraphRunner` (capture, replay, buckets, padding lanes on the dummy page) and `scripts/gpu_bench.py` can time
a step kind without a `StepEngine` around them. They live with the tests, not in `cuda_graphs`, because they are
built from the engine's model and KV pool and `cuda_graphs` imports nothing from the engine
(tests/test_import_direction.py); the benchmark imports them from here (it puts the repository root on
`sys.path`) so the shapes it times are the ones these tests check.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from specstep.cuda_graphs.contract import BufferSpec, GraphKey, InputSpecs, StepFn
from specstep.engine.forward_batch import ForwardBatch, uniform_layout
from specstep.engine.kv_cache import DUMMY_PAGE, KVPool
from specstep.engine.models.llama import LlamaForCausalLM
from specstep.engine.models.mtp_head import MTPHead

Tensors = Mapping[str, torch.Tensor]


def target_inputs(max_pages: int) -> InputSpecs:
    """start [B], input_ids [B * q], page_table [B, max_pages] (padding lanes on the dummy page)."""
    return lambda q: {"start": BufferSpec(), "input_ids": BufferSpec(rows=q),
                      "page_table": BufferSpec(trailing=(max_pages,), pad=DUMMY_PAGE)}


def target_step(model: LlamaForCausalLM, pool: KVPool, slot: str = "") -> StepFn:
    """decode (q = 1) and verify (q = k + 1): the target over q tokens per lane -> logits, hidden. `slot`
    names the attention plan the forward uses (backends that plan, see engine.attention)."""
    def step(inp: Tensors, key: GraphKey) -> dict[str, torch.Tensor]:
        layout = uniform_layout(inp["page_table"], key.q, pool.page_size)
        hidden = model(ForwardBatch.derive(layout, inp["start"], inp["input_ids"], slot=slot), pool)
        return {"logits": model.compute_logits(hidden), "hidden": hidden}
    return step


def draft_model_step(draft: LlamaForCausalLM, pool: KVPool, num_steps: int) -> StepFn:
    """draft (q = 1) for a draft model: `num_steps` greedy steps in one graph, each consuming the previous
    token at start + j (target_inputs: input_ids [B] holds each lane's last token)."""
    def step(inp: Tensors, key: GraphKey) -> dict[str, torch.Tensor]:
        layout = uniform_layout(inp["page_table"], 1, pool.page_size)
        token, drafts = inp["input_ids"], []
        for j in range(num_steps):
            hidden = draft(ForwardBatch.derive(layout, inp["start"] + j, token), pool)
            token = draft.compute_logits(hidden).argmax(dim=-1)
            drafts.append(token)
        return {"drafts": torch.stack(drafts, dim=1)}
    return step


def mtp_inputs(max_pages: int, hidden_size: int, dtype: torch.dtype) -> InputSpecs:
    """target_inputs plus the per-token hidden state the head consumes."""
    base = target_inputs(max_pages)
    return lambda q: {**base(q), "hidden": BufferSpec(rows=q, trailing=(hidden_size,), dtype=dtype)}


def mtp_draft_step(head: MTPHead, target: LlamaForCausalLM, pool: KVPool, num_steps: int) -> StepFn:
    """draft (q = 1): `num_steps` greedy head steps in one graph, feeding its own hidden state forward.

    Lane b starts from token input_ids[b] with hidden[b] at head position start[b]; step j runs at start + j.
    """
    def step(inp: Tensors, key: GraphKey) -> dict[str, torch.Tensor]:
        layout = uniform_layout(inp["page_table"], 1, pool.page_size)
        token, hidden = inp["input_ids"], inp["hidden"]
        drafts = []
        for j in range(num_steps):
            fb = ForwardBatch.derive(layout, inp["start"] + j, token)
            hidden = head(fb, pool, target.embed_tokens(token), hidden)
            token = target.compute_logits(hidden).argmax(dim=-1)
            drafts.append(token)
        return {"drafts": torch.stack(drafts, dim=1), "hidden": hidden}
    return step


def mtp_refill_step(head: MTPHead, target: LlamaForCausalLM, pool: KVPool) -> StepFn:
    """refill (q = k + 1): the head over the verified tokens with the target's hidden states."""
    def step(inp: Tensors, key: GraphKey) -> dict[str, torch.Tensor]:
        layout = uniform_layout(inp["page_table"], key.q, pool.page_size)
        fb = ForwardBatch.derive(layout, inp["start"], inp["input_ids"])
        hidden = head(fb, pool, target.embed_tokens(fb.input_ids), inp["hidden"])
        return {"logits": target.compute_logits(hidden), "hidden": hidden}
    return step
