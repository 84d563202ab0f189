"""Held-out acceptance of the default target's proposers, side by side: the shipped MTP head (with its reduced
draft vocabulary and with the full vocabulary) against n-gram prompt lookup, greedy and at temperature 1.0.

    python -m benchmarks.bench_acceptance [--k 4] [--new-tokens 64] [--prompts 8]

Fixed k (the policy off), batch 8, held-out standard-library code and chat-formatted prose (bench_peers' sets).
Acceptance = accepted / drafted drafts; mean accepted length = tokens emitted per speculative step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.bench_peers import prose_prompts
from benchmarks.common import code_prompts, console, machine, run_engine, table
from specstep.engine.engine_config import EngineConfig
from specstep.engine.model_source import default_draft, default_target, resolve_model
from specstep.engine.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the serving default target")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    model = str(resolve_model(args.model or default_target().reference))
    head = default_draft("mtp", Path(model))
    sets = {"code": code_prompts(args.prompts, 128, seed=7, model=model), "prose": prose_prompts(model)[:args.prompts]}
    base = dict(model=model, overlap=False, threads=2, num_spec_tokens=args.k, spec_policy="fixed", max_batch_size=8)
    proposers = {"ngram": EngineConfig(**base, spec="ngram")}
    if head is not None:
        proposers["mtp (draft vocab)"] = EngineConfig(**base, spec="mtp")
        proposers["mtp (full vocab)"] = EngineConfig(**base, spec="mtp", draft_vocab=0)
    rows, out = [], {"machine": machine(), "k": args.k, "rows": {}}
    for name, prompts in sets.items():
        for temperature in (0.0, 1.0):
            params = SamplingParams(temperature=temperature, max_tokens=args.new_tokens, ignore_eos=True)
            for label, cfg in proposers.items():
                r = run_engine(cfg, prompts, params, batch=8)
                rows.append([name, temperature, label, r.acceptance, r.mean_accepted_length, r.drafted])
                out["rows"][f"{name}/T{temperature}/{label}"] = {
                    "acceptance": r.acceptance, "mean_accepted_length": r.mean_accepted_length, "drafted": r.drafted}
    table(f"acceptance at fixed k={args.k}, {args.new_tokens} new tokens ({machine()})",
          ["prompts", "temperature", "proposer", "acceptance", "mean accepted length", "drafted"], rows)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    console.print(f"head: {head}")


if __name__ == "__main__":
    main()
