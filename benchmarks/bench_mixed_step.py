"""A chunked-prefill mixed step on the real engine: the running batch's speculative decode step and a prompt chunk
in one forward (`StepEngine.run_mixed`) against the decode step, then a prompt forward of the chunk's own, per
chunk size and context (how far into its prompt the chunk is), the two ways alternating every repetition. And a
prefill of prompts of mixed lengths (each prompt's attention apart, or in one part where the C++ kernel takes it).

    python -m benchmarks.bench_mixed_step [--streams 4] [--k 4] [--chunks 8,32,64] [--contexts 0,1500,2900]
                                          [--reps 7]

Default model and kernels (int8 activations over GGUF blocks), n-gram speculation at a fixed k, 2 threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from benchmarks.common import machine, table
from specstep.engine.engine_config import EngineConfig
from specstep.engine.model_source import default_target, resolve_model
from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler.build import build_engine
from specstep.scheduler.core.request import Request

STREAM_CONTEXT = 200  # the running streams' tokens
MARGIN = 64  # pages past a request's tokens: a step's verify window and look-ahead


def ms(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t0) * 1e3


class Pages:
    """Hands out consecutive pages (page 0 is the dummy page); the engine's allocator is not in the way here."""

    def __init__(self, page_size: int) -> None:
        self.page_size, self.next = page_size, 1

    def request(self, rid: str, tokens: list[int], slot: int) -> Request:
        r = Request(rid, tokens, SamplingParams(temperature=0.0, max_tokens=1), seed=0)
        n = -(-(len(tokens) + MARGIN) // self.page_size)
        r.page_table, r.slot = list(range(self.next, self.next + n)), slot
        self.next += n
        return r


def prefill(engine, prompts: list[Request]) -> None:
    """The prompts from their first token, in one forward (the proposer does not consume them)."""
    for p in prompts:
        p.num_computed = 0
    engine.prefill(prompts, False).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the serving default target")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--chunks", default="8,32,64")
    ap.add_argument("--contexts", default="0,1500,2900")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    chunks = [int(q) for q in args.chunks.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    model = str(resolve_model(args.model or default_target().reference))
    core = build_engine(EngineConfig(model=model, spec="ngram", num_spec_tokens=args.k, spec_policy="fixed",
                                     threads=args.threads, max_batch_size=args.streams + 8, kv_cache_tokens=32768,
                                     device="cpu"))[0]
    engine = core.engine
    rng = np.random.default_rng(0)
    pages = Pages(engine.page_size)
    tokens = lambda n: rng.integers(100, 20_000, n).tolist()
    streams = [pages.request(f"s{i}", tokens(STREAM_CONTEXT), i) for i in range(args.streams)]
    engine.prefill(streams).tolist()
    for s in streams:  # running: the last token is fed by the next step
        s.num_computed = len(s.token_ids)
        s.token_ids.append(5)
    long = pages.request("long", tokens(max(contexts) + max(chunks)), args.streams)
    engine.prefill([long], True, [max(contexts)]).tolist()  # its KV up to the deepest context timed
    drafts = np.full(args.streams, args.k)

    def decode() -> None:
        engine.run_decode(engine.plan_decode(streams, drafts)).read()

    def fused(q: int, ctx: int) -> None:
        long.num_computed = ctx
        out, first = engine.run_mixed(engine.plan_decode(streams, drafts), [long], [True], [q])
        out.read(), first.tolist()

    def apart(q: int, ctx: int) -> None:
        decode()
        long.num_computed = ctx
        engine.prefill([long], True, [q]).tolist()

    load = os.getloadavg()[0]
    for _ in range(2):  # warm-up: thread choices, first touches
        decode(), fused(chunks[0], 0), apart(chunks[0], 0)
    decode_ms = statistics.median(ms(decode) for _ in range(args.reps))
    rows = []
    for ctx in contexts:
        for q in chunks:
            f, a = [], []
            for _ in range(args.reps):  # alternating: a neighbour's burst slows both alike
                f.append(ms(fused, q, ctx))
                a.append(ms(apart, q, ctx))
            fm, am = statistics.median(f), statistics.median(a)
            rows.append([ctx, q, f"{fm:.1f} [{min(f):.1f}-{max(f):.1f}]", f"{fm - decode_ms:.1f}",
                         f"{am:.1f} [{min(a):.1f}-{max(a):.1f}]", f"{am / fm:.2f}"])
    table(f"a mixed step: batch-{args.streams} n-gram verify step (k={args.k}, {decode_ms:.1f} ms alone) and one "
          f"prompt chunk, medians of {args.reps} [min-max] ({machine()}; load average {load:.1f} before)",
          ["context", "chunk tokens", "fused ms", "fused adds ms", "two forwards ms", "two / fused"], rows)

    rows = []
    for name, lens in (("16 x 128", [128] * 16), ("16 of 60-200", rng.integers(60, 200, 16).tolist()),
                       ("1000 + 300 + 50", [1000, 300, 50])):
        batch_pages = Pages(engine.page_size)
        batch_pages.next = pages.next
        prompts = [batch_pages.request(f"p{i}", tokens(n), args.streams + 1 + i % 7) for i, n in enumerate(lens)]

        prefill(engine, prompts)
        t = [ms(prefill, engine, prompts) for _ in range(args.reps)]
        rows.append([name, sum(lens), f"{statistics.median(t):.0f} [{min(t):.0f}-{max(t):.0f}]"])
    table(f"a prefill of prompts of mixed lengths, medians of {args.reps} [min-max] ({machine()})",
          ["prompts", "tokens", "ms"], rows)
    core.stream.close()


if __name__ == "__main__":
    main()
