"""Speculative decoding on the default models: acceptance, mean accepted length and tokens/s relative to plain
decoding, per proposer and k, at batch 1 and 8, on predictable (held-out code) and unpredictable (random-token
prompts; temperature 1.0 sampling) workloads; plus transformers' assisted generation as the peer at batch 1.

    python -m benchmarks.bench_spec [--ks 1,2,4,6] [--batches 1,8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.common import code_prompts, console, machine, random_prompts, run_engine, table
from specstep.engine.engine_config import EngineConfig
from specstep.engine.model_source import EMBEDDED_DRAFTS as DEFAULT_DRAFTS
from specstep.engine.model_source import EMBEDDED_TARGET as DEFAULT_TARGET
from specstep.engine.sampling_params import SamplingParams

WORKLOADS = {
    "code": ("held-out code, greedy", 0.0),
    "random": ("random-token prompts, greedy", 0.0),
    "code-t1": ("held-out code, temperature 1.0", 1.0),
}


def transformers_peer(target: str, draft: str, prompts: list[list[int]], new_tokens: int, k: int) -> dict[str, float]:
    """tokens/s of transformers' plain, assisted (draft model) and prompt-lookup generation at batch 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    assistant.generation_config.num_assistant_tokens = k
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    modes = {"plain": {}, "assistant_model": {"assistant_model": assistant},
             "prompt_lookup": {"prompt_lookup_num_tokens": k}}
    out = {}
    with torch.inference_mode():
        for name, kw in modes.items():
            hf.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, **kw)
            start = time.perf_counter()
            for p in prompts:
                hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                            **kw)
            out[name] = len(prompts) * new_tokens / (time.perf_counter() - start)
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ks", default="1,2,4,6")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--proposers", default="draft_model,mtp,ngram")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--json")
    return ap


def main() -> None:
    args = _parser().parse_args()
    ks = [int(x) for x in args.ks.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    proposers = args.proposers.split(",")
    target = str(DEFAULT_TARGET)
    vocab = json.load(open(DEFAULT_TARGET / "config.json"))["vocab_size"]
    results = []
    for wl in args.workloads.split(","):
        for batch in batches:
            results += _measure(args, wl, batch, ks, proposers, target, vocab)
    if not args.no_peer and 1 in batches:
        results.append(_against_peer(args, max(ks), target, results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def _measure(args: argparse.Namespace, wl: str, batch: int, ks: list[int], proposers: list[str], target: str,
             vocab: int) -> list[dict]:
    """Every proposer and k against plain decoding on workload `wl` at `batch`: printed as a table, and returned
    (greedy outputs must equal plain decoding's)."""
    label, temperature = WORKLOADS[wl]
    params = SamplingParams(temperature=temperature, max_tokens=args.new_tokens, ignore_eos=True)
    n = 4 if batch == 1 else 2 * batch
    prompts = (random_prompts(n, args.prompt_tokens, vocab, seed=2) if wl == "random"
               else code_prompts(n, args.prompt_tokens, seed=3))
    plain = run_engine(EngineConfig(model=target, spec="none", overlap=False), prompts, params, batch)
    rows = [["none", "-", plain.tok_per_s, 1.0, "-", "-"]]
    results = []
    for prop in proposers:
        for k in ks:
            cfg = EngineConfig(model=target, spec=prop, num_spec_tokens=k, spec_policy="fixed", overlap=False)
            r = run_engine(cfg, prompts, params, batch)
            if temperature == 0.0:
                assert r.outputs == plain.outputs, f"{prop} k={k}: greedy output differs from plain decoding"
            rows.append([prop, k, r.tok_per_s, r.tok_per_s / plain.tok_per_s, r.acceptance, r.mean_accepted_length])
            results.append({"workload": wl, "batch": batch, "proposer": prop, "k": k,
                            "tok_per_s": r.tok_per_s, "speedup": r.tok_per_s / plain.tok_per_s,
                            "acceptance": r.acceptance, "mean_accepted_length": r.mean_accepted_length})
    table(f"{label}, batch {batch} ({machine()})",
          ["proposer", "k", "tok/s", "vs plain", "acceptance", "mean accepted len"], rows)
    return results


def _against_peer(args: argparse.Namespace, k: int, target: str, results: list[dict]) -> dict:
    """Our best held-out code configuration at batch 1 against transformers' generation at `k`: printed, and
    returned as a result entry."""
    best = {}
    for r in results:
        if r["workload"] == "code" and r["batch"] == 1 and r["speedup"] > best.get("speedup", 0):
            best = r
    prompts = code_prompts(4, args.prompt_tokens, seed=3)
    peer = transformers_peer(target, str(DEFAULT_DRAFTS["draft_model"]), prompts, args.new_tokens, k)
    ours = run_engine(EngineConfig(model=target, spec=best["proposer"], num_spec_tokens=best["k"],
                                   spec_policy="fixed", overlap=False), prompts,
                      SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True), 1)
    rows = [[f"transformers {m} (k={k})", v, v / peer["plain"]] for m, v in peer.items()]
    rows.append([f"specstep {best['proposer']} k={best['k']}", ours.tok_per_s, ours.tok_per_s / peer["plain"]])
    table("held-out code, greedy, batch 1: the peer", ["engine", "tok/s", "vs transformers plain"], rows)
    best_peer = max(peer["assistant_model"], peer["prompt_lookup"])
    console.print(f"specstep best / transformers best assisted: {ours.tok_per_s / best_peer:.2f}x")
    return {"peer": peer, "specstep_best": ours.tok_per_s, "best": best}


if __name__ == "__main__":
    main()
