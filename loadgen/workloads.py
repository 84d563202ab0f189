"""Request streams for the load generator.

- `code`: completion of held-out standard-library code (files the default models never trained on), greedy:
  the predictable case, where speculation should pay.
- `random`: random-token prompts sampled at temperature 1.0: the unpredictable case, where it should not.
- `mix`: the two interleaved, half each.
Outputs ignore EOS by default, so every request produces exactly max_tokens and runs are comparable.
"""

from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from specstep.scheduler.server.protocol import GenerateRequest

WORKLOADS = ("code", "random", "mix")


@dataclass(frozen=True, slots=True)
class Workload:
    kind: str = "code"
    prompt_tokens: int = 128
    max_tokens: int = 64
    ignore_eos: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.kind!r}")
        if self.prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError("prompt and output lengths must be >= 1")


def build_requests(w: Workload, n: int, vocab_size: int, model_dir: str | None) -> list[GenerateRequest]:
    """`n` requests (ids "0".."n-1"; the runner prefixes them per run)."""
    if w.kind == "code":
        kinds = ["code"] * n
    elif w.kind == "random":
        kinds = ["random"] * n
    else:
        kinds = ["code" if i % 2 == 0 else "random" for i in range(n)]
    code = iter(code_prompts(kinds.count("code"), w.prompt_tokens, model_dir, w.seed))
    rng = random.Random(w.seed + 1)
    reqs = []
    for i, kind in enumerate(kinds):
        if kind == "code":
            prompt = next(code)
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
            reqs.append(GenerateRequest(str(i), prompt=text, prompt_token_ids=ids, max_tokens=w.max_tokens,
                                        temperature=0.0, ignore_eos=w.ignore_eos))
        else:
            ids = [rng.randrange(vocab_size) for _ in range(w.prompt_tokens)]
            reqs.append(GenerateRequest(str(i), prompt_token_ids=ids, max_tokens=w.max_tokens, temperature=1.0,
                                        seed=rng.getrandbits(32), ignore_eos=w.ignore_eos))
    return reqs


def code_prompts(n: int, prompt_tokens: int, model_dir: str | None, seed: int) -> list[list[int] | str]:
    """Held-out code: exact-length token prompts through training.data when the model has a tokenizer, else
    text snippets of held-out stdlib files (about 4 characters per token) for the server to tokenize."""
    if n == 0:
        return []
    tok_file = Path(model_dir) / "tokenizer.json" if model_dir else None
    if tok_file is not None and tok_file.is_file():
        try:
            from tokenizers import Tokenizer

            from specstep.training.data import heldout_prompts

            return heldout_prompts(Tokenizer.from_file(str(tok_file)), n, prompt_tokens, seed)
        except (ImportError, ValueError):
            pass  # no training package, or no held-out file that long: fall back to text
    return _stdlib_snippets(n, prompt_tokens * 4, seed)


def _stdlib_snippets(n: int, num_chars: int, seed: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > num_chars)
    # Every 20th file (by sorted name) stands in for a held-out split when training.data is unavailable.
    files = files[::20] or files
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = files[rng.randrange(len(files))].read_text(encoding="utf-8", errors="replace")
        start = rng.randrange(len(text) - num_chars + 1)
        out.append(text[start:start + num_chars])
    return out
