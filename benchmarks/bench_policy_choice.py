"""The adaptive policy's n-gram choices against fixed k, judged without the host's noise: each run's decode steps
and drafted rows priced by a fixed cost model, a decode step 1 and a verify row `row_cost` of it (bench_steps'
(verify(k+1) - decode) / (k x decode) on the host you care about), so two runs of different builds compare their
choices, not the machine's load during them.

    python -m benchmarks.bench_policy_choice [--row-costs fp32=0.248,int8=0.348] [--prompts 16] [--seeds 1,7]

Batch 1, greedy, held-out code prompts (bench_peers' set), 96 new tokens. tokens per decode cost = decode tokens /
(decode steps + row_cost x drafted rows); each prompt's first token (from its prefill) is not counted.
"""

from __future__ import annotations

import argparse

from benchmarks.common import code_prompts, machine, run_engine, table
from specstep.engine.engine_config import EngineConfig
from specstep.engine.model_source import default_target, resolve_model
from specstep.engine.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the serving default target")
    ap.add_argument("--row-costs", default="fp32=0.248,int8=0.348", help="activations=row cost, comma-separated")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--seeds", default="1,7", help="prompt sets")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=96)
    args = ap.parse_args()
    model = args.model or str(resolve_model(default_target().reference))
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for seed in map(int, args.seeds.split(",")):
        prompts = code_prompts(args.prompts, 128, seed=seed, model=model)
        for item in args.row_costs.split(","):
            act, cost = item.split("=")
            for policy in ("adaptive", "fixed"):
                cfg = EngineConfig(model=model, overlap=False, threads=2, num_spec_tokens=args.k, max_batch_size=8,
                                   activations=act, spec="ngram", spec_policy=policy)
                res = run_engine(cfg, prompts, params, 1)
                decoded = res.tokens - len(prompts)
                steps = decoded - res.accepted
                rows.append([seed, act, policy, res.drafted, res.accepted, steps,
                             f"{decoded / (steps + float(cost) * res.drafted):.3f}"])
    table(f"n-gram at batch 1, k = {args.k}, tokens per decode step's cost ({machine()})",
          ["prompt set", "activations", "policy", "drafted", "accepted", "decode steps", "tokens per decode cost"],
          rows)


if __name__ == "__main__":
    main()
