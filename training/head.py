"""`specstep train-head`: train an MTP (EAGLE-style) head for a target, the way SEEDS.md's team did.

    1. target features are PRECOMPUTED with specstep's own inference path (the paged `LlamaForCausalLM.forward`
       over `build_forward_batch`, exactly what the engine's verify step runs): final hidden states (fp16) and
       the top-k log-probabilities of the target's next-token distribution, for windows of the train split;
    2. the head (RMSNorms restored, see `MTPHead`) trains on them with the target's embedding and `lm_head`
       frozen and shared (never copied into the head folder). At position i the head sees (h[i], t[i+1]) and
       must reproduce the target at i+1: its hidden state h[i+1] (smooth L1, EAGLE's regression term) and its
       next-token distribution (KL over its top-k tokens plus a tail bucket);
    3. validation loss and teacher-forced agreement run the saved, reloaded head through the INFERENCE path
       (`MTPProposer` over a paged `ForwardBatch` + `KVPool`, target hidden states from the paged target), so
       numerical differences between the training and serving code cannot hide;
    4. held-out greedy acceptance is measured with the real speculative engine (`build_engine`, spec=mtp).

Precomputation is streamed: chunks of windows are precomputed into a bounded pool as training consumes it
(each window is drawn about `--reuse` times), so the whole budget is one wall-clock schedule.
Writes OUT/config.json (`SpecstepMTPHead`), OUT/model.safetensors (head weights only) and OUT/quality.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Torch's spinning OpenMP workers collapse throughput when the other core is busy (see CPU notes).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from torch import nn  # noqa: E402

import engine  # noqa: E402
from engine.batch_builder import build_forward_batch  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.kv_cache import KVPool  # noqa: E402
from engine.loader import local_to_hf, save_checkpoint  # noqa: E402
from engine.model_loader import load_model, load_mtp_head  # noqa: E402
from engine.models.llama import LlamaForCausalLM  # noqa: E402
from engine.models.mtp_head import MTPHead  # noqa: E402
from engine.proposers.mtp import MTPProposer  # noqa: E402
from training.loop import TrainSettings, fixed_windows, lr_at, make_optimizer, new_progress  # noqa: E402

PAGE_SIZE = 16
INIT_STD = 0.02


def default_target() -> Path:
    return Path(engine.__file__).parent / "defaults" / "target"


def default_out() -> Path:
    return Path(engine.__file__).parent / "defaults" / "mtp"


@dataclass(slots=True)
class HeadSettings:
    minutes: float = 12.0  # wall-clock budget of precomputation + optimisation
    max_steps: int | None = None  # stop earlier (tests, smoke runs)
    seq_len: int = 256  # target window; the head sees seq_len - 1 positions of it
    batch_size: int = 4  # windows per optimiser step
    lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    hidden_weight: float = 1.0  # smooth L1 to the target's next hidden state
    logit_weight: float = 0.1  # KL to the target's next-token distribution (top-k + tail bucket)
    topk: int = 32
    reuse: float = 2.0  # each precomputed window is drawn about this many times
    chunk_windows: int = 32  # windows precomputed at a time
    max_pool_tokens: int = 600_000  # cap on cached positions (fp16 hidden + top-k), oldest chunks replaced
    precompute_batch: int = 8
    evals: int = 6  # periodic validations (inference path) over the budget
    periodic_val_windows: int = 8
    log_every_s: float = 30.0


# ---------------------------------------------------------------------------------------------- config / io


def head_config_dict(target_cfg: ModelConfig, intermediate_size: int | None = None) -> dict[str, Any]:
    """The head folder's config.json: a one-layer Llama-style block sized like the target."""
    return {
        "architectures": ["SpecstepMTPHead"],
        "model_type": "specstep_mtp",
        "vocab_size": target_cfg.vocab_size,
        "hidden_size": target_cfg.hidden_size,
        "intermediate_size": int(intermediate_size or target_cfg.intermediate_size),
        "num_hidden_layers": 1,
        "num_attention_heads": target_cfg.num_heads,
        "num_key_value_heads": target_cfg.num_kv_heads,
        "head_dim": target_cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": target_cfg.max_position_embeddings,
        "rms_norm_eps": target_cfg.rms_norm_eps,
        "rope_theta": target_cfg.rope_theta,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def build_head(config: dict[str, Any]) -> MTPHead:
    """A fresh fp32 head (call `torch.manual_seed` first). Norm gains start at 1, residual outputs scaled down."""
    head = MTPHead(ModelConfig.from_dict(config))
    for name, module in head.named_modules():
        if isinstance(module, nn.Linear):
            std = INIT_STD / math.sqrt(2) if name.endswith(("o_proj", "down_proj")) else INIT_STD
            nn.init.normal_(module.weight, std=std)
    return head


def save_head(head: MTPHead, config: dict[str, Any], folder: Path) -> None:
    """Head weights only (hidden_norm, embed_norm, fc, layers.0.*, norm); embedding and lm_head stay the target's."""
    state = {k: v for k, v in head.state_dict().items()}
    save_checkpoint(local_to_hf(state, head.cfg), config, folder)


# ------------------------------------------------------------------------------ target features (precompute)


@dataclass(slots=True)
class TargetFeatures:
    tokens: torch.Tensor  # [N, S] int64
    hidden: torch.Tensor  # [N, S, d] fp16: the target's final (normed) hidden states
    top_logp: torch.Tensor  # [N, S, k] fp16: log-probabilities of the target's top-k next tokens
    top_idx: torch.Tensor  # [N, S, k] int16 (int32 for vocabularies over 32k)


class PagedRunner:
    """Runs the target (and a head) over whole windows through the serving path: paged KV, ForwardBatch."""

    def __init__(self, target: LlamaForCausalLM, max_windows: int, seq_len: int, head: MTPHead | None = None):
        self.target = target
        self.device = target.embed_tokens.weight.device
        self.max_windows = max_windows
        dtype = target.embed_tokens.weight.dtype
        self.pages_per_window = -(-seq_len // PAGE_SIZE)
        num_pages = 1 + max_windows * self.pages_per_window  # page 0 is the dummy page
        self.pool = KVPool(target.cfg, target.cfg.num_layers, num_pages, PAGE_SIZE, dtype, self.device)
        self.proposer = None
        if head is not None:
            head_pool = KVPool(head.cfg, 1, num_pages, PAGE_SIZE, dtype, self.device)
            self.proposer = MTPProposer(head, target, head_pool, max_windows, self.device)

    def _batch(self, ids: Sequence[Sequence[int]]):
        ppw = self.pages_per_window
        tables = [list(range(1 + b * ppw, 1 + (b + 1) * ppw)) for b in range(len(ids))]
        return build_forward_batch(ids, np.zeros(len(ids), np.int64), tables, PAGE_SIZE, self.device)

    @torch.no_grad()
    def target_hidden(self, windows: torch.Tensor) -> torch.Tensor:
        """[B, S] -> [B, S, d] final hidden states, from one paged prefill per window."""
        b, s = windows.shape
        return self.target(self._batch(windows.tolist()), self.pool).view(b, s, -1)

    @torch.no_grad()
    def head_hidden(self, tokens: torch.Tensor, hidden_in: torch.Tensor) -> torch.Tensor:
        """The head's serving forward: tokens [B, S'] (t[i+1]) with hidden_in [B, S', d] (h[i]) -> [B, S', d]."""
        assert self.proposer is not None
        b, s = tokens.shape
        fb = self._batch(tokens.tolist())
        return self.proposer.forward(fb, hidden_in.reshape(b * s, -1)).view(b, s, -1)


def precompute(runner: PagedRunner, windows: torch.Tensor, topk: int, batch: int,
               on_batch: Callable[[int], None] | None = None) -> TargetFeatures:
    n, s = windows.shape
    d = runner.target.cfg.hidden_size
    idx_dtype = torch.int16 if runner.target.cfg.vocab_size <= 32767 else torch.int32
    hidden = torch.empty(n, s, d, dtype=torch.float16)
    top_logp = torch.empty(n, s, topk, dtype=torch.float16)
    top_idx = torch.empty(n, s, topk, dtype=idx_dtype)
    for i in range(0, n, batch):
        chunk = windows[i : i + batch]
        h = runner.target_hidden(chunk)
        logp = torch.log_softmax(runner.target.compute_logits(h), dim=-1)
        vals, idx = logp.topk(topk, dim=-1)
        hidden[i : i + len(chunk)] = h.to(torch.float16)
        top_logp[i : i + len(chunk)] = vals.clamp_min(-60.0).to(torch.float16)
        top_idx[i : i + len(chunk)] = idx.to(idx_dtype)
        if on_batch:
            on_batch(len(chunk))
    return TargetFeatures(windows.clone(), hidden, top_logp, top_idx)


class FeaturePool:
    """A bounded ring of precomputed windows; training draws batches uniformly from what is filled."""

    def __init__(self, capacity: int, seq_len: int, d: int, topk: int, idx_dtype: torch.dtype) -> None:
        self.capacity = capacity
        self.tokens = torch.zeros(capacity, seq_len, dtype=torch.int64)
        self.hidden = torch.zeros(capacity, seq_len, d, dtype=torch.float16)
        self.top_logp = torch.zeros(capacity, seq_len, topk, dtype=torch.float16)
        self.top_idx = torch.zeros(capacity, seq_len, topk, dtype=idx_dtype)
        self.filled = 0
        self.cursor = 0
        self.added = 0

    def add(self, f: TargetFeatures) -> None:
        for j in range(f.tokens.shape[0]):
            c = self.cursor
            self.tokens[c], self.hidden[c] = f.tokens[j], f.hidden[j]
            self.top_logp[c], self.top_idx[c] = f.top_logp[j], f.top_idx[j]
            self.cursor = (c + 1) % self.capacity
            self.filled = min(self.filled + 1, self.capacity)
            self.added += 1

    def sample(self, batch: int, rng: np.random.Generator) -> TargetFeatures:
        pick = torch.from_numpy(rng.integers(0, self.filled, size=batch))
        return TargetFeatures(self.tokens[pick], self.hidden[pick], self.top_logp[pick], self.top_idx[pick])


# ------------------------------------------------------------------------------------------------ objective


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


# ------------------------------------------------------------------------------------------------- training


@dataclass(slots=True)
class HeadTrainStats:
    steps: int = 0
    positions: int = 0  # head positions trained on (with repetition)
    seconds: float = 0.0
    precompute_seconds: float = 0.0
    eval_seconds: float = 0.0
    precomputed_windows: int = 0
    precomputed_tokens: int = 0
    train_loss: list[float] = field(default_factory=list)  # per step (total loss)
    history: list[dict[str, float]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        opt_s = max(self.seconds - self.precompute_seconds - self.eval_seconds, 1e-9)
        first = float(np.mean(self.train_loss[:10])) if self.train_loss else float("nan")
        last = float(np.mean(self.train_loss[-10:])) if self.train_loss else float("nan")
        return {
            "steps": self.steps,
            "seconds": round(self.seconds, 1),
            "precompute_seconds": round(self.precompute_seconds, 1),
            "periodic_eval_seconds": round(self.eval_seconds, 1),
            "precomputed_windows": self.precomputed_windows,
            "precomputed_tokens": self.precomputed_tokens,
            "precompute_tokens_per_s": round(self.precomputed_tokens / max(self.precompute_seconds, 1e-9), 1),
            "trained_positions": self.positions,
            "train_positions_per_s": round(self.positions / opt_s, 1),
            "overall_positions_per_s": round(self.positions / max(self.seconds, 1e-9), 1),
            "train_loss_first10": round(first, 4),
            "train_loss_last10": round(last, 4),
            "history": self.history,
        }


def train_head(head: MTPHead, target: LlamaForCausalLM, stream: np.ndarray, s: HeadSettings,
               rng: np.random.Generator, progress: Progress,
               val_windows: torch.Tensor | None = None) -> HeadTrainStats:
    """Optimise `head` on target features of random windows of `stream` (a token id array) within the budget."""
    target.requires_grad_(False)
    target.eval()
    if len(stream) <= s.seq_len:
        raise ValueError(f"token stream of {len(stream)} ids is shorter than one window ({s.seq_len + 1})")
    d = target.cfg.hidden_size
    runner = PagedRunner(target, max(s.precompute_batch, s.periodic_val_windows), s.seq_len, head)
    capacity = max(s.batch_size, s.max_pool_tokens // s.seq_len)
    idx_dtype = torch.int16 if target.cfg.vocab_size <= 32767 else torch.int32
    pool = FeaturePool(capacity, s.seq_len, d, s.topk, idx_dtype)
    opt = make_optimizer(head, s.lr, s.weight_decay)
    sched = TrainSettings(s.minutes, s.lr, s.batch_size, s.seq_len, warmup_steps=s.warmup_steps,
                          min_lr_ratio=s.min_lr_ratio)
    budget = s.minutes * 60.0
    eval_every = budget / max(1, s.evals)
    stats = HeadTrainStats()
    task = progress.add_task("train head", total=budget, info="")
    pre_task = progress.add_task("precompute target", total=None, info="")
    start = time.perf_counter()
    next_eval, next_log = eval_every, s.log_every_s
    drawn = 0.0
    ema: dict[str, float] = {}

    def refill_pool() -> None:
        t0 = time.perf_counter()
        starts = rng.integers(0, len(stream) - s.seq_len, size=s.chunk_windows)
        windows = torch.from_numpy(np.stack([stream[a : a + s.seq_len] for a in starts]).astype(np.int64))
        feats = precompute(runner, windows, s.topk, s.precompute_batch,
                           lambda n: progress.advance(pre_task, n * s.seq_len))
        pool.add(feats)
        stats.precompute_seconds += time.perf_counter() - t0
        stats.precomputed_windows += len(windows)
        stats.precomputed_tokens += windows.numel()
        progress.update(pre_task, info=f"{stats.precomputed_tokens / stats.precompute_seconds:,.0f} tok/s, "
                                       f"pool {pool.filled} windows")

    def periodic(elapsed: float) -> dict[str, float]:
        row: dict[str, float] = {"minutes": round(elapsed / 60, 2), "steps": stats.steps,
                                 **{f"train_{k}": round(v, 4) for k, v in ema.items()}}
        if val_windows is not None and len(val_windows):
            t0 = time.perf_counter()
            head.eval()
            v = validate(runner, val_windows[: s.periodic_val_windows], s)
            head.train()
            stats.eval_seconds += time.perf_counter() - t0
            row |= {"val_loss": round(v["loss"], 4), "val_agreement": round(v["agreement"], 4)}
        progress.console.log("head eval: " + "  ".join(f"{k} {v}" for k, v in row.items()))
        return row

    head.train()
    while (elapsed := time.perf_counter() - start) < budget and (s.max_steps is None or stats.steps < s.max_steps):
        # Fresh windows whenever the pool has been drawn `reuse` times over (more positions cached than drawn).
        if pool.added == 0 or drawn >= s.reuse * pool.added:
            refill_pool()
            continue
        lr = lr_at(sched, stats.steps, elapsed / budget)
        for group in opt.param_groups:
            group["lr"] = lr
        losses = head_losses(head, target, pool.sample(s.batch_size, rng), s)
        opt.zero_grad(set_to_none=True)
        losses["loss"].backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), s.grad_clip)
        opt.step()
        drawn += s.batch_size
        stats.steps += 1
        stats.positions += s.batch_size * (s.seq_len - 1)
        stats.train_loss.append(float(losses["loss"].detach()))
        for k, v in losses.items():
            ema[k] = float(v.detach()) if k not in ema else 0.95 * ema[k] + 0.05 * float(v.detach())
        elapsed = time.perf_counter() - start
        rate = stats.positions / max(elapsed - stats.precompute_seconds - stats.eval_seconds, 1e-9)
        progress.update(task, completed=min(elapsed, budget),
                        info=f"step {stats.steps}  loss {ema['loss']:.4f}  agree {ema['agreement']:.3f}  "
                             f"{rate:,.0f} pos/s")
        if elapsed >= next_log:
            next_log += s.log_every_s
            progress.console.log(f"head: step {stats.steps}  loss {ema['loss']:.4f} (hidden {ema['hidden']:.4f}, "
                                 f"kl {ema['kl']:.4f})  agreement {ema['agreement']:.3f}  lr {lr:.2e}  "
                                 f"{rate:,.0f} pos/s  pool {pool.filled}/{pool.capacity}")
        if elapsed >= next_eval and elapsed < budget:
            next_eval += eval_every
            stats.history.append(periodic(elapsed))
    stats.seconds = time.perf_counter() - start
    if stats.steps:
        stats.history.append(periodic(stats.seconds))
    progress.update(task, completed=budget)
    progress.update(pre_task, total=stats.precomputed_tokens, completed=stats.precomputed_tokens)
    head.eval()
    return stats


# ----------------------------------------------------------------------------------- the real engine's view


def engine_acceptance(target_dir: Path, head_dir: Path, prompts: list[list[int]], ks: Sequence[int],
                      max_tokens: int, threads: int = 1, temperature: float = 0.0,
                      progress: Progress | None = None, check_lossless: bool = True) -> dict[str, Any]:
    """Run the speculative engine (spec=mtp, fixed k) over `prompts`; acceptance from each request's stats.

    With `check_lossless` (greedy only) it also runs plain decoding and records whether every output is
    token-identical to it.
    """
    from engine.engine_config import EngineConfig
    from engine.sampling_params import SamplingParams
    from scheduler.build import build_engine
    from scheduler.request import Request

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)

    def generate(cfg: EngineConfig, label: str) -> tuple[list, float]:
        core, _, _ = build_engine(cfg)
        task = progress.add_task(label, total=len(prompts) * max_tokens, info="") if progress else None
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

    common = dict(model=str(target_dir), device="cpu", threads=threads, kv_cache_tokens=
                  len(prompts) * (max(len(p) for p in prompts) + max_tokens + 32), max_batch_size=len(prompts))
    plain = None
    result: dict[str, Any] = {"prompts": len(prompts), "prompt_tokens": len(prompts[0]), "new_tokens": max_tokens,
                              "temperature": temperature}
    if check_lossless and temperature == 0.0:
        plain, secs = generate(EngineConfig(spec="none", **common), "engine: plain")
        result["plain_seconds"] = round(secs, 2)
    for k in ks:
        cfg = EngineConfig(spec="mtp", draft=str(head_dir), spec_policy="fixed", num_spec_tokens=k, **common)
        reqs, secs = generate(cfg, f"engine: mtp k={k}")
        drafted = sum(r.stats.drafted for r in reqs)
        accepted = sum(r.stats.accepted for r in reqs)
        steps = sum(r.stats.steps for r in reqs)
        per_pos_d = np.zeros(k)
        per_pos_a = np.zeros(k)
        for r in reqs:
            n = len(r.stats.drafted_per_position)
            per_pos_d[:n] += r.stats.drafted_per_position
            per_pos_a[:n] += r.stats.accepted_per_position
        row = {"acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
               "mean_accepted_length": round(1 + accepted / steps, 4) if steps else 0.0,
               "acceptance_per_position": [round(float(a / d), 4) if d else 0.0
                                           for a, d in zip(per_pos_a, per_pos_d)],
               "drafted": drafted, "accepted": accepted, "spec_steps": steps, "seconds": round(secs, 2)}
        if plain is not None:
            row["identical_to_plain"] = all(a.output_token_ids == b.output_token_ids for a, b in zip(reqs, plain))
        result[f"k{k}"] = row
    return result


# ------------------------------------------------------------------------------------------------ the whole


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and p.suffix == ".safetensors")


