"""Batch-1 plain decode of a bf16 Hugging Face folder: its linears in the kernel layer's BF16 rows (the default)
against the same folder widened to fp32 (`--quantization none`: the torch / oneDNN linears, 4 bytes a weight),
alternating in one run.

    python -m benchmarks.bench_half_folder [--out /tmp/smollm2-135m-bf16] [--repeats 3] [--new-tokens 64]

Without a folder at `--out` it writes one first: SmolLM2-135M's shape (30 layers, hidden 576, 9 / 3 heads, vocab
49,152, tied embeddings) with random weights, saved by transformers in bf16, and the embedded SmolLM2's tokenizer.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path

import torch

from benchmarks.common import code_prompts, console, machine, run_engine
from specstep.engine.engine_config import EngineConfig
from specstep.engine.model_source import default_target, resolve_model
from specstep.engine.sampling_params import SamplingParams

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)


def write_folder(out: Path) -> None:
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2_135M)).to(torch.bfloat16).eval()
    model.save_pretrained(out)
    shutil.copy(resolve_model(default_target().reference) / "tokenizer.json", out / "tokenizer.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/smollm2-135m-bf16"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=2)
    args = ap.parse_args()
    if not (args.out / "config.json").is_file():
        write_folder(args.out)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    prompts = code_prompts(args.prompts, 64, seed=1, model=args.out)
    forms = {"fp32 (--quantization none)": "none", "bf16 kernels (default)": "auto"}
    seen: dict[str, list[float]] = {name: [] for name in forms}
    outputs = {}
    for i in range(args.repeats):
        for name, quantization in forms.items():
            cfg = EngineConfig(model=str(args.out), spec="none", quantization=quantization)
            r = run_engine(cfg, prompts, params, 1)
            seen[name].append(r.tok_per_s)
            outputs[name] = r.outputs
            console.print(f"repeat {i + 1}, {name}: {r.tok_per_s:.1f} tok/s")
    for name, figures in seen.items():
        console.print(f"{name}: median {statistics.median(figures):.1f} tok/s over {len(figures)} ({machine()})")
    a, b = outputs.values()
    console.print(f"outputs identical: {sum(x == y for x, y in zip(a, b))}/{len(a)}")


if __name__ == "__main__":
    main()
