"""Time-budgeted training: AdamW, linear warmup then cosine decay over the *wall-clock* budget.

The schedule is a function of elapsed time rather than of a step count, because throughput on a shared
2-core machine is unknown in advance and varies; the learning rate still reaches its floor exactly when the
budget runs out, whatever the speed turned out to be.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch import nn

from specstep.engine.models.llama import LlamaForCausalLM


@dataclass(slots=True)
class TrainSettings:
    minutes: float
    peak_lr: float
    batch_size: int
    seq_len: int
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    evals: int = 8  # periodic held-out evaluations over the budget
    log_every_s: float = 30.0


@dataclass(slots=True)
class TrainStats:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    final_train_loss: float = float("nan")
    history: list[dict[str, float]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def random_windows(stream: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> torch.Tensor:
    """[batch, length] windows at uniform random offsets (length = seq_len + 1 for inputs plus targets)."""
    starts = rng.integers(0, len(stream) - length, size=batch)
    return torch.from_numpy(np.stack([stream[s : s + length] for s in starts]).astype(np.int64))


def fixed_windows(stream: np.ndarray, length: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping windows, evenly spaced over the whole stream when there are more than `max_windows`."""
    n = len(stream) // length
    picks = np.linspace(0, n - 1, num=min(n, max_windows)).round().astype(np.int64)
    return torch.from_numpy(np.stack([stream[i * length : (i + 1) * length] for i in picks]).astype(np.int64))


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    # Decay matrices only: norms' gains are not over-parameterised, so decaying them just biases them to 0.
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(settings: TrainSettings, step: int, fraction: float) -> float:
    warm = min(1.0, (step + 1) / settings.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, fraction)))
    return settings.peak_lr * warm * (settings.min_lr_ratio + (1.0 - settings.min_lr_ratio) * cosine)


class Cadence:
    """Wall-clock deadlines of a training loop: a progress log every `log_every_s`, `evals` periodic
    evaluations spread over the budget. The evaluation due at the very end is the caller's (it always runs)."""

    def __init__(self, budget: float, evals: int, log_every_s: float) -> None:
        self.budget = budget
        self.log_every = log_every_s
        self.eval_every = budget / max(1, evals)
        self.next_log, self.next_eval = self.log_every, self.eval_every

    def log_due(self, elapsed: float) -> bool:
        if elapsed < self.next_log:
            return False
        self.next_log += self.log_every
        return True

    def eval_due(self, elapsed: float) -> bool:
        if elapsed < self.next_eval or elapsed >= self.budget:
            return False
        self.next_eval += self.eval_every
        return True


def train(
    model: LlamaForCausalLM,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    stream: np.ndarray,
    settings: TrainSettings,
    rng: np.random.Generator,
    progress: Progress,
    label: str,
    evaluate: Callable[[], dict[str, float]],
) -> TrainStats:
    """Train `model` on random windows of `stream` until the time budget is spent.

    `loss_fn(windows[B, S+1]) -> scalar loss`. `evaluate()` runs periodically in eval mode (its time counts
    against the budget, which keeps the end time predictable).
    """
    opt = make_optimizer(model, settings.peak_lr, settings.weight_decay)
    budget = settings.minutes * 60.0
    cadence = Cadence(budget, settings.evals, settings.log_every_s)
    stats = TrainStats()
    task = progress.add_task(label, total=budget, info="")
    start = time.perf_counter()
    ema: float | None = None
    model.train()
    while (elapsed := time.perf_counter() - start) < budget:
        lr = lr_at(settings, stats.steps, elapsed / budget)
        loss = loss_fn(random_windows(stream, settings.batch_size, settings.seq_len + 1, rng))
        optimizer_step(opt, model, loss, lr, settings.grad_clip)
        stats.steps += 1
        stats.tokens += settings.batch_size * settings.seq_len
        value = float(loss.detach())
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        elapsed = time.perf_counter() - start
        progress.update(task, completed=min(elapsed, budget),
                        info=f"loss {ema:.3f}  {stats.tokens / elapsed:,.0f} tok/s")
        if cadence.log_due(elapsed):
            progress.console.log(f"{label}: step {stats.steps}  tokens {stats.tokens:,}  "
                                 f"train loss {ema:.3f}  "
                                 f"lr {lr:.2e}  {stats.tokens / elapsed:,.0f} tok/s")
        if cadence.eval_due(elapsed):
            stats.history.append(_periodic_eval(model, evaluate, progress, label, stats, elapsed, ema))
    stats.seconds = time.perf_counter() - start
    stats.final_train_loss = ema if ema is not None else float("nan")
    stats.history.append(_periodic_eval(model, evaluate, progress, label, stats, stats.seconds, ema))
    progress.update(task, completed=budget)
    model.eval()
    return stats


def optimizer_step(opt: torch.optim.Optimizer, model: nn.Module, loss: torch.Tensor, lr: float,
                   grad_clip: float) -> None:
    """One optimiser step at learning rate `lr` on the gradients of `loss`, clipped to norm `grad_clip`."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()


def _periodic_eval(model: nn.Module, evaluate: Callable[[], dict[str, float]], progress: Progress, label: str,
                   stats: TrainStats, elapsed: float, ema: float | None) -> dict[str, float]:
    model.eval()
    result = {"minutes": round(elapsed / 60, 2), "tokens": stats.tokens,
              "train_loss": round(ema, 4) if ema is not None else float("nan"), **evaluate()}
    model.train()
    shown = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v:,}" for k, v in result.items())
    progress.console.log(f"{label} eval: {shown}")
    return result


def new_progress() -> Progress:
    # Without a terminal (nohup to a log file) rich would wrap log lines at 80 columns;
    # source paths are noise.
    console = Console(log_path=False, width=None if sys.stdout.isatty() else 140)
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TimeElapsedColumn(), TextColumn("/"),
                    TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                    console=console)
