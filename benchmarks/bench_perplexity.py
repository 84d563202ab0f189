"""Perplexity of a GGUF model over a held-out text with fp32 and int8 activations (`--activations`): the quality
cost of int8 activations, measured on the same weights and tokens, and beside it llama.cpp's own figure for the
same file and text (`llama-perplexity`, built by `benchmarks/setup_llamacpp.sh`), which multiplies the same blocks
by activations quantised the same way.

    python -m benchmarks.bench_perplexity [--model FILE.gguf] [--text FILE|argparse.py] [--chunks 8] [--ctx 512]
                                          [--llamacpp .llamacpp/bin]

Scored as `llama-perplexity` scores: the text's tokens cut into `--chunks` chunks of `--ctx`, each a forward of its
own, and every token in a chunk's second half scored (its first half is context). The text defaults to a file of
Python's standard library (held out: not the kind of text a chat model was tuned on, and not the prompts the
benchmarks use).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sysconfig
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def perplexity(model, ids: torch.Tensor, ctx: int, chunks: int) -> float:
    """llama-perplexity's figure: exp of the mean negative log-likelihood of each chunk's second-half tokens."""
    nll, count, first = 0.0, 0, ctx // 2
    with torch.inference_mode():
        for c in range(chunks):
            chunk = ids[c * ctx:(c + 1) * ctx].unsqueeze(0)
            logits = model.compute_logits(model.forward_dense(chunk)).float()
            nll += F.cross_entropy(logits[0, first:-1], chunk[0, first + 1:], reduction="sum").item()
            count += ctx - 1 - first
    return math.exp(nll / count)


def llamacpp_perplexity(bin_dir: Path, model: Path, text: Path, ctx: int, chunks: int) -> float:
    out = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(ctx),
                          "-b", str(ctx), "--chunks", str(chunks), "-t", str(torch.get_num_threads())],
                         capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not found or f"over {chunks} chunks" not in out.stdout + out.stderr:
        raise RuntimeError(f"llama-perplexity did not score {chunks} chunks:\n{(out.stdout + out.stderr)[-2000:]}")
    return float(found.group(1))


def main() -> None:
    from tokenizers import Tokenizer

    from specstep.engine.cpu_kernels import CpuKernels
    from specstep.engine.gguf_checkpoint import converted_folder
    from specstep.engine.model_loader import load_model
    from specstep.engine.model_source import pretrained_gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the embedded SmolLM2's)")
    ap.add_argument("--text", type=Path, default=Path("difflib.py"),
                    help="a text file, or the name of a file of Python's standard library (default difflib.py)")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--llamacpp", type=Path, default=Path(__file__).resolve().parents[1] / ".llamacpp" / "bin",
                    help="llama.cpp's programs (skipped where llama-perplexity is not there)")
    args = ap.parse_args()
    path = args.model or pretrained_gguf()
    if not args.text.is_file():
        args.text = Path(sysconfig.get_paths()["stdlib"]) / args.text
    tokenizer = Tokenizer.from_file(str(converted_folder(path) / "tokenizer.json"))
    ids = torch.tensor(tokenizer.encode(args.text.read_text()).ids)
    if ids.numel() < args.chunks * args.ctx:
        raise SystemExit(f"{args.text} holds {ids.numel()} tokens: fewer than {args.chunks} chunks of {args.ctx}")
    figures = {}
    for acts in ("fp32", "int8"):
        model = load_model(path, "cpu", "float32", CpuKernels(activations=acts))
        figures[f"specstep, {acts} activations"] = perplexity(model, ids, args.ctx, args.chunks)
        del model
    if (args.llamacpp / "llama-perplexity").is_file():
        figures["llama.cpp (llama-perplexity)"] = llamacpp_perplexity(args.llamacpp, path, args.text, args.ctx,
                                                                      args.chunks)
    print(f"{path.name}: {args.chunks} chunks of {args.ctx} tokens of {args.text.name}, second halves scored")
    base = figures["specstep, fp32 activations"]
    for name, ppl in figures.items():
        print(f"  {name:32s} perplexity {ppl:.4f}  ({ppl / base - 1:+.3%} against fp32 activations)")


if __name__ == "__main__":
    main()
