"""What n-gram speculation can reach on a prompt set, whatever the kernels: the target's greedy outputs replayed
through prompt lookups, as one chain of drafts (the engine's proposer) and as a tree of the continuations of
several earlier matches verified at once (as SpecInfer / Lookahead-style tree verification would).

    python -m benchmarks.bench_ngram_replay [--prompts 32] [--row-costs fp32=0.248,int8=0.348]

Batch 8 generates each activation's greedy outputs (held-out code, 128-token prompts, 96 new tokens); the replay
then walks each output: a step drafts from the context so far, accepts the longest draft prefix (tree: the longest
over its branches) that the output continues with, and emits that plus one token. Reported per step: tokens
emitted, draft rows verified (a tree's distinct prefixes), and tokens per decode-step cost with a step priced
1 + row_cost x rows (row_cost: bench_steps' (verify(k+1) - decode) / (k x decode) on the host you care about; the
default is bench_policy_choice's, measured on an AVX2 EPYC host; the AMX Xeon hosts measured fp32 0.10, int8 0.07).
With a free verify row, tokens per step is the most any kernel could make of the proposer on these prompts.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np

from benchmarks.common import code_prompts, machine, run_engine, table
from specstep.engine.engine_config import EngineConfig
from specstep.engine.model_source import default_target, resolve_model
from specstep.engine.proposers.ngram import ngram_lookup
from specstep.engine.sampling_params import SamplingParams

Drafter = Callable[[np.ndarray], list[tuple[int, ...]]]


def chain(k: int, ratio: float) -> Drafter:
    """The engine's lookup: one chain of at most k drafts."""
    return lambda ctx: [tuple(ngram_lookup(ctx, k, 1, 4, ratio))]


def tree(depth: int, branches: int, max_n: int = 4) -> Drafter:
    """The continuations (depth tokens) of the most recent matches, longest suffix first then shorter ones, up to
    `branches` that are not a prefix of one already taken."""
    def draft(ctx: np.ndarray) -> list[tuple[int, ...]]:
        length, taken = len(ctx), []
        for n in range(min(max_n, length - 1), 0, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:length - 1], n)
            for hit in np.flatnonzero((windows == ctx[length - n:]).all(axis=1))[::-1]:
                cont = tuple(ctx[hit + n:hit + n + depth].tolist())
                if cont and not any(t[:len(cont)] == cont for t in taken):
                    taken.append(cont)
                    if len(taken) == branches:
                        return taken
        return taken
    return draft


def replay(prompts: list[list[int]], outputs: list[list[int]], drafter: Drafter) -> tuple[int, int, int]:
    """(tokens, steps, draft rows) of greedy speculation with `drafter` over the known outputs."""
    tokens = steps = rows = 0
    for prompt, out in zip(prompts, outputs):
        seq = np.array(prompt + out, dtype=np.int64)
        i = 0
        while i < len(out):
            branches = drafter(seq[:len(prompt) + i])
            best = 0
            for b in branches:
                a = 0
                while a < len(b) and i + a < len(out) and b[a] == out[i + a]:
                    a += 1
                best = max(best, a)
            emitted = min(best + 1, len(out) - i)
            i += emitted
            tokens, steps = tokens + emitted, steps + 1
            rows += len({b[:j] for b in branches for j in range(1, len(b) + 1)})  # a tree's distinct prefixes
    return tokens, steps, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the serving default target")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--row-costs", default="fp32=0.248,int8=0.348", help="activations=row cost, comma-separated")
    args = ap.parse_args()
    model = str(resolve_model(args.model or default_target().reference))
    prompts = code_prompts(args.prompts, 128, seed=args.seed, model=model)
    # chain k (the engine's, bounded by the match: --ngram-match-ratio 1), unbounded (ratio 0); tree depth x branches
    drafters = {"chain 4": chain(4, 1.0), "chain 4 unbounded": chain(4, 0.0),
                "chain 8": chain(8, 1.0), "chain 8 unbounded": chain(8, 0.0)}
    drafters |= {f"tree {d}x{b}": tree(d, b) for d in (4, 8) for b in (2, 4)}
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for item in args.row_costs.split(","):
        activations, row_cost = item.split("=")
        cfg = EngineConfig(model=model, spec="none", overlap=False, threads=2, max_batch_size=8,
                           activations=activations)
        outputs = run_engine(cfg, prompts, params, batch=8).outputs
        for name, drafter in drafters.items():
            tokens, steps, drafted = replay(prompts, outputs, drafter)
            rows.append([activations, name, tokens / steps, drafted / steps,
                         tokens / (steps + float(row_cost) * drafted)])
    table(f"n-gram replay, {args.prompts} held-out code prompts, {args.new_tokens} tokens ({machine()})",
          ["act.", "drafts", "tokens/step", "rows/step", "tokens/cost"], rows)


if __name__ == "__main__":
    main()
