"""Plain decode of a bf16 Hugging Face folder in each form its linears can take, alternating in one run:
its own bf16 rows in the kernel layer (the default: bf16 dot products where the CPU has AVX-512 BF16, else fp32
activations), the same rows with exact fp32 activations (`--activations fp32`), Q8_0 blocks quantised at load
(`--quantization q8_0`, int8 activations under the default `--activations auto`), and fp32 (`--quantization
none`: the torch / oneDNN linears, 4 bytes a weight). Batch 1 and batch 8 (`--batches`), greedy, prompts of
held-out code.

    python -m benchmarks.bench_half_folder [--out /tmp/smollm2-135m-bf16] [--repeats 3] [--new-tokens 64]

Without a folder at `--out` it writes one first: the embedded SmolLM2-135M's weights (its Q4_1 file, dequantised)
saved by transformers in bf16, with its tokenizer: real pretrained weights in the layout a bf16 download has.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path

import torch

from benchmarks.common import code_prompts, console, machine, run_engine
from specstep.engine.engine_config import EngineConfig
from specstep.engine.gguf_checkpoint import fp32_folder
from specstep.engine.model_source import default_target, resolve_model
from specstep.engine.sampling_params import SamplingParams

FORMS = {"bf16 rows (default)": ("auto", "auto"), "bf16 rows, exact (--activations fp32)": ("auto", "fp32"),
         "Q8_0 at load (--quantization q8_0)": ("q8_0", "auto"), "fp32 (--quantization none)": ("none", "fp32")}


def write_folder(out: Path) -> None:
    import transformers

    src = fp32_folder(resolve_model(default_target().reference))
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(torch.bfloat16)
    model.save_pretrained(out)
    shutil.copy(src / "tokenizer.json", out / "tokenizer.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/smollm2-135m-bf16"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    if not (args.out / "config.json").is_file():
        write_folder(args.out)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    prompts = code_prompts(args.prompts, 64, seed=1, model=args.out)
    seen: dict[tuple[str, int], list[float]] = {(name, b): [] for name in FORMS for b in args.batches}
    outputs: dict[str, list[list[int]]] = {}
    for i in range(args.repeats):
        for batch in args.batches:
            for name, (quantization, activations) in FORMS.items():
                # (inline with 2 threads: what the CLI runs on CPU; the library's default overlaps, on 1 thread)
                cfg = EngineConfig(model=str(args.out), spec="none", quantization=quantization,
                                   activations=activations, overlap=False, threads=2)
                r = run_engine(cfg, prompts if batch > 1 else prompts[:2], params, batch)
                seen[name, batch].append(r.tok_per_s)
                outputs.setdefault(name, r.outputs[:2])
                console.print(f"repeat {i + 1}, batch {batch}, {name}: {r.tok_per_s:.1f} tok/s")
    console.print(f"{args.out}, {machine()}; tok/s, median [min-max] of {args.repeats}:")
    for (name, batch), figures in seen.items():
        console.print(f"  batch {batch}, {name}: {statistics.median(figures):.1f} "
                      f"[{min(figures):.1f}-{max(figures):.1f}]")
    ref = outputs[next(iter(FORMS))]
    for name, out in outputs.items():
        same = sum(a == b for a, b in zip(out, ref))
        first = min((next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(out, ref)))
        console.print(f"  {name}: {same}/{len(ref)} outputs equal the bf16 rows', first difference at token {first}")


if __name__ == "__main__":
    main()
