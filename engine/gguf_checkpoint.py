"""GGUF checkpoints (llama.cpp's format), converted once into a Hugging Face-format folder.

Reading and dequantising are the `gguf` package's; this module only maps llama.cpp's names and metadata onto
Hugging Face's, so the converted folder is an ordinary checkpoint: our loader, `transformers` and vLLM all read it.
Conversion is cached (keyed by the file's path, size and mtime), so only the first start pays for it.

Two conversions. The fp32 checkpoint (`converted_folder(full=True)`) holds every tensor dequantised: what
`--quantization none`, tensor-parallel ranks, CUDA, transformers and vLLM read (4 bytes a weight: 5.2 GB for a
1.5B Q4_K_M file, written in 25 s). The serving path first takes the partial one (`full=False`, what
`resolve_model` returns): config, tokenizer and only the tensors in no GGUF kernel's format (norms, biases, other
types), since the kernels read the rest from the file's blocks; the loader turns to the fp32 checkpoint
(`fp32_folder`) only where the blocks do not supply a weight after all.

    GGUF                         Hugging Face
    token_embd / output_norm     model.embed_tokens / model.norm
    output (absent: tied)        lm_head
    blk.N.attn_{q,k,v,output}    model.layers.N.self_attn.{q,k,v,o}_proj   (llama: q/k rows un-permuted, below)
    blk.N.ffn_{gate,up,down}     model.layers.N.mlp.{gate,up,down}_proj
    blk.N.{attn,ffn}_norm        model.layers.N.{input,post_attention}_layernorm
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from specstep.engine.errors import CheckpointError
from specstep.engine.fingerprint import first_rows, weights_digest
from specstep.engine.gguf_tokenizer import tokenizer_from_gguf
from specstep.engine.model_source import cache_root

CHUNK_ROWS = 4096  # rows dequantised at a time while converting
CONVERTER_VERSION = 2  # bump when the converted folder's contents change, so caches are rebuilt
# The GGML types some GGUF kernel reads as blocks (`gguf_kernel.FORMATS` and the kernel layer's table, on any host:
# tests hold the two lists equal): a partial conversion leaves their 2-D tensors out.
BLOCK_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16",
                         "BF16"})
PARTIAL_SUFFIX = "-partial"  # a partial conversion's folder: the fp32 checkpoint's name and this
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def converted_folder(gguf_path: Path, cache: Path | None = None, full: bool = True) -> Path:
    """The Hugging Face-format folder for `gguf_path`, converting it on first use: the fp32 checkpoint, or with
    `full=False` the partial one (the module docstring)."""
    out = (cache or cache_root()) / "gguf" / (_cache_key(gguf_path) + ("" if full else PARTIAL_SUFFIX))
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=out.parent))
    try:
        convert(gguf_path, tmp, full)
        try:
            tmp.rename(out)  # atomic: a concurrent start either sees nothing or the whole folder
        except OSError:
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_partial(folder: Path) -> bool:
    """Whether `folder` is a partial conversion (its block-format weights left in the GGUF file)."""
    source = folder / "specstep_source.json"
    return source.is_file() and json.loads(source.read_text()).get("weights") == "partial"


def fp32_folder(folder: Path) -> Path:
    """The fp32 checkpoint of a partial conversion (converted now if it is not yet), else `folder` itself."""
    if not is_partial(folder):
        return folder
    gguf_path = Path(json.loads((folder / "specstep_source.json").read_text())["gguf"])
    if not gguf_path.is_file():
        raise CheckpointError(f"{folder} was converted from {gguf_path}, which is gone")
    return converted_folder(gguf_path, folder.parent.parent, full=True)


def _reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def convert(gguf_path: Path, out: Path, full: bool = True) -> None:
    """Write config.json, model.safetensors, tokenizer.json and generation_config.json into `out`; with `full`
    False, model.safetensors holds only the tensors that are not 2-D in a block type."""
    reader = _reader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{gguf_path}: unsupported GGUF architecture {arch!r}; supported: "
                              f"{', '.join(ARCHITECTURES)}")
    config = _config(reader, arch, gguf_path)

    def weights(t) -> Iterator[np.ndarray]:
        name = _hf_name(t.name, gguf_path)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):  # rows move: the whole tensor
            w = torch.from_numpy(np.array(_dequantize(t, gguf_path)))  # a copy: F32 tensors are read-only views
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            yield _unpermute(w, heads).numpy()
        elif len(t.shape) == 2 and t.data.ndim == 2 and t.data.shape[0] == int(t.shape[1]):
            for start in range(0, t.data.shape[0], CHUNK_ROWS):  # the embedding's fp32 rows are 2.2 GB on a 7B
                yield _dequantize(t, gguf_path, slice(start, start + CHUNK_ROWS))
        else:
            yield _dequantize(t, gguf_path)

    names = [_checked_name(t, gguf_path) for t in reader.tensors]
    config["tie_word_embeddings"] = "lm_head.weight" not in names
    tensors = [(n, [int(d) for d in reversed(t.shape)], lambda t=t: weights(t))
               for n, t in zip(names, reader.tensors, strict=True)]
    written = [x for x, t in zip(tensors, reader.tensors, strict=True)
               if full or len(t.shape) != 2 or t.tensor_type.name not in BLOCK_TYPES]
    _stream_safetensors(out / "model.safetensors", written)
    # the fingerprint (shipped heads and drafts are found by it) of weights a partial conversion does not write:
    # each identifying tensor's leading rows, from the first part its producer yields
    produced = {n: (shape, produce) for n, shape, produce in tensors}
    digest = None if full else weights_digest(
        set(names), lambda name: (produced[name][0], first_rows(next(iter(produced[name][1]())), produced[name][0]))
    ).hex()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tokenizer_from_gguf(reader, gguf_path).save(str(out / "tokenizer.json"))
    (out / "specstep_source.json").write_text(json.dumps(
        {"gguf": str(gguf_path.resolve()), "name": _field(reader, "general.name"),
         "file_type": _field(reader, "general.file_type"), "converter_version": CONVERTER_VERSION,
         "weights": "all" if full else "partial", **({"weights_digest": digest} if digest else {})}, indent=2)
        + "\n")


def _stream_safetensors(path: Path, tensors: list[tuple[str, list[int], Callable[[], Iterable[np.ndarray]]]]
                        ) -> None:
    """An fp32 safetensors file written a part at a time (`tensors`: name, shape, the producer of its fp32 values,
    in parts of whole rows):
    the conversion holds one dequantised tensor at once, not the model (a 7B-class file's fp32 weights are 28 GiB).
    The format: an 8-byte little-endian header length, a JSON header of dtypes, shapes and byte ranges (padded with
    spaces to 8 bytes), then the tensors' bytes in header order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in tensors:
        nbytes = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape, produce in tensors:
            written = 0
            for part in produce():
                w = np.ascontiguousarray(part, dtype="<f4")
                f.write(w.data)  # (no copy)
                written += w.size
            if written != int(np.prod(shape, dtype=np.int64)):
                raise CheckpointError(f"{path}: tensor {name!r} dequantised to {written} values, expected {shape}")


def _cache_key(gguf_path: Path) -> str:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}".encode())
    return f"{gguf_path.stem}-{key.hexdigest()[:12]}"


