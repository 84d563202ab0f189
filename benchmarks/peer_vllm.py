"""vLLM-CPU side of `bench_peers`: runs inside the vLLM venv (benchmarks/setup_vllm.sh), imports nothing of ours.

    .vllm-venv/bin/python benchmarks/peer_vllm.py JOB.json OUT.json

JOB: {"model": DIR, "dtype": "float32", "prompts": {set: [[ids]]}, "new_tokens": N, "batches": [1, 8],
      "modes": ["plain", "ngram"], "k": 4, "threads": 2}. OUT: per (mode, set, batch): seconds, tokens and the
output token ids. Usage follows CPU_NOTES.md: token prompts, no tokenizer, detokenize off, ignore_eos, the
checkpoint's own dtype, `__main__` guard.
"""

from __future__ import annotations

import json
import os
import sys
import time


def run_mode(job: dict, mode: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None if mode == "plain" else {"method": "ngram", "num_speculative_tokens": job["k"],
                                         "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    llm = LLM(model=job["model"], skip_tokenizer_init=True, dtype=job.get("dtype", "float32"), max_model_len=2048,
              max_num_seqs=max(job["batches"]), speculative_config=spec, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=job["new_tokens"], ignore_eos=True, detokenize=False)
    first = next(iter(job["prompts"].values()))[0]
    llm.generate([TokensPrompt(prompt_token_ids=first)], params, use_tqdm=False)  # warm-up
    out = {}
    for name, prompts in job["prompts"].items():
        for batch in job["batches"]:
            outputs, tokens, seconds = [], 0, 0.0
            for i in range(0, len(prompts), batch):
                group = [TokensPrompt(prompt_token_ids=p) for p in prompts[i:i + batch]]
                t0 = time.perf_counter()
                res = llm.generate(group, params, use_tqdm=False)
                seconds += time.perf_counter() - t0
                for r in res:
                    ids = list(r.outputs[0].token_ids)
                    outputs.append(ids)
                    tokens += len(ids)
            out[f"{mode}/{name}/b{batch}"] = {"seconds": seconds, "tokens": tokens, "outputs": outputs}
    return out


def main() -> None:
    job = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("OMP_NUM_THREADS", str(job.get("threads", 2)))
    results = {"version": __import__("vllm").__version__}
    for mode in job["modes"]:
        results.update(run_mode(job, mode))
    json.dump(results, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
