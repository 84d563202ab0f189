"""llama.cpp side of `bench_peers`: llama.cpp's own programs (built by `benchmarks/setup_llamacpp.sh` into
`.llamacpp/bin`), run as a llama.cpp user runs them, one process a prompt.

    plain:          llama-completion -f PROMPT -n N --temp 0 --ignore-eos -no-cnv --no-display-prompt -t T
    prompt lookup:  llama-lookup -f PROMPT -n N --temp 0 --ignore-eos --spec-draft-n-max K -t T

A prompt is handed over as its text (our tokenizer's decoding of its ids; llama.cpp tokenises it again, the same
tokens for these prompts), and the greedy output comes back as the printed text, tokenised by our tokenizer for
the report's token comparisons. Time is what each program reports for its work, model load excluded:
llama-completion's prompt eval + eval + sampling times, llama-lookup's "encoded" + "decoded" times. Batch 1 only.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

BIN = Path(__file__).resolve().parents[1] / ".llamacpp" / "bin"
PROGRAMS = {"plain": "llama-completion", "prompt lookup": "llama-lookup"}


def missing(bin_dir: Path = BIN) -> str:
    """Why the programs cannot run ("" if they can)."""
    absent = [p for p in PROGRAMS.values() if not (bin_dir / p).is_file()]
    return f"{', '.join(absent)} not in {bin_dir}: run benchmarks/setup_llamacpp.sh" if absent else ""


def version(bin_dir: Path = BIN) -> str:
    out = subprocess.run([str(bin_dir / "llama-completion"), "--version"], capture_output=True, text=True)
    found = re.search(r"version: (.+)", out.stdout + out.stderr)
    return found.group(1).strip() if found else "unknown"


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
    # llama.cpp's own thread defaults, as a user runs it: not the PASSIVE OpenMP policy benchmarks.common sets
    env = {key: v for key, v in os.environ.items() if key != "OMP_WAIT_POLICY"}
    try:
        out = subprocess.run(args, capture_output=True, text=True, env=env, check=True)
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


def run(gguf: Path, tokenizer, sets: dict[str, list[list[int]]], new_tokens: int, modes: list[str], k: int,
        threads: int, bin_dir: Path = BIN) -> dict:
    """Per (mode, set, "b1"): seconds, prompt_seconds, tokens and the output token ids (the printed text,
    tokenised), as `bench_peers` records every engine."""
    longest = max(len(p) for prompts in sets.values() for p in prompts)
    out: dict = {"version": version(bin_dir)}
    for mode in modes:
        generate(bin_dir, gguf, mode, tokenizer.decode(next(iter(sets.values()))[0]), 8, k, threads, 512)  # warm
        for name, prompts in sets.items():
            runs = [generate(bin_dir, gguf, mode, tokenizer.decode(p), new_tokens, k, threads,
                             longest + new_tokens + 64) for p in prompts]
            outputs = [tokenizer.encode(text)[:new_tokens] for text, _, _ in runs]
            out[f"{mode}/{name}/b1"] = {"seconds": sum(r[1] for r in runs), "prompt_seconds": sum(r[2] for r in runs),
                                        "tokens": len(prompts) * new_tokens, "outputs": outputs}
    return out