INDEX_VERSION = 1  # bump when tensor_index's contents change


def _file_identity(gguf_path: Path) -> list[int]:
    """What a cached index must have been read from: a file rewritten in place with the same size and mtime (cp -p,
    rsync -t) still gets a new inode or ctime."""
    st = gguf_path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


def _valid_index(index, identity: list[int]) -> bool:
    try:
        return (index["version"] == INDEX_VERSION and index["source"] == identity and isinstance(index["arch"], str)
                and all(isinstance(t["name"], str) and isinstance(t["type"], str) and len(t["shape"]) >= 1
                        and t["offset"] >= 0 and t["nbytes"] >= 0 for t in index["tensors"]))
    except (KeyError, TypeError, IndexError):
        return False


def tensor_index(gguf_path: Path, cache: Path | None = None) -> dict:
    """Where the file's tensors lie ({"arch", "heads", "tensors": [{name, type, shape, offset, nbytes}]}), as the
    `gguf` package read them, cached as JSON beside the converted folders (keyed like them, and checked against
    the file's identity). The reader parses every metadata field first, the tokenizer's ~50,000 strings included:
    1.6 s of a 3.7 s SmolLM2 start, for offsets that never change while the file does not. The cache is only a
    shortcut: an index that is unreadable, of another version or shape, or from another file is rebuilt, and one
    that cannot be written is not kept."""
    path = (cache or cache_root()) / "gguf" / f"{_cache_key(gguf_path)}.tensors.json"
    identity = _file_identity(gguf_path)
    try:
        index = json.loads(path.read_text())
        if _valid_index(index, identity):
            return index
    except (OSError, ValueError):
        pass
    reader = _reader(gguf_path)
    arch = _field(reader, "general.architecture")
    heads = _field(reader, f"{arch}.attention.head_count")
    index = {"version": INDEX_VERSION, "source": identity, "arch": arch,
             "heads": {"q_proj.weight": heads,
                       "k_proj.weight": _field(reader, f"{arch}.attention.head_count_kv") or heads},
             "tensors": [{"name": t.name, "type": t.tensor_type.name, "shape": [int(d) for d in t.shape],
                          "offset": int(t.data_offset), "nbytes": int(t.n_bytes)} for t in reader.tensors]}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".index-", dir=path.parent)
        with open(fd, "w") as f:
            json.dump(index, f)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would have every other user of a shared cache parse again
        os.replace(tmp, path)  # atomic: a concurrent start reads no index or the whole one
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return index


