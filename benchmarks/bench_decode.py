"""Plain greedy decode throughput of the serving default target: specstep at batch 1, 8 and 32 against transformers'
`generate` at batch 1, same checkpoint, same prompts, same thread count, one run.

    python -m benchmarks.bench_decode [--new-tokens 128] [--prompt-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.common import code_prompts, console, machine, run_engine, table
from specstep.engine.engine_config import EngineConfig
from specstep.engine.gguf_checkpoint import fp32_folder
from specstep.engine.model_source import default_target, resolve_model
from specstep.engine.sampling_params import SamplingParams


def transformers_tok_per_s(model_dir: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        for p in prompts:
            g = hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            outs.append(g[0, len(p):].tolist())
        seconds = time.perf_counter() - start
    return len(prompts) * new_tokens / seconds, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="default: the serving default target")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--batch-1-prompts", type=int, default=4)
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--overlap", action="store_true", help="worker-thread stream (default off: the CPU default)")
    args = ap.parse_args()
    args.model = str(fp32_folder(resolve_model(args.model or default_target().reference)))  # (transformers too)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    prompts = code_prompts(64, args.prompt_tokens, seed=1, model=args.model)
    cfg = EngineConfig(model=args.model, spec="none", overlap=args.overlap)
    results = {}
    for batch, n in ((1, args.batch_1_prompts), (8, 16), (32, 64)):
        r = run_engine(cfg, prompts[:n], params, batch)
        results[f"specstep_b{batch}"] = r.tok_per_s
        if batch == 1:
            b1_outputs = r.outputs
        console.print(f"specstep batch {batch}: {r.tok_per_s:.1f} tok/s")
    # transformers runs with the thread count the engine set (2 inline, 1 with overlap): same settings.
    hf, hf_outputs = transformers_tok_per_s(args.model, prompts[:args.batch_1_prompts], args.new_tokens)
    results["transformers_b1"] = hf
    same = sum(a == b for a, b in zip(b1_outputs, hf_outputs))
    rows = [["transformers generate", 1, hf, 1.0, ""]]
    for batch in (1, 8, 32):
        tps = results[f"specstep_b{batch}"]
        rows.append(["specstep", batch, tps, tps / hf, f"{tps / results['specstep_b1']:.2f}x own b1"])
    table(f"greedy decode, {args.new_tokens} new tokens, held-out stdlib prompts ({machine()})",
          ["engine", "batch", "tok/s", "vs transformers b1", "scaling"], rows)
    console.print(f"batch-1 outputs identical to transformers: {same}/{len(hf_outputs)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
