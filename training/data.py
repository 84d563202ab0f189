"""The corpus: the Python standard library's own `.py` sources, with a deterministic held-out split.

The stdlib ships with every Python, so the default models can be retrained anywhere without downloads.
The split hashes each file's relative path (not its contents or the directory order), so it is the same on
every machine with the same Python version, and a file is never split between train and held-out.
"""

from __future__ import annotations

import random
import sysconfig
import zlib
from functools import cache
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 0
SPLITS = ("train", "heldout")
MAX_FILE_BYTES = 200_000  # a handful of huge generated tables (e.g. unicode data) would dominate otherwise
_EXCLUDED_DIRS = {"test", "tests", "idlelib", "site-packages"}  # covers lib2to3/tests too
HELDOUT_MODULUS = 20  # crc32(path) % 20 == 0: about 5% of files


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative_path: str) -> bool:
    return zlib.crc32(relative_path.encode("utf-8")) % HELDOUT_MODULUS == 0


@cache
def _all_files() -> tuple[tuple[Path, bool], ...]:
    root = stdlib_root()
    out: list[tuple[Path, bool]] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append((path, is_heldout(rel.as_posix())))
    return tuple(out)


def corpus_files(split: str) -> list[Path]:
    """Sorted source files of `split` ("train" or "heldout")."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    want_heldout = split == "heldout"
    return [p for p, held in _all_files() if held == want_heldout]


def read_source(path: Path) -> str:
    # A few stdlib files carry non-UTF-8 bytes in comments or test strings; replace rather than skip them.
    return path.read_text(encoding="utf-8", errors="replace")


# Encodings are cached per tokenizer *content* (its serialised JSON), not per object identity, so a
# reloaded copy of the same tokenizer hits the cache and a retrained one never sees stale ids.
_ENCODED: dict[tuple[int, str], list[np.ndarray]] = {}
_STREAMS: dict[tuple[int, str], np.ndarray] = {}


def _tokenizer_key(tokenizer: Tokenizer) -> int:
    return hash(tokenizer.to_str())


def encoded_files(tokenizer: Tokenizer, split: str) -> list[np.ndarray]:
    """Token ids of each file of `split` (no separators), in `corpus_files` order; cached in memory."""
    key = (_tokenizer_key(tokenizer), split)
    if key not in _ENCODED:
        texts = [read_source(p) for p in corpus_files(split)]
        encs = tokenizer.encode_batch(texts, add_special_tokens=False)
        _ENCODED[key] = [np.asarray(e.ids, dtype=np.int32) for e in encs]
    return _ENCODED[key]


def token_stream(tokenizer: Tokenizer, split: str) -> np.ndarray:
    """All files of `split` encoded and concatenated, each followed by EOS (int32); cached in memory."""
    key = (_tokenizer_key(tokenizer), split)
    if key not in _STREAMS:
        eos = np.asarray([EOS_ID], dtype=np.int32)
        parts: list[np.ndarray] = []
        for ids in encoded_files(tokenizer, split):
            parts.extend((ids, eos))
        _STREAMS[key] = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return _STREAMS[key]


def heldout_prompts(tokenizer: Tokenizer, n: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of exactly `prompt_tokens` ids, cut at random offsets from held-out files.

    Deterministic for a given seed (and Python version, which fixes the stdlib): the file is drawn uniformly
    among held-out files long enough for the prompt, so long modules do not crowd out the rest, then the
    offset uniformly within it. Used by benchmarks and the load generator as realistic, unseen prompts.
    """
    if n < 0 or prompt_tokens <= 0:
        raise ValueError("n must be >= 0 and prompt_tokens > 0")
    candidates = [ids for ids in encoded_files(tokenizer, "heldout") if len(ids) >= prompt_tokens]
    if not candidates:
        raise ValueError(f"no held-out file has {prompt_tokens} tokens")
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for _ in range(n):
        ids = candidates[rng.randrange(len(candidates))]
        start = rng.randrange(len(ids) - prompt_tokens + 1)
        prompts.append([int(t) for t in ids[start : start + prompt_tokens]])
    return prompts