def quantized_blocks(gguf_path: Path, formats: tuple[str, ...], cache: Path | None = None
                     ) -> dict[str, tuple[str, torch.Tensor]]:
    """The file's 2-D weights stored in one of `formats` (GGML type names), as they are: Hugging Face name ->
    (type, blocks [out_features, in_features / 32 blocks] uint8), rows in the converted checkpoint's order (a
    llama q/k weight's rows un-permuted, as `convert` does: a row is whole blocks, so rows move exactly). For
    kernels that read the quantised weights (`engine.models.gguf_model_linears`). Read at the offsets `tensor_index`
    keeps."""
    index = tensor_index(gguf_path, cache)
    data = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    out = {}
    for t in index["tensors"]:
        if t["type"] not in formats or len(t["shape"]) != 2:
            continue
        name = _hf_name(t["name"], gguf_path)
        if t["offset"] + t["nbytes"] > data.size:
            raise CheckpointError(f"{gguf_path}: tensor {t['name']} lies past the end of the file")
        raw = np.array(data[t["offset"]:t["offset"] + t["nbytes"]])  # a copy: the file is a memmap
        rows = torch.from_numpy(raw).reshape(t["shape"][1], -1)
        suffix = name.rpartition("self_attn.")[2]
        if index["arch"] == "llama" and suffix in index["heads"]:
            rows = _unpermute(rows, int(index["heads"][suffix])).contiguous()
        out[name] = (t["type"], rows)
    return out


def _config(reader, arch: str, path: Path) -> dict:
    def need(key: str):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise CheckpointError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return v

    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise CheckpointError(f"{path}: llama3-style rope scaling (rope_freqs) is not supported from GGUF; "
                              "convert the Hugging Face checkpoint instead")
    if _field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise CheckpointError(f"{path}: rope scaling {_field(reader, f'{arch}.rope.scaling.type')!r} is not supported")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv") or heads),
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count") or hidden // heads),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base") or 10000.0),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
        "torch_dtype": "float32",  # dequantised values; the engine casts to its own dtype at load
    }


def _hf_name(name: str, path: Path) -> str:
    base, _, kind = name.rpartition(".")  # kind: weight | bias
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{kind}"
    raise CheckpointError(f"{path}: unexpected GGUF tensor {name!r} for a Llama-family model")


def _checked_name(t, path: Path) -> str:
    """A tensor's Hugging Face name; a type the gguf package cannot read is the error named first."""
    try:
        return _hf_name(t.name, path)
    except CheckpointError:
        _dequantize(t, path)
        raise


def _dequantize(t, path: Path, rows: slice | None = None) -> np.ndarray:
    """Tensor `t`'s fp32 values [out, in] (`rows`: just those rows of a 2-D tensor)."""
    from gguf import quants

    try:
        w = quants.dequantize(t.data if rows is None else t.data[rows], t.tensor_type)
    except (NotImplementedError, KeyError):
        raise CheckpointError(f"{path}: tensor {t.name!r} has quantisation type {t.tensor_type.name}, which the "
                              "gguf package cannot dequantise") from None
    # GGUF lists dimensions innermost first; numpy's order is the reverse (= PyTorch's [out, in]).
    shape = tuple(int(d) for d in reversed(t.shape))
    return w.reshape(shape if rows is None else (-1, shape[1])).astype(np.float32, copy=False)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (it stores each head's rotary pairs interleaved).

    llama.cpp wrote  W.view(heads, 2, d/2, in).transpose(1, 2)  i.e. rows (h, i, half) -> (h, half, i) order;
    this is the inverse: rows come back to Hugging Face's rotate-half layout (first half, then second half).
    """
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
