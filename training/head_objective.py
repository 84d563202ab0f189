"""The head's training objective on precomputed target features (the dense training path).

`head_eval.validate` computes the same quantities through the serving path; with the full distribution as
"top-k" the two agree (tests/test_train_head.py checks it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specstep.engine.models.llama import LlamaForCausalLM
from specstep.engine.models.mtp_head import MTPHead
from specstep.training.head_data import TargetFeatures
from specstep.training.head_settings import HeadSettings


def topk_kl(p_logp: torch.Tensor, q_logp: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over k + 1 buckets: the target's top-k tokens and the rest of the vocabulary lumped together.

    A lower bound of the full KL, exact when the target's mass is all in its top-k; unlike renormalising the
    top-k it does not push the head to squeeze a flat distribution into k tokens.
    """
    p = p_logp.exp()
    p_tail = (1.0 - p.sum(-1)).clamp_min(0.0)
    q_tail = (1.0 - q_logp.exp().sum(-1)).clamp_min(1e-12)
    top = (p * (p_logp - q_logp)).sum(-1)
    tail = p_tail * (torch.log(p_tail.clamp_min(1e-12)) - torch.log(q_tail))
    return (top + tail).mean()


def head_losses(head: MTPHead, target: LlamaForCausalLM, f: TargetFeatures, s: HeadSettings) -> dict[str, torch.Tensor]:
    """The training objective on a batch (dense training path). Head position i predicts what the target
    does at i+1: regress h[i+1], match the target's distribution for t[i+2]."""
    with torch.no_grad():
        emb = target.embed_tokens(f.tokens[:, 1:])  # t[i+1], frozen embedding
    h = f.hidden.float()
    out = head.forward_dense(emb, h[:, :-1])
    hidden_loss = F.smooth_l1_loss(out, h[:, 1:])
    logq = torch.log_softmax(target.compute_logits(out), dim=-1)  # frozen lm_head, grads flow to `out` only
    idx = f.top_idx[:, 1:].long()
    kl = topk_kl(f.top_logp[:, 1:].float(), logq.gather(-1, idx))
    agree = (logq.argmax(-1) == idx[..., 0]).float().mean()
    return {"loss": s.hidden_weight * hidden_loss + s.logit_weight * kl, "hidden": hidden_loss, "kl": kl,
            "agreement": agree}
