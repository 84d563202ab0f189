"""Held-out evaluation: losses, top-1 accuracy, and teacher-forced greedy agreement of draft and target.

Agreement (the fraction of positions where draft and target argmax coincide, both fed the same true text)
is the quantity that bounds greedy speculative acceptance, without the inflation that degenerate greedy
loops of small models cause when measuring acceptance on their own outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specstep.engine.models.llama import LlamaForCausalLM

EVAL_BATCH = 8


def logits_of(model: LlamaForCausalLM, inputs: torch.Tensor) -> torch.Tensor:
    """The training path: dense causal forward [B, S] -> logits [B, S, V] (fp32); grad per caller."""
    return model.compute_logits(model.forward_dense(inputs))


@torch.no_grad()
def loss_and_argmax(model: LlamaForCausalLM, windows: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(mean loss, argmax tokens [N, S]) over windows [N, S+1]; the argmax is kept for draft agreement."""
    total, count, argmax = 0.0, 0, []
    for chunk in windows.split(EVAL_BATCH):
        logits = logits_of(model, chunk[:, :-1])
        total += float(F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"))
        count += chunk[:, 1:].numel()
        argmax.append(logits.argmax(-1))
    return total / count, torch.cat(argmax)


@torch.no_grad()
def compare(target: LlamaForCausalLM, draft: LlamaForCausalLM, windows: torch.Tensor) -> dict[str, float]:
    """Both models over the same held-out windows [N, S+1] (teacher-forced)."""
    sums = {"target_loss": 0.0, "draft_loss": 0.0, "target_top1": 0.0, "draft_top1": 0.0, "agreement": 0.0}
    count = 0
    for chunk in windows.split(EVAL_BATCH):
        inputs, labels = chunk[:, :-1], chunk[:, 1:].flatten()
        t_logits = logits_of(target, inputs).flatten(0, 1)
        d_logits = logits_of(draft, inputs).flatten(0, 1)
        t_top, d_top = t_logits.argmax(-1), d_logits.argmax(-1)
        sums["target_loss"] += float(F.cross_entropy(t_logits, labels, reduction="sum"))
        sums["draft_loss"] += float(F.cross_entropy(d_logits, labels, reduction="sum"))
        sums["target_top1"] += float((t_top == labels).sum())
        sums["draft_top1"] += float((d_top == labels).sum())
        sums["agreement"] += float((t_top == d_top).sum())
        count += labels.numel()
    return {k: v / count for k, v in sums.items()} | {"tokens": count}
