"""llama.cpp side of `bench_peers`: runs inside the llama-cpp-python venv (benchmarks/setup_llamacpp.sh), imports
nothing of ours.

    .venv-llamacpp/bin/python benchmarks/peer_llamacpp.py JOB.json OUT.json

JOB: {"gguf": FILE, "prompts": {set: [[ids]]}, "new_tokens": N, "modes": ["plain", "prompt lookup"], "k": 4,
      "threads": 2}. OUT: per (mode, set, "b1"): seconds (every prompt's generation, prompt evaluation included, as
the other engines are timed), prompt_seconds (prompt evaluation plus the first token's sampling), tokens and the
output token ids. Batch 1 only: `Llama` holds one sequence.

The GGUF runs as llama.cpp runs it, Q4_1 weights in its own kernels. Greedy through `Llama.generate`, which does
not stop at an end-of-sequence token (the create_* methods do): reading exactly N tokens is `ignore_eos`.
Prompt lookup is `LlamaPromptLookupDecoding(num_pred_tokens=k)` as the `draft_model`, its default n-gram size.
"""

from __future__ import annotations

import json
import sys
import time


def load(job: dict, mode: str):
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=job["k"]) if mode == "prompt lookup" else None
    longest = max(len(p) for prompts in job["prompts"].values() for p in prompts)
    return Llama(model_path=job["gguf"], n_ctx=longest + job["new_tokens"] + 64, n_threads=job["threads"],
                 n_threads_batch=job["threads"], draft_model=draft, seed=0, verbose=False)


def generate(llm, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float]:
    """(tokens, seconds, prompt seconds). The reset drops the KV cache: no prefix reuse from the last prompt."""
    llm.reset()
    out, t0 = [], time.perf_counter()
    t_first = t0
    for token in llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True):
        if not out:
            t_first = time.perf_counter()
        out.append(int(token))
        if len(out) == new_tokens:
            break
    return out, time.perf_counter() - t0, t_first - t0


def run_mode(job: dict, mode: str) -> dict:
    llm = load(job, mode)
    generate(llm, next(iter(job["prompts"].values()))[0], 8)  # warm-up
    out = {}
    for name, prompts in job["prompts"].items():
        runs = [generate(llm, p, job["new_tokens"]) for p in prompts]
        out[f"{mode}/{name}/b1"] = {"seconds": sum(r[1] for r in runs), "prompt_seconds": sum(r[2] for r in runs),
                                    "tokens": sum(len(r[0]) for r in runs), "outputs": [r[0] for r in runs]}
    llm.close()
    return out


def main() -> None:
    job = json.load(open(sys.argv[1]))
    results = {"version": __import__("llama_cpp").__version__}
    for mode in job["modes"]:
        results.update(run_mode(job, mode))
    json.dump(results, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
