"""A target's identity for the heads and drafts shipped for it: its weights and its vocabulary, not its files.

The same model comes as a GGUF conversion, as a Hugging Face folder, re-saved by `transformers` or by hand: the
config.json and tokenizer.json bytes differ (key order, indentation, added fields), the weights and the token ids
do not. So the fingerprint hashes

    weights  a few named tensors, each its full shape and its first rows' values rounded to bfloat16 (so a float32
             and a bfloat16 copy of the same values agree; a float16 copy rounds twice and need not):
                 model.embed_tokens   first 8 rows        model.layers.0.self_attn.q_proj   first 8 rows
                 model.norm           all                 model.layers.LAST.mlp.down_proj   first 8 rows
             (the projections catch a fine-tune merged from LoRA adapters, which leaves embedding and norms alone)
    vocab    the token -> id map of tokenizer.json, added tokens included, in id order

Tensors are read straight from the safetensors files (a JSON header, then raw little-endian bytes), a few KB each,
without torch: `serve`'s frontend asks which proposer to default to before any model is loaded.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

import numpy as np

ROWS = 8
_FLOAT = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def fingerprint(folder: Path) -> str:
    h = hashlib.sha256()
    h.update(_weights_digest(folder))
    h.update(_vocab_digest(folder / "tokenizer.json"))
    return h.hexdigest()[:16]


def identifying_tensors(names: set[str]) -> list[str]:
    layers = [int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))]
    last = max(layers, default=0)
    return ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
            f"model.layers.{last}.mlp.down_proj.weight"]


def _weights_digest(folder: Path) -> bytes:
    source = folder / "specstep_source.json"
    if source.is_file():  # a partial GGUF conversion: digested at conversion, from the rows it did not write
        recorded = json.loads(source.read_text()).get("weights_digest")
        if recorded:
            return bytes.fromhex(recorded)
    headers = {}  # tensor name -> (file, data start, its header entry)
    for path in sorted(folder.glob("*.safetensors")):
        start, header = _header(path)
        headers.update({name: (path, start, entry) for name, entry in header.items() if name != "__metadata__"})
    return weights_digest(set(headers), lambda name: (headers[name][2]["shape"], _first_rows_bf16(*headers[name])))


def weights_digest(names: set[str], rows) -> bytes:
    """The weights' part of the fingerprint: for each identifying tensor among `names`, its full shape and
    `rows(name)`'s (shape, first rows as bf16 bytes: `round_bf16`)."""
    h = hashlib.sha256()
    for name in identifying_tensors(names):
        h.update(name.encode() + b"\0")
        if name not in names:
            h.update(b"absent\0")
            continue
        shape, data = rows(name)
        h.update(json.dumps(shape).encode())
        h.update(data)
    return h.digest()


def first_rows(values: np.ndarray, shape: list[int]) -> bytes:
    """What the fingerprint reads of a tensor of `shape` whose leading values (at least ROWS rows) are `values`."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    return round_bf16(flat[:ROWS * int(np.prod(shape[1:]))] if len(shape) > 1 else flat)


def _header(path: Path) -> tuple[int, dict]:
    """safetensors: u64 little-endian header length, a JSON header, then the data (offsets relative to it)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def _first_rows_bf16(path: Path, start: int, entry: dict) -> bytes:
    dtype, shape = entry["dtype"], entry["shape"]
    begin, end = entry["data_offsets"]
    size = min(end - begin, ROWS * ((end - begin) // shape[0])) if len(shape) > 1 else end - begin
    with path.open("rb") as f:
        f.seek(start + begin)
        raw = f.read(size)
    if dtype == "BF16":
        values = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    elif dtype in _FLOAT:
        values = np.frombuffer(raw, np.dtype(_FLOAT[dtype]).newbyteorder("<")).astype(np.float32)
    else:  # integer or float8 storage: its raw bytes, tagged with the dtype
        return dtype.encode() + raw
    return round_bf16(values)


def round_bf16(values: np.ndarray) -> bytes:
    """float32 -> bfloat16 bytes, rounding to nearest, ties to even (as torch's .to(torch.bfloat16) does)."""
    bits = values.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()


def _vocab_digest(tokenizer_json: Path) -> bytes:
    """Read as JSON (`tokenizers` also builds the merges: 1.6x the time for SmolLM2's): BPE, WordPiece and
    WordLevel vocabularies are token -> id maps, Unigram's a list whose index is the id."""
    if not tokenizer_json.is_file():
        return b"no tokenizer.json"
    tok = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab = tok.get("model", {}).get("vocab", {})
    ids = dict(vocab) if isinstance(vocab, dict) else {entry[0]: i for i, entry in enumerate(vocab)}
    ids.update({t["content"]: t["id"] for t in tok.get("added_tokens", [])})
    return hashlib.sha256(json.dumps(sorted((i, t) for t, i in ids.items())).encode()).digest()
