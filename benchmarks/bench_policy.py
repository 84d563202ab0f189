"""Knowing when to stop, measured: the adaptive policy against speculation off and every fixed k, side by side.

Workloads (closed loop, `concurrency` requests in flight):
    code     held-out standard-library code, greedy
    prose    Python's own documentation text (pydoc_data), sampled at temperature 1.0
    random   uniformly random prompt tokens, sampled at temperature 1.0
    mix      half code (greedy), half random (temperature 1.0), in one batch

Settings: off (no proposer), k=1/2/4 (fixed), adaptive (throughput objective), latency (adaptive with the
latency objective, p99 ITL budget 1.1x a plain step). Models: the pretrained default (SmolLM2) with n-gram and
with its shipped MTP head; the embedded toy target with its draft model. Each engine first serves a warm-up of
the same workload (a server runs for hours: the policy's measurements are warm), then rounds of waves run on
each engine in turn, alternating the order (ratios are of totals; the spread is the per-round range). ITL is
the gap between a request's consecutive token-carrying outputs, as a streaming client sees it.

    python -m benchmarks.bench_policy [--proposers ngram,mtp,draft_model] [--workloads ...] [--concurrency 1,4,16]
                                      [--streams inline,overlap]

`--streams`: the engine's stream path, inline (the CPU default) or overlap (the worker-thread stream that
stands in for CUDA's: step N+1 decided and built while step N runs; one torch thread, as serve sets it).

The held-out shape (`--heldout`; `heldout.py`): what a user's `specstep generate` sees, every engine started afresh.

    python -m benchmarks.bench_policy --heldout [--rounds 3] [--out benchmarks/results/policy_heldout.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np

from benchmarks.common import code_prompts, console, machine
from specstep.engine.engine_config import DEFAULT_TARGET, EngineConfig
from specstep.engine.model_source import pretrained_gguf, resolve_model
from specstep.engine.sampling_params import SamplingParams
from specstep.engine.tokenizer import Tokenizer
from specstep.scheduler.build import build_engine
from specstep.scheduler.core.request import Request

SETTINGS = ("off", "k1", "k2", "k4", "adaptive", "latency")
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
HOT = SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True)


def prose_prompts(tok: Tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    texts = [t for t in topics.values() if len(t) > 2000]
    out = []
    for _ in range(n):
        ids = tok.encode(rng.choice(texts))
        start = rng.randrange(0, max(1, len(ids) - length))
        out.append(ids[start:start + length])
    return out


def workload(kind: str, n: int, model: str, vocab: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    tok = Tokenizer.from_folder(model)
    rng = random.Random(seed)
    code = code_prompts(n, 64, seed, Path(model))
    rand = [[rng.randrange(100, vocab) for _ in range(64)] for _ in range(n)]
    if kind == "code":
        return [(p, GREEDY) for p in code]
    if kind == "prose":
        return [(p, HOT) for p in prose_prompts(tok, n, 64, seed)]
    if kind == "random":
        return [(p, HOT) for p in rand]
    return [(code[i], GREEDY) if i % 2 == 0 else (rand[i], HOT) for i in range(n)]


def config(model: str, proposer: str, setting: str, overlap: bool = False) -> EngineConfig:
    base = dict(model=model, device="cpu", overlap=overlap, threads=1 if overlap else 2, kv_cache_tokens=16384,
                max_batch_size=16)
    if setting == "off":
        return EngineConfig(**base, spec="none")
    if setting.startswith("k"):
        return EngineConfig(**base, spec=proposer, spec_policy="fixed", num_spec_tokens=int(setting[1:]))
    return EngineConfig(**base, spec=proposer, spec_policy="adaptive", num_spec_tokens=4,
                        spec_objective="latency" if setting == "latency" else "throughput")


def measure_cell(model: str, proposer: str, settings: list[str], kind: str, concurrency: int, vocab: int,
                 rounds: int, wave: int, overlap: bool = False) -> dict[str, dict]:
    """Every setting's engine is built once and warmed up; then `rounds` rounds run one wave of the workload
    on each engine in turn (order alternating), so slow drifts of a shared machine hit every setting alike."""
    engines = {s: build_engine(config(model, proposer, s, overlap))[0] for s in settings}
    for core in engines.values():
        warm = [(p, SamplingParams(temperature=sp.temperature, max_tokens=24, ignore_eos=True))
                for p, sp in workload(kind, concurrency, model, vocab, seed=7)]
        run_closed_loop(core, warm, concurrency, 10**6)
    n = max(2, wave * concurrency)
    acc = {s: {"tokens": 0, "seconds": 0.0, "gaps": [], "steps": 0, "spec_steps": 0, "ratios": []} for s in settings}
    for r in range(rounds):
        work = workload(kind, n, model, vocab, seed=100 + r)
        order = settings if r % 2 == 0 else settings[::-1]
        res = {s: run_closed_loop(engines[s], work, concurrency, 1000 * (r + 1)) for s in order}
        for s in settings:
            a = acc[s]
            for key in ("tokens", "seconds", "steps", "spec_steps"):
                a[key] += res[s][key]
            a["gaps"] += res[s]["gaps"]
            if "off" in res:
                rate = {x: res[x]["tokens"] / res[x]["seconds"] for x in (s, "off")}
                a["ratios"].append(rate[s] / rate["off"])
                # Greedy outputs must not depend on the setting (lossless).
                assert res[s]["greedy"] == res["off"]["greedy"], f"{s} changed greedy output on {kind}"
    out = {}
    for s, a in acc.items():
        out[s] = {"tok_s": a["tokens"] / a["seconds"], "itl_p99_ms": float(np.percentile(a["gaps"], 99)) * 1e3,
                  "spec_fraction": a["spec_steps"] / max(a["steps"], 1),
                  "spread": (min(a["ratios"]), max(a["ratios"])) if a["ratios"] else (0.0, 0.0),
                  "policy": dict(engines[s].policy.reasons) if s in ("adaptive", "latency") else {}}
    for core in engines.values():
        core.stream.close()
    return out


def run_closed_loop(core, work, concurrency: int, seed0: int) -> dict:
    reqs = [Request(str(seed0 + i), list(p), sp, seed=seed0 + i) for i, (p, sp) in enumerate(work)]
    pending, live, last, gaps = list(reqs), [], {}, []
    steps = spec_steps = 0
    start = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            live.append(pending.pop(0))
            core.add_request(live[-1])
        outs = core.step()
        now = time.perf_counter()
        d = core.last_decision
        steps += 1
        spec_steps += bool(d is not None and d.num_draft.any())
        for o in outs:
            if o.new_token_ids:
                rid = o.request.request_id
                if rid in last:
                    gaps.append(now - last[rid])
                last[rid] = now
        live = [r for r in live if not r.finished]
    return {"tokens": sum(r.num_output_tokens for r in reqs), "seconds": time.perf_counter() - start, "gaps": gaps,
            "steps": steps, "spec_steps": spec_steps,
            "greedy": [r.output_token_ids for r in reqs if r.params.temperature == 0.0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proposers", default="ngram,mtp,draft_model")
    ap.add_argument("--workloads", default="code,prose,random,mix")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--rounds", type=int, default=2, help="waves per setting, interleaved across settings")
    ap.add_argument("--wave", type=int, default=1, help="requests per wave, in multiples of the concurrency")
    ap.add_argument("--streams", default="inline", help="inline, overlap or both (comma-separated)")
    ap.add_argument("--json", type=Path, default=None, help="also write every measurement here")
    ap.add_argument("--heldout", action="store_true", help="the held-out shape instead (see benchmarks/heldout.py)")
    ap.add_argument("--out", type=Path, default=None, help="--heldout: where to write the results")
    args = ap.parse_args()
    if args.heldout:
        from benchmarks.heldout import run_heldout

        run_heldout(max(args.rounds, 3), args.out)
        return
    settings = args.settings.split(",")
    gguf = pretrained_gguf()
    all_rows = []
    console.print(f"machine: {machine()}")
    for stream in args.streams.split(","):
        if stream not in ("inline", "overlap"):
            raise SystemExit(f"--streams: inline or overlap, got {stream!r}")
        for proposer in args.proposers.split(","):
            model = str(DEFAULT_TARGET) if proposer == "draft_model" or gguf is None else str(resolve_model(str(gguf)))
            vocab = Tokenizer.from_folder(model).vocab_size
            rows = []
            for kind in args.workloads.split(","):
                for c in (int(x) for x in args.concurrency.split(",")):
                    med = measure_cell(model, proposer, settings, kind, c, vocab, args.rounds, args.wave,
                                       stream == "overlap")
                    rows.append((kind, c, med))
                    all_rows.append({"stream": stream, "proposer": proposer, "workload": kind, "concurrency": c,
                                     "results": med})
                    print_row(f"{proposer} [{stream}]", kind, c, med, settings)
            print_table(f"{proposer} [{stream}]", model, rows, settings)
    if args.json:
        args.json.write_text(json.dumps(all_rows, indent=1))


def print_row(proposer, kind, c, med, settings) -> None:
    off = med.get("off", {}).get("tok_s") or 1.0
    parts = [f"{s} {med[s]['tok_s'] / off:.2f}x ({med[s]['spread'][0]:.2f}-{med[s]['spread'][1]:.2f})"
             for s in settings]
    console.print(f"{proposer} {kind} c={c}: off {off:.1f} tok/s; " + ", ".join(parts), highlight=False,
                  soft_wrap=True)


def print_table(proposer: str, model: str, rows, settings) -> None:
    spec = [s for s in settings if s != "off"]
    head = ["workload", "conc.", "off tok/s", *spec, "p99 ITL off / adaptive / latency (ms)", "adaptive drafts"]
    lines = [f"\n{proposer} on {Path(model).name} (tokens/s relative to off; p99 ITL in ms)\n",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for kind, c, med in rows:
        off = med.get("off", {}).get("tok_s") or 1.0
        ratios = [med[s]["tok_s"] / off for s in spec]
        best_fixed = max((r for s, r in zip(spec, ratios) if s.startswith("k")), default=0.0)
        cells = [f"**{r:.2f}**" if s == "adaptive" and r >= best_fixed else f"{r:.2f}" for s, r in zip(spec, ratios)]
        itl = " / ".join(f"{med[s]['itl_p99_ms']:.0f}" for s in ("off", "adaptive", "latency") if s in med)
        frac = f"{med['adaptive']['spec_fraction']:.2f}" if "adaptive" in med else ""
        lines.append(f"| {kind} | {c} | {off:.1f} | " + " | ".join(cells) + f" | {itl} | {frac} |")
    console.print("\n".join(lines), highlight=False, markup=False, soft_wrap=True)


if __name__ == "__main__":
    main()