def train_head_folder(target_dir: Path, out: Path, train_stream: np.ndarray, heldout_stream: np.ndarray,
                      settings: HeadSettings, intermediate_size: int | None = None, seed: int = 0,
                      val_windows: int = 64, engine_prompts: list[list[int]] | None = None,
                      engine_ks: Sequence[int] = (1, 3), engine_new_tokens: int = 64, threads: int = 1,
                      sampled_acceptance: bool = True, console: Console | None = None) -> dict[str, Any]:
    """Everything but reading the corpus: train, save, reload, validate, measure the engine; returns quality."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    target = load_model(target_dir, "cpu", "float32")
    config = head_config_dict(target.cfg, intermediate_size)
    head = build_head(config)
    params = sum(p.numel() for p in head.parameters())
    val = fixed_windows(heldout_stream, settings.seq_len, val_windows)
    wall = time.perf_counter()
    with new_progress() as progress:
        if console is None:
            console = progress.console
        progress.console.log(f"head: 1 layer, hidden {config['hidden_size']}, intermediate "
                             f"{config['intermediate_size']}, {params:,} params; target {target_dir}")
        stats = train_head(head, target, train_stream, settings, rng, progress, val)
        save_head(head, config, out)

        # Everything below uses the head as saved: reloaded through the engine's loader.
        reloaded = load_mtp_head(out, target.cfg)
        runner = PagedRunner(target, 8, settings.seq_len, reloaded)
        task = progress.add_task("validate (inference path)", total=1, info="")
        val_metrics = validate(runner, val, settings)
        progress.advance(task)
        progress.console.log("validation: " + "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                       for k, v in val_metrics.items()))
        engine_figures: dict[str, Any] = {}
        if engine_prompts:
            engine_figures["greedy"] = engine_acceptance(target_dir, out, engine_prompts, engine_ks,
                                                         engine_new_tokens, threads, 0.0, progress)
            if sampled_acceptance:
                engine_figures["sampled_t1"] = engine_acceptance(target_dir, out, engine_prompts, engine_ks,
                                                                 engine_new_tokens, threads, 1.0, progress)
    quality = {
        "head": {"params": params, "bytes": _folder_bytes(out), "intermediate_size": config["intermediate_size"],
                 "target": str(target_dir)},
        "settings": asdict(settings) | {"seed": seed, "threads": threads, "val_windows": len(val)},
        "training": stats.summary(),
        "validation_inference_path": {k: round(v, 4) if isinstance(v, float) else v for k, v in val_metrics.items()},
        "engine": engine_figures,
        "wall_seconds": round(time.perf_counter() - wall, 1),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }
    (out / "quality.json").write_text(json.dumps(quality, indent=2) + "\n")
    return quality


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = HeadSettings()
    parser.add_argument("--target", type=Path, default=default_target(),
                        help="target model folder (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=default_out(), help="output head folder (default: %(default)s)")
    parser.add_argument("--minutes", type=float, default=d.minutes, help="budget of precompute + training")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many optimiser steps")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="target window length")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="windows per optimiser step")
    parser.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    parser.add_argument("--intermediate-size", type=int, default=512,
                        help="head MLP width (default %(default)s; the target's own width if 0)")
    parser.add_argument("--hidden-weight", type=float, default=d.hidden_weight, help="weight of smooth L1 on h[i+1]")
    parser.add_argument("--logit-weight", type=float, default=d.logit_weight, help="weight of KL to the target")
    parser.add_argument("--topk", type=int, default=d.topk, help="target log-probs kept per position")
    parser.add_argument("--reuse", type=float, default=d.reuse, help="draws per precomputed window")
    parser.add_argument("--max-pool-tokens", type=int, default=d.max_pool_tokens,
                        help="cap on precomputed positions held in memory")
    parser.add_argument("--val-windows", type=int, default=64, help="held-out windows for the final validation")
    parser.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for engine acceptance")
    parser.add_argument("--eval-prompt-tokens", type=int, default=128)
    parser.add_argument("--eval-new-tokens", type=int, default=64)
    parser.add_argument("--eval-k", type=int, nargs="+", default=[1, 3], help="draft lengths to measure")


def run(args: argparse.Namespace) -> int:
    from training.data import heldout_prompts, token_stream
    from training.tokenizer import load_tokenizer

    console = Console()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    tok_path = args.target / "tokenizer.json"
    if not tok_path.is_file():
        console.print(f"[red]{args.target}: no tokenizer.json (needed to encode the corpus)[/red]")
        return 2
    tokenizer = load_tokenizer(tok_path)
    with console.status("encoding the corpus"):
        train_stream, heldout_stream = token_stream(tokenizer, "train"), token_stream(tokenizer, "heldout")
        prompts = heldout_prompts(tokenizer, args.eval_prompts, args.eval_prompt_tokens) if args.eval_prompts else []
    console.log(f"corpus: {len(train_stream):,} train tokens, {len(heldout_stream):,} held-out tokens")
    settings = HeadSettings(minutes=args.minutes, max_steps=args.max_steps, seq_len=args.seq_len,
                            batch_size=args.batch_size, lr=args.lr, hidden_weight=args.hidden_weight,
                            logit_weight=args.logit_weight, topk=args.topk, reuse=args.reuse,
                            max_pool_tokens=args.max_pool_tokens)
    quality = train_head_folder(args.target, args.out, train_stream, heldout_stream, settings,
                                args.intermediate_size or None, args.seed, args.val_windows, prompts,
                                args.eval_k, args.eval_new_tokens, args.threads)
    console.print_json(json.dumps({k: quality[k] for k in ("head", "validation_inference_path", "engine")}))
    tr, v = quality["training"], quality["validation_inference_path"]
    line = (f"[bold]head: {tr['steps']} steps, {tr['train_positions_per_s']:,.0f} positions/s; val loss "
            f"{v['loss']:.4f}, agreement {v['agreement']:.3f}")
    for k in args.eval_k:
        row = quality["engine"].get("greedy", {}).get(f"k{k}")
        if row:
            line += f"; k={k} acceptance {row['acceptance_rate']:.3f}, mean length {row['mean_accepted_length']:.2f}"
    console.print(line + f"[/bold] -> {args.out}")
    return 0
