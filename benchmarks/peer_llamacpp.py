"""llama.cpp side of `bench_peers`: llama.cpp's own programs (built by `benchmarks/setup_llamacpp.sh` into
`.llamacpp/bin`), run as a llama.cpp user runs them, one process a prompt.

    plain:          llama-completion -f PROMPT -n N --temp 0 --ignore-eos -no-cnv --no-display-prompt -t T
    prompt lookup:  llama-lookup -f PROMPT -n N --temp 0 --ignore-eos --spec-draft-n-max K -t T
    plain, batch B: llama-batched-bench -npp P -ntg N -npl B -t T

A prompt is handed over as its text (our tokenizer's decoding of its ids; llama.cpp tokenises it again, the same
tokens for these prompts), and the greedy output comes back as the printed text, tokenised by our tokenizer for
the report's token comparisons. Time is what each program reports for its work, model load excluded:
llama-completion's prompt eval + eval + sampling times, llama-lookup's "encoded" + "decoded" times.

Batches above 1 run plain only, through llama-batched-bench, which llama.cpp provides for batched throughput: B
sequences of P synthetic prompt tokens (P the set's mean prompt length: a plain step's cost does not depend on the
token values) prefilled together, then N steps of B tokens. Its total time (prefill included) for B sequences
stands for each B of the set's prompts; it prints no text, so those rows compare no tokens.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

BIN = Path(__file__).resolve().parents[1] / ".llamacpp" / "bin"
PROGRAMS = {"plain": "llama-completion", "prompt lookup": "llama-lookup"}
BATCHED = "llama-batched-bench"


def missing(bin_dir: Path = BIN) -> str:
    """Why the programs cannot run ("" if they can)."""
    absent = [p for p in (*PROGRAMS.values(), BATCHED) if not (bin_dir / p).is_file()]
    return f"{', '.join(absent)} not in {bin_dir}: run benchmarks/setup_llamacpp.sh" if absent else ""


def version(bin_dir: Path = BIN) -> str:
    out = subprocess.run([str(bin_dir / "llama-completion"), "--version"], capture_output=True, text=True)
    found = re.search(r"version: (.+)", out.stdout + out.stderr)
    return found.group(1).strip() if found else "unknown"


def _env() -> dict[str, str]:
    """llama.cpp's own thread defaults, as a user runs it: not the PASSIVE OpenMP policy benchmarks.common sets."""
    return {key: v for key, v in os.environ.items() if key != "OMP_WAIT_POLICY"}


def _ms(log: str, label: str) -> float:
    found = re.search(rf"{label}\s*=\s*([0-9.]+) ms", log)
    if not found:
        raise RuntimeError(f"no {label!r} in llama.cpp's log:\n{log[-2000:]}")
    return float(found.group(1))


def _seconds(log: str, label: str) -> float:
    found = re.search(rf"{label}\s+\d+ tokens in\s+([0-9.]+) seconds", log)
    if not found:
        raise RuntimeError(f"no {label!r} line in llama-lookup's log:\n{log[-2000:]}")
    return float(found.group(1))


def generate(bin_dir: Path, gguf: Path, mode: str, prompt: str, new_tokens: int, k: int, threads: int,
             ctx: int) -> tuple[str, float, float]:
    """(generated text, seconds, prompt seconds) of one prompt."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    args = [str(bin_dir / PROGRAMS[mode]), "-m", str(gguf), "-f", f.name, "-n", str(new_tokens), "--temp", "0",
            "--ignore-eos", "-t", str(threads), "-c", str(ctx), "--seed", "0"]
    args += ["-no-cnv", "--no-display-prompt"] if mode == "plain" else ["--spec-draft-n-max", str(k)]
    try:
        out = subprocess.run(args, capture_output=True, text=True, env=_env(), check=True)
    finally:
        os.unlink(f.name)
    log = out.stderr
    if mode == "plain":
        prompt_s = _ms(log, "prompt eval time") / 1e3
        seconds = prompt_s + (_ms(log, r"(?<!prompt )eval time") + _ms(log, "sampling time")) / 1e3
        return out.stdout, seconds, prompt_s
    encoded = _seconds(log, "encoded")
    at = out.stdout.find(prompt.rstrip("\n"))  # (it echoes the prompt, after blank lines)
    text = out.stdout[at + len(prompt.rstrip("\n")):] if at >= 0 else out.stdout
    return text, encoded + _seconds(log, "decoded"), encoded


def batched(bin_dir: Path, gguf: Path, prompt_tokens: int, new_tokens: int, batch: int,
            threads: int) -> tuple[float, float]:
    """(seconds, prompt seconds) of `batch` sequences decoded together by llama-batched-bench."""
    args = [str(bin_dir / BATCHED), "-m", str(gguf), "-c", str(batch * (prompt_tokens + new_tokens) + 64),
            "-b", "2048", "-ub", "512", "-npp", str(prompt_tokens), "-ntg", str(new_tokens), "-npl", str(batch),
            "-t", str(threads)]
    out = subprocess.run(args, capture_output=True, text=True, env=_env(), check=True)
    return batched_times(out.stdout + out.stderr, prompt_tokens, batch)


def batched_times(log: str, prompt_tokens: int, batch: int) -> tuple[float, float]:
    """(T s, T_PP s) of llama-batched-bench's result row for these prompt tokens and batch:
    |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |"""
    for line in log.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0] == str(prompt_tokens) and cells[2] == str(batch):
            return float(cells[8]), float(cells[4])
    raise RuntimeError(f"no PP={prompt_tokens} B={batch} row in llama-batched-bench's output:\n{log[-2000:]}")


def run(gguf: Path, tokenizer, sets: dict[str, list[list[int]]], new_tokens: int, modes: list[str], k: int,
        threads: int, bin_dir: Path = BIN, batched_sets: dict[str, list[list[int]]] | None = None,
        batches: tuple[int, ...] = ()) -> dict:
    """Per (mode, set, "b1"): seconds, prompt_seconds, tokens and the output token ids (the printed text,
    tokenised), as `bench_peers` records every engine; per ("plain", set, "bB") for each batch B > 1, the same
    from llama-batched-bench over `batched_sets` (no output ids)."""
    longest = max((len(p) for prompts in sets.values() for p in prompts), default=0)
    out: dict = {"version": version(bin_dir)}
    for mode in modes if sets else ():
        generate(bin_dir, gguf, mode, tokenizer.decode(next(iter(sets.values()))[0]), 8, k, threads, 512)  # warm
        for name, prompts in sets.items():
            runs = [generate(bin_dir, gguf, mode, tokenizer.decode(p), new_tokens, k, threads,
                             longest + new_tokens + 64) for p in prompts]
            outputs = [tokenizer.encode(text)[:new_tokens] for text, _, _ in runs]
            out[f"{mode}/{name}/b1"] = {"seconds": sum(r[1] for r in runs), "prompt_seconds": sum(r[2] for r in runs),
                                        "tokens": len(prompts) * new_tokens, "outputs": outputs}
    for b in (b for b in batches if b > 1 and "plain" in modes):
        for name, prompts in (batched_sets or {}).items():
            mean_prompt = round(sum(len(p) for p in prompts) / len(prompts))
            seconds, prompt_s = batched(bin_dir, gguf, mean_prompt, new_tokens, b, threads)
            share = len(prompts) / b  # the program's B sequences stand for each B of the set's prompts
            out[f"plain/{name}/b{b}"] = {"seconds": seconds * share, "prompt_seconds": prompt_s * share,
                                         "tokens": len(prompts) * new_tokens, "outputs": []}
    return out
