"""A Hugging Face `tokenizers` tokenizer rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.

GGUF stores the byte-level BPE vocabulary and merges verbatim, plus the name of llama.cpp's pre-tokenizer
(`tokenizer.ggml.pre`). Each supported name maps to the pre-tokenizer the original tokenizer.json had, so ids are
the ones the model was trained on. SentencePiece (`llama`) vocabularies are not supported yet: a typed error says so.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from specstep.engine.errors import CheckpointError

# llama.cpp's regexes for the pre-tokenizers that split before the byte-level mapping (llama-vocab.cpp).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _pre_tokenizer(name: str, path: Path):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split_then_bytes = lambda regex: pre_tokenizers.Sequence([  # noqa: E731
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if name in ("default", "gpt-2", "gpt2"):
        return byte_level
    if name in ("smollm", "starcoder", "refact"):  # GPT-2 regex after splitting digits one by one
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if name in ("llama-bpe", "llama3"):
        return split_then_bytes(_LLAMA3_SPLIT)
    if name in ("qwen2", "deepseek-r1-qwen"):
        return split_then_bytes(_QWEN2_SPLIT)
    raise CheckpointError(f"{path}: unsupported GGUF pre-tokenizer {name!r} "
                          "(supported: default, gpt2, smollm, starcoder, refact, llama-bpe, qwen2)")


def tokenizer_from_gguf(reader, path: Path) -> Tokenizer:
    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"{path}: unsupported GGUF tokenizer model {kind!r} (supported: gpt2, byte-level BPE)")
    tokens: list[str] = field("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
    types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(field("tokenizer.ggml.pre", "default"), path)
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, ty in enumerate(types) if ty in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens(special)
    return tok
