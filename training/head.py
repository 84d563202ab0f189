"""`specstep train-head`: train an MTP (EAGLE-style) head for a target (EAGLE's recipe, with the RMSNorms
restored).

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
This file holds the training loop and the command; the features (1) are in `head_data`, the objective (2) in
`head_objective`, the measurements (3, 4) in `head_eval`, the head folder's config and weights in `head_model`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Torch's spinning OpenMP workers collapse throughput when the other core is busy (see CPU notes).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402

from specstep import engine  # noqa: E402
from specstep.engine.model_loader import load_model  # noqa: E402
from specstep.engine.model_source import resolve_model, target_marker  # noqa: E402
from specstep.engine.models.llama import LlamaForCausalLM  # noqa: E402
from specstep.engine.models.mtp_head import MTPHead  # noqa: E402
from specstep.engine.proposers.draft_vocab import write_draft_vocab  # noqa: E402
from specstep.training.head_data import FeaturePool, PagedRunner, precompute, topk_index_dtype  # noqa: E402
from specstep.training.head_eval import engine_figures, validate, validate_saved  # noqa: E402
from specstep.training.head_model import build_head, folder_bytes, head_config_dict, save_head  # noqa: E402
from specstep.training.head_objective import head_losses  # noqa: E402
from specstep.training.head_settings import HeadSettings  # noqa: E402
from specstep.training.loop import (  # noqa: E402
    Cadence,
    TrainSettings,
    fixed_windows,
    lr_at,
    make_optimizer,
    new_progress,
    optimizer_step,
    random_windows,
)


def default_target() -> Path:
    return Path(engine.__file__).parent / "defaults" / "target"


def default_out() -> Path:
    return Path(engine.__file__).parent / "defaults" / "mtp"


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
    return HeadTrainer(head, target, stream, s, rng, progress, val_windows).run()


class HeadTrainer:
    """One `train_head` run: a bounded pool of target features, refilled from fresh windows whenever training has
    drawn it `reuse` times over; optimiser steps on batches drawn from it; progress lines and periodic
    evaluations on `val_windows`, all within one wall-clock budget."""

    def __init__(self, head: MTPHead, target: LlamaForCausalLM, stream: np.ndarray, s: HeadSettings,
                 rng: np.random.Generator, progress: Progress, val_windows: torch.Tensor | None) -> None:
        self.head, self.target, self.stream, self.s, self.rng = head, target, stream, s, rng
        self.progress, self.val_windows = progress, val_windows
        self.runner = PagedRunner(target, max(s.precompute_batch, s.periodic_val_windows), s.seq_len, head)
        capacity = max(s.batch_size, s.max_pool_tokens // s.seq_len)
        self.pool = FeaturePool(capacity, s.seq_len, target.cfg.hidden_size, s.topk,
                                topk_index_dtype(target.cfg.vocab_size))
        self.opt = make_optimizer(head, s.lr, s.weight_decay)
        self.sched = TrainSettings(s.minutes, s.lr, s.batch_size, s.seq_len, warmup_steps=s.warmup_steps,
                                   min_lr_ratio=s.min_lr_ratio)
        self.budget = s.minutes * 60.0
        self.stats = HeadTrainStats()
        self.drawn = 0.0  # windows drawn from the pool so far
        self.ema: dict[str, float] = {}  # moving averages of the losses, for the progress lines
        self.task = progress.add_task("train head", total=self.budget, info="")
        self.pre_task = progress.add_task("precompute target", total=None, info="")

    def run(self) -> HeadTrainStats:
        s, stats = self.s, self.stats
        cadence = Cadence(self.budget, s.evals, s.log_every_s)
        start = time.perf_counter()
        self.head.train()
        while ((elapsed := time.perf_counter() - start) < self.budget
               and (s.max_steps is None or stats.steps < s.max_steps)):
            # Fresh windows whenever the pool has been drawn `reuse` times over (more positions cached than drawn).
            if self.pool.added == 0 or self.drawn >= s.reuse * self.pool.added:
                self.refill_pool()
                continue
            lr = lr_at(self.sched, stats.steps, elapsed / self.budget)
            self.step(lr)
            elapsed = time.perf_counter() - start
            self.report(elapsed, lr, cadence.log_due(elapsed))
            if cadence.eval_due(elapsed):
                stats.history.append(self.periodic(elapsed))
        stats.seconds = time.perf_counter() - start
        if stats.steps:
            stats.history.append(self.periodic(stats.seconds))
        self.progress.update(self.task, completed=self.budget)
        self.progress.update(self.pre_task, total=stats.precomputed_tokens, completed=stats.precomputed_tokens)
        self.head.eval()
        return stats

    def refill_pool(self) -> None:
        s, stats = self.s, self.stats
        t0 = time.perf_counter()
        windows = random_windows(self.stream, s.chunk_windows, s.seq_len, self.rng)
        feats = precompute(self.runner, windows, s.topk, s.precompute_batch,
                           lambda n: self.progress.advance(self.pre_task, n * s.seq_len))
        self.pool.add(feats)
        stats.precompute_seconds += time.perf_counter() - t0
        stats.precomputed_windows += len(windows)
        stats.precomputed_tokens += windows.numel()
        self.progress.update(self.pre_task, info=f"{stats.precomputed_tokens / stats.precompute_seconds:,.0f} "
                                                 f"tok/s, pool {self.pool.filled} windows")

    def step(self, lr: float) -> None:
        """One optimiser step at learning rate `lr` on a batch drawn from the pool."""
        s, stats = self.s, self.stats
        losses = head_losses(self.head, self.target, self.pool.sample(s.batch_size, self.rng), s)
        optimizer_step(self.opt, self.head, losses["loss"], lr, s.grad_clip)
        self.drawn += s.batch_size
        stats.steps += 1
        stats.positions += s.batch_size * (s.seq_len - 1)
        stats.train_loss.append(float(losses["loss"].detach()))
        for k, v in losses.items():
            self.ema[k] = float(v.detach()) if k not in self.ema else 0.95 * self.ema[k] + 0.05 * float(v.detach())

    def report(self, elapsed: float, lr: float, log: bool) -> None:
        """The progress bar after a step, and (`log`) a line in the console."""
        stats, ema = self.stats, self.ema
        rate = stats.positions / max(elapsed - stats.precompute_seconds - stats.eval_seconds, 1e-9)
        self.progress.update(self.task, completed=min(elapsed, self.budget),
                             info=f"step {stats.steps}  loss {ema['loss']:.4f}  agree {ema['agreement']:.3f}  "
                                  f"{rate:,.0f} pos/s")
        if log:
            self.progress.console.log(
                f"head: step {stats.steps}  loss {ema['loss']:.4f} (hidden {ema['hidden']:.4f}, kl {ema['kl']:.4f})"
                f"  agreement {ema['agreement']:.3f}  lr {lr:.2e}  {rate:,.0f} pos/s  "
                f"pool {self.pool.filled}/{self.pool.capacity}")

    def periodic(self, elapsed: float) -> dict[str, float]:
        """A row of the history: the training losses so far and, with validation windows, validation."""
        s, stats = self.s, self.stats
        row: dict[str, float] = {"minutes": round(elapsed / 60, 2), "steps": stats.steps,
                                 **{f"train_{k}": round(v, 4) for k, v in self.ema.items()}}
        if self.val_windows is not None and len(self.val_windows):
            t0 = time.perf_counter()
            self.head.eval()
            v = validate(self.runner, self.val_windows[: s.periodic_val_windows], s)
            self.head.train()
            stats.eval_seconds += time.perf_counter() - t0
            row |= {"val_loss": round(v["loss"], 4), "val_agreement": round(v["agreement"], 4)}
        self.progress.console.log("head eval: " + "  ".join(f"{k} {v}" for k, v in row.items()))
        return row


# ------------------------------------------------------------------------------------------------ the whole


def train_head_folder(target_dir: Path, out: Path, train_stream: np.ndarray, heldout_stream: np.ndarray,
                      settings: HeadSettings, intermediate_size: int | None = None, seed: int = 0,
                      val_windows: int = 64, engine_prompts: list[list[int]] | None = None,
                      engine_ks: Sequence[int] = (1, 3), engine_new_tokens: int = 64, threads: int = 1,
                      sampled_acceptance: bool = True, console: Console | None = None, draft_vocab: int = 0,
                      target_name: str | None = None, save_dtype: str = "float32") -> dict[str, Any]:
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
        save_head(head, config, out, getattr(torch, save_dtype))
        vocab = write_head_vocab(out, train_stream, target.cfg, draft_vocab) if draft_vocab else None
        (out / "specstep_target.json").write_text(json.dumps(
            target_marker(resolve_model(target_dir), "mtp", target_name or Path(target_dir).name), indent=2) + "\n")

        # Measured on the head as saved: reloaded through the engine's loader, run by the engine.
        val_metrics = validate_saved(target, out, val, settings, progress)
        figures = engine_figures(target_dir, out, engine_prompts, engine_ks, engine_new_tokens, threads,
                                 sampled_acceptance, progress)
    quality = {
        "head": {"params": params, "bytes": folder_bytes(out), "intermediate_size": config["intermediate_size"],
                 "target": str(target_dir)},
        "settings": asdict(settings) | {"seed": seed, "threads": threads, "val_windows": len(val)},
        "training": stats.summary(),
        "validation_inference_path": {k: round(v, 4) if isinstance(v, float) else v for k, v in val_metrics.items()},
        "draft_vocab": vocab,
        "engine": figures,
        "wall_seconds": round(time.perf_counter() - wall, 1),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }
    (out / "quality.json").write_text(json.dumps(quality, indent=2) + "\n")
    return quality


def write_head_vocab(out: Path, train_stream: np.ndarray, cfg, size: int) -> dict[str, Any]:
    """The head's reduced draft vocabulary: the `size` most frequent tokens of its training data (plus EOS)."""
    counts = torch.from_numpy(np.bincount(train_stream.astype(np.int64), minlength=cfg.vocab_size))
    write_draft_vocab(out, counts, size, always=tuple(cfg.eos_token_ids))
    top = torch.sort(counts, descending=True).values
    return {"size": size, "train_coverage": round(float(top[:size].sum() / top.sum()), 4)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = HeadSettings()
    parser.add_argument("--target", type=Path, default=default_target(),
                        help="target model folder or GGUF file (default: %(default)s)")
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
    parser.add_argument("--save-dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                        help="dtype of the saved head weights (the engine casts to its own at load)")
    parser.add_argument("--draft-vocab", type=int, default=0,
                        help="also write a reduced draft vocabulary of the N most frequent training tokens (0: none)")
    parser.add_argument("--val-windows", type=int, default=64, help="held-out windows for the final validation")
    parser.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for engine acceptance")
    parser.add_argument("--eval-prompt-tokens", type=int, default=128)
    parser.add_argument("--eval-new-tokens", type=int, default=64)
    parser.add_argument("--eval-k", type=int, nargs="+", default=[1, 3], help="draft lengths to measure")


def run(args: argparse.Namespace) -> int:
    from specstep.training.data import heldout_prompts, token_stream
    from specstep.training.tokenizer import load_tokenizer

    console = Console()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    target_name = args.target.stem if args.target.suffix == ".gguf" else args.target.name
    args.target = resolve_model(args.target)  # a GGUF target is converted once, like the engine does
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
                                args.eval_k, args.eval_new_tokens, args.threads, draft_vocab=args.draft_vocab,
                                target_name=target_name, save_dtype=args.save_dtype)
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
