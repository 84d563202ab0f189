"""One sampling draw over [N, V], the engine's (inverse CDF: one hash a row, a float64 cumsum, a binary search)
beside the exponential race it replaced (argmax(p / E), E ~ Exp(1) from V hashes a row), and a greedy argmax
for scale. Settings alternate; the table gives the best of the rounds (ms per draw) and the ratios.

    python -m benchmarks.bench_draw [--vocab 49152] [--rows 4,20] [--threads 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from specstep.engine.random import mix32, uniform
from specstep.engine.sampler import sample_from_probs


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The replaced draw, reproduced with the same passes over [N, V]: a counter hash per (row, token), then
    argmax(p / E) with E = -log u."""
    keys = uniform(seeds, positions, 0)  # per-row key material, as engine.random derived it
    cols = mix32(torch.arange(probs.shape[-1], dtype=torch.int64) + 0x9E3779B9)
    h = mix32((keys * 2**32).long() ^ cols)
    e = -torch.log((h.double() + 0.5) * (1.0 / 2**32))
    return (probs.double() / e).argmax(dim=-1)


def timed(fn, reps: int = 10) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    p.add_argument("--rows", default="4,20")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for n in (int(x) for x in args.rows.split(",")):
        fns = draws(torch.rand(n, args.vocab).softmax(-1), torch.arange(n), torch.arange(n) + 7)
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.rounds):  # alternate: host noise lands on every setting alike
            for name, f in fns.items():
                times[name].append(timed(f))
        best = {name: min(ts) for name, ts in times.items()}
        print(f"rows {n}, vocab {args.vocab}, {args.threads} thread(s), best of {args.rounds} rounds:")
        for name, ms in best.items():
            print(f"  {name:28s} {ms:8.2f} ms   {ms / best['inverse CDF (engine)']:6.2f}x the engine's draw")


def draws(probs: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor) -> dict:
    return {"inverse CDF (engine)": lambda: sample_from_probs(probs, seeds, pos, 0),
            "exponential race (before)": lambda: exponential_race(probs, seeds, pos),
            "greedy argmax": lambda: probs.argmax(-1)}

if __name__ == "__main__":
    main()
