"""`specstep train-defaults`: train the embedded default tokenizer, target and draft from the stdlib.

Writes OUT/tokenizer.json, OUT/target/ and OUT/draft/ (self-contained Hugging Face folders, loadable by
both our loader and `transformers`), and OUT/quality.json with the held-out evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

# Torch's spinning OpenMP workers collapse throughput when the other core is busy (see CPU notes).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402

from specstep import engine  # noqa: E402
from specstep.engine.models.llama import LlamaForCausalLM  # noqa: E402
from specstep.training.data import corpus_files, token_stream  # noqa: E402
from specstep.training.evaluate import compare, logits_of, loss_and_argmax  # noqa: E402
from specstep.training.loop import TrainSettings, TrainStats, fixed_windows, new_progress, train  # noqa: E402
from specstep.training.models import (  # noqa: E402
    DRAFT_SIZE,
    TARGET_SIZE,
    build_model,
    count_params,
    llama_config_dict,
    save_model_folder,
    warm_start_draft,
)
from specstep.training.tokenizer import save_tokenizer, train_tokenizer  # noqa: E402

PERIODIC_EVAL_WINDOWS = 16  # small, so periodic evals cost a few seconds of the budget


def default_out() -> Path:
    return Path(engine.__file__).parent / "defaults"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=default_out(),
                        help="output folder (default: %(default)s)")
    parser.add_argument("--target-minutes", type=float, default=33.0, help="target training budget")
    parser.add_argument("--draft-minutes", type=float, default=10.0, help="draft distillation budget")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=256, help="training sequence length")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per optimiser step")
    parser.add_argument("--target-lr", type=float, default=2e-3, help="peak learning rate of the target")
    parser.add_argument("--draft-lr", type=float, default=2e-3, help="peak learning rate of the draft")
    parser.add_argument("--distill-ce-weight", type=float, default=0.25,
                        help="draft loss = w * cross-entropy + (1 - w) * KL(target || draft)")
    parser.add_argument("--eval-windows", type=int, default=256,
                        help="held-out windows for the final evaluation")


def run(args: argparse.Namespace) -> int:
    console = Console()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))  # tokenizers' pool, created lazily
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    wall_start = time.perf_counter()

    with new_progress() as progress:
        tokenizer, tokenizer_json, train_stream, heldout_stream = tokenizer_and_corpus(out, progress)
        vocab = tokenizer.get_vocab_size()
        periodic = fixed_windows(heldout_stream, args.seq_len + 1, PERIODIC_EVAL_WINDOWS)
        target, target_config, target_stats = train_target(args, vocab, train_stream, periodic, rng, progress)
        save_model_folder(target, target_config, out / "target", tokenizer_json)
        draft, draft_config, draft_stats = distill_draft(args, vocab, target, train_stream, periodic, rng, progress)
        save_model_folder(draft, draft_config, out / "draft", tokenizer_json)

        task = progress.add_task("final held-out evaluation", total=1, info="")
        final = compare(target, draft, fixed_windows(heldout_stream, args.seq_len + 1, args.eval_windows))
        progress.advance(task)

    quality = _quality_report(args, out, final, target, draft, target_stats, draft_stats,
                              len(train_stream), len(heldout_stream), time.perf_counter() - wall_start)
    (out / "quality.json").write_text(json.dumps(quality, indent=2) + "\n")
    console.print_json(json.dumps(quality))
    console.print(f"[bold]target val loss {final['target_loss']:.3f}, "
                  f"draft val loss {final['draft_loss']:.3f}, "
                  f"greedy agreement {final['agreement']:.3f}[/bold] -> {out}")
    return 0


def tokenizer_and_corpus(out: Path, progress: Progress) -> tuple[Any, Path, np.ndarray, np.ndarray]:
    """The tokenizer, trained and saved to OUT/tokenizer.json, and the train and held-out token streams."""
    task = progress.add_task("tokenizer + corpus", total=2, info="")
    tokenizer = train_tokenizer()
    tokenizer_json = out / "tokenizer.json"
    save_tokenizer(tokenizer, tokenizer_json)
    progress.advance(task)
    train_stream, heldout_stream = token_stream(tokenizer, "train"), token_stream(tokenizer, "heldout")
    progress.advance(task)
    progress.console.log(f"corpus: {len(corpus_files('train'))} train files, "
                         f"{len(train_stream):,} tokens; "
                         f"{len(corpus_files('heldout'))} held-out files, {len(heldout_stream):,} tokens")
    return tokenizer, tokenizer_json, train_stream, heldout_stream


def train_target(args: argparse.Namespace, vocab: int, train_stream: np.ndarray, periodic: torch.Tensor,
                 rng: np.random.Generator, progress: Progress) -> tuple[LlamaForCausalLM, dict[str, Any], TrainStats]:
    """The target trained from scratch on next-token cross-entropy (then frozen): model, config, stats."""
    target_config = llama_config_dict(TARGET_SIZE, vocab)
    target = build_model(target_config)

    def target_loss(windows: torch.Tensor) -> torch.Tensor:
        logits = logits_of(target, windows[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())

    progress.console.log(f"target: {TARGET_SIZE.describe()}, {count_params(target):,} params")
    stats = train(
        target, target_loss, train_stream,
        TrainSettings(args.target_minutes, args.target_lr, args.batch_size, args.seq_len),
        rng, progress, "target", lambda: {"val_loss": loss_and_argmax(target, periodic)[0]},
    )
    target.requires_grad_(False)
    return target, target_config, stats


def distill_draft(args: argparse.Namespace, vocab: int, target: LlamaForCausalLM, train_stream: np.ndarray,
                  periodic: torch.Tensor, rng: np.random.Generator, progress: Progress
                  ) -> tuple[LlamaForCausalLM, dict[str, Any], TrainStats]:
    """The draft, warm-started from the trained target and distilled from it (w * CE + (1 - w) * KL(target ||
    draft), w = --distill-ce-weight): model, config, stats."""
    draft_config = llama_config_dict(DRAFT_SIZE, vocab)
    draft = build_model(draft_config)
    copied = warm_start_draft(draft, target)
    progress.console.log(f"draft: {DRAFT_SIZE.describe()}, {count_params(draft):,} params; "
                         f"warm-started {len(copied)} tensors from the target")
    _, periodic_target_top = loss_and_argmax(target, periodic)
    w = args.distill_ce_weight

    def draft_loss(windows: torch.Tensor) -> torch.Tensor:
        inputs, labels = windows[:, :-1], windows[:, 1:].flatten()
        with torch.no_grad():  # the teacher is frozen: no graph, no activation memory
            teacher = logits_of(target, inputs).flatten(0, 1)
        student = logits_of(draft, inputs).flatten(0, 1)
        ce = F.cross_entropy(student, labels)
        kl = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True,
                      reduction="batchmean")
        return w * ce + (1.0 - w) * kl

    def draft_eval() -> dict[str, float]:
        loss, top = loss_and_argmax(draft, periodic)
        return {"val_loss": loss, "agreement": float((top == periodic_target_top).float().mean())}

    stats = train(
        draft, draft_loss, train_stream,
        TrainSettings(args.draft_minutes, args.draft_lr, args.batch_size, args.seq_len),
        rng, progress, "draft", draft_eval,
    )
    return draft, draft_config, stats


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _model_entry(config: dict[str, Any], model: torch.nn.Module, stats: Any, folder: Path) -> dict[str, Any]:
    return {
        "layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"], "heads": config["num_attention_heads"],
        "kv_heads": config["num_key_value_heads"], "params": count_params(model),
        "train_tokens": stats.tokens, "steps": stats.steps, "minutes": round(stats.seconds / 60, 2),
        "tokens_per_s": round(stats.tokens_per_s, 1), "final_train_loss": round(stats.final_train_loss, 4),
        "folder_bytes": _folder_bytes(folder), "history": stats.history,
    }


def _quality_report(args: argparse.Namespace, out: Path, final: dict[str, float], target: Any, draft: Any,
                    target_stats: Any, draft_stats: Any, train_tokens: int, heldout_tokens: int,
                    wall_seconds: float) -> dict[str, Any]:
    target_config = json.loads((out / "target" / "config.json").read_text())
    draft_config = json.loads((out / "draft" / "config.json").read_text())
    return {
        "target_val_loss": round(final["target_loss"], 4),
        "draft_val_loss": round(final["draft_loss"], 4),
        "greedy_agreement": round(final["agreement"], 4),
        "target_top1_accuracy": round(final["target_top1"], 4),
        "draft_top1_accuracy": round(final["draft_top1"], 4),
        "eval_tokens": int(final["tokens"]),
        "target": _model_entry(target_config, target, target_stats, out / "target"),
        "draft": _model_entry(draft_config, draft, draft_stats, out / "draft")
        | {"train_objective": f"{args.distill_ce_weight} * CE + "
                              f"{1 - args.distill_ce_weight} * KL(target || draft)",
           "warm_start": "embeddings, layer 0 and final norm copied from the trained target"},
        "corpus": {"train_files": len(corpus_files("train")), "heldout_files": len(corpus_files("heldout")),
                   "train_tokens": train_tokens, "heldout_tokens": heldout_tokens},
        "settings": {"seq_len": args.seq_len, "batch_size": args.batch_size, "target_lr": args.target_lr,
                     "draft_lr": args.draft_lr, "distill_ce_weight": args.distill_ce_weight,
                     "threads": args.threads, "seed": args.seed},
        "total_minutes": round(wall_seconds / 60, 2),
        "python": platform.python_version(), "torch": torch.__version__,
    }
