"""How good a trained head is, measured only through serving code.

`validate` is teacher-forced: the target's paged prefill and the head as the engine's `MTPProposer`, so
numerical differences between the training and serving implementations cannot hide. `engine_acceptance` runs
the real speculative engine (`build_engine`, spec=mtp) and reads acceptance from each request's stats.
`validate_saved` and `engine_figures` measure a head folder as `train_head_folder` wrote it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from rich.progress import Progress

from specstep.engine.model_loader import load_mtp_head
from specstep.engine.models.llama import LlamaForCausalLM
from specstep.training.head_data import PagedRunner
from specstep.training.head_settings import HeadSettings


@torch.no_grad()
def validate(runner: PagedRunner, windows: torch.Tensor, s: HeadSettings) -> dict[str, float]:
    """Teacher-forced validation through the serving implementations of both models.

    The target runs its paged prefill over each window (fp32, no cached features); the head runs as the engine's
    `MTPProposer` over a paged batch of (t[i+1], h[i]); logits come from the target's own `compute_logits`.
    """
    sums = dict(loss=0.0, hidden_smooth_l1=0.0, kl=0.0, agreement=0.0)
    label_sums = dict(head_ce=0.0, target_ce=0.0, head_top1=0.0, target_top1=0.0)
    count = labelled = 0
    for chunk in windows.split(runner.max_windows):
        h = runner.target_hidden(chunk)  # [B, S, d]
        t_logp = torch.log_softmax(runner.target.compute_logits(h[:, 1:]), -1)  # the target at i+1
        out = runner.head_hidden(chunk[:, 1:], h[:, :-1])  # the head at i
        q_logp = torch.log_softmax(runner.target.compute_logits(out), -1)
        hid = float(F.smooth_l1_loss(out, h[:, 1:], reduction="sum")) / out.shape[-1]
        kl = float((t_logp.exp() * (t_logp - q_logp)).sum())
        sums["hidden_smooth_l1"] += hid
        sums["kl"] += kl
        sums["loss"] += s.hidden_weight * hid + s.logit_weight * kl
        sums["agreement"] += float((q_logp.argmax(-1) == t_logp.argmax(-1)).sum())
        count += out.shape[0] * out.shape[1]
        # Against the text itself: t[i+2] (the last head position's label lies outside the window).
        labels = chunk[:, 2:].unsqueeze(-1)
        q_lab, t_lab = q_logp[:, :-1], t_logp[:, :-1]
        label_sums["head_ce"] -= float(q_lab.gather(-1, labels).sum())
        label_sums["target_ce"] -= float(t_lab.gather(-1, labels).sum())
        label_sums["head_top1"] += float((q_lab.argmax(-1, keepdim=True) == labels).sum())
        label_sums["target_top1"] += float((t_lab.argmax(-1, keepdim=True) == labels).sum())
        labelled += labels.numel()
    return ({k: v / count for k, v in sums.items()} | {k: v / labelled for k, v in label_sums.items()}
            | {"positions": count})


def validate_saved(target: LlamaForCausalLM, head_dir: Path, windows: torch.Tensor, s: HeadSettings,
                   progress: Progress) -> dict[str, Any]:
    """`validate` on the head as saved, reloaded through the engine's loader."""
    runner = PagedRunner(target, 8, s.seq_len, load_mtp_head(head_dir, target.cfg))
    task = progress.add_task("validate (inference path)", total=1, info="")
    metrics = validate(runner, windows, s)
    progress.advance(task)
    progress.console.log("validation: " + "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                   for k, v in metrics.items()))
    return metrics


def engine_figures(target_dir: Path, head_dir: Path, prompts: list[list[int]] | None, ks: Sequence[int],
                   max_tokens: int, threads: int, sampled: bool, progress: Progress) -> dict[str, Any]:
    """`engine_acceptance` greedy and (`sampled`) at temperature 1; nothing without prompts."""
    figures: dict[str, Any] = {}
    if prompts:
        figures["greedy"] = engine_acceptance(target_dir, head_dir, prompts, ks, max_tokens, threads, 0.0, progress)
        if sampled:
            figures["sampled_t1"] = engine_acceptance(target_dir, head_dir, prompts, ks, max_tokens, threads, 1.0,
                                                      progress)
    return figures


def engine_acceptance(target_dir: Path, head_dir: Path, prompts: list[list[int]], ks: Sequence[int],
                      max_tokens: int, threads: int = 1, temperature: float = 0.0,
                      progress: Progress | None = None, check_lossless: bool = True) -> dict[str, Any]:
    """Run the speculative engine (spec=mtp, fixed k) over `prompts`; acceptance from each request's stats.

    With `check_lossless` (greedy only) it also runs plain decoding and records whether every output is
    token-identical to it.
    """
    from specstep.engine.engine_config import EngineConfig
    from specstep.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    common = dict(model=str(target_dir), device="cpu", threads=threads, kv_cache_tokens=
                  len(prompts) * (max(len(p) for p in prompts) + max_tokens + 32), max_batch_size=len(prompts))
    plain = None
    result: dict[str, Any] = {"prompts": len(prompts), "prompt_tokens": len(prompts[0]), "new_tokens": max_tokens,
                              "temperature": temperature}
    if check_lossless and temperature == 0.0:
        plain, secs = run_to_completion(EngineConfig(spec="none", **common), prompts, params, "engine: plain", progress)
        result["plain_seconds"] = round(secs, 2)
    for k in ks:
        cfg = EngineConfig(spec="mtp", draft=str(head_dir), spec_policy="fixed", num_spec_tokens=k, **common)
        reqs, secs = run_to_completion(cfg, prompts, params, f"engine: mtp k={k}", progress)
        row = acceptance(reqs, k) | {"seconds": round(secs, 2)}
        if plain is not None:
            row["identical_to_plain"] = all(a.output_token_ids == b.output_token_ids for a, b in zip(reqs, plain))
        result[f"k{k}"] = row
    return result


def run_to_completion(cfg, prompts: list[list[int]], params, label: str, progress: Progress | None
                      ) -> tuple[list, float]:
    """`prompts` run to completion on an engine built from `cfg` (an `EngineConfig`): the finished requests and
    the seconds they took (engine start-up excluded)."""
    from specstep.scheduler.build import build_engine
    from specstep.scheduler.core.request import Request

    core, _, _ = build_engine(cfg)
    task = progress.add_task(label, total=len(prompts) * params.max_tokens, info="") if progress else None
    try:
        reqs = [Request(str(i), list(p), params, seed=1234 + i) for i, p in enumerate(prompts)]
        for r in reqs:
            core.add_request(r)
        t0 = time.perf_counter()
        while core.has_unfinished():
            core.step()
            if progress is not None:
                progress.update(task, completed=sum(r.num_output_tokens for r in reqs))
        return reqs, time.perf_counter() - t0
    finally:
        core.stream.close()


def acceptance(reqs: list, k: int) -> dict[str, Any]:
    """Acceptance of the speculative steps of `reqs` (finished requests), drafting up to `k`: overall, as a mean
    accepted length, and per draft position."""
    drafted = sum(r.stats.drafted for r in reqs)
    accepted = sum(r.stats.accepted for r in reqs)
    steps = sum(r.stats.steps for r in reqs)
    per_pos_d = np.zeros(k)
    per_pos_a = np.zeros(k)
    for r in reqs:
        n = len(r.stats.drafted_per_position)
        per_pos_d[:n] += r.stats.drafted_per_position
        per_pos_a[:n] += r.stats.accepted_per_position
    return {"acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "mean_accepted_length": round(1 + accepted / steps, 4) if steps else 0.0,
            "acceptance_per_position": [round(float(a / d), 4) if d else 0.0 for a, d in zip(per_pos_a, per_pos_d)],
            "drafted": drafted, "accepted": accepted, "spec_steps": steps}
