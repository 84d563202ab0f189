"""Perplexity of a GGUF model over a held-out text with fp32 and int8 activations (`--activations`): the quality
cost of int8 activations, measured on the same weights and tokens.

    python -m benchmarks.bench_perplexity [--model FILE.gguf] [--text FILE] [--tokens 4096] [--window 512]

The text defaults to a file of Python's standard library (held out: not the kind of text a chat model was tuned
on, and not the prompts the benchmarks use). Non-overlapping windows of `--window` tokens; every token after a
window's first is scored.
"""

from __future__ import annotations

import argparse
import math
import os
import sysconfig
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def perplexity(model, ids: torch.Tensor, window: int) -> float:
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, ids.numel() - 1, window):
            chunk = ids[start:start + window].unsqueeze(0)
            if chunk.shape[1] < 2:
                break
            logits = model.compute_logits(model.forward_dense(chunk)).float()
            nll += F.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum").item()
            count += chunk.shape[1] - 1
    return math.exp(nll / count)


def main() -> None:
    from tokenizers import Tokenizer

    from specstep.engine.cpu_kernels import CpuKernels
    from specstep.engine.gguf_checkpoint import converted_folder
    from specstep.engine.model_loader import load_model
    from specstep.engine.model_source import pretrained_gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the embedded SmolLM2's)")
    ap.add_argument("--text", type=Path, default=Path(sysconfig.get_paths()["stdlib"]) / "difflib.py")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args()
    path = args.model or pretrained_gguf()
    tokenizer = Tokenizer.from_file(str(converted_folder(path) / "tokenizer.json"))
    ids = torch.tensor(tokenizer.encode(args.text.read_text()).ids[:args.tokens])
    figures = {}
    for acts in ("fp32", "int8"):
        model = load_model(path, "cpu", "float32", CpuKernels(activations=acts))
        figures[acts] = perplexity(model, ids, args.window)
        del model
    print(f"{path.name}: {ids.numel()} tokens of {args.text.name}, windows of {args.window}")
    for acts, ppl in figures.items():
        print(f"  {acts:5s} activations: perplexity {ppl:.4f}")
    print(f"  int8 / fp32: {figures['int8'] / figures['fp32'] - 1:+.3%}")


if __name__ == "__main__":
    main()
