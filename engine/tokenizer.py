"""Tokenizer (Hugging Face `tokenizers`, from a folder's tokenizer.json) and UTF-8-safe incremental detokenizing.

No torch import here: the frontend process uses this module.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from specstep.engine.errors import CheckpointError


class Tokenizer:
    def __init__(self, tok: HFTokenizer, eos_token_ids: tuple[int, ...] = ()) -> None:
        self._tok = tok
        self.eos_token_ids = eos_token_ids
        # Byte-level BPE without a normalizer: no token covers more characters than its vocabulary string has
        # (one per byte), so a text of n characters has at least n / max_token_chars tokens, a bound checked
        # before encoding. Not for other tokenizers: an unknown token or a normalizer can swallow any run.
        byte_level = type(tok.pre_tokenizer).__name__ == "ByteLevel" and tok.normalizer is None \
            and getattr(tok.model, "unk_token", None) is None
        self.max_token_chars: int | None = (max((len(t) for t in tok.get_vocab(with_added_tokens=True)), default=1)
                                            if byte_level else None)

    @classmethod
    def from_folder(cls, model: str | Path) -> Tokenizer:
        """`model`: a model folder, or a GGUF file (its converted folder; converting needs torch)."""
        from specstep.engine.model_source import resolve_model

        folder = resolve_model(model)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{folder}: no tokenizer.json (pass prompt_token_ids instead of text)")
        tok = HFTokenizer.from_file(str(path))
        eos: tuple[int, ...] = ()
        cfg = Path(folder) / "config.json"
        if cfg.is_file():
            raw = json.loads(cfg.read_text()).get("eos_token_id")
            eos = tuple(raw) if isinstance(raw, list) else (() if raw is None else (int(raw),))
        return cls(tok, eos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Streams text for a growing list of ids without ever emitting half a UTF-8 character.

    Byte-level BPE tokens can end mid-character; decoding them alone yields U+FFFD. We decode a short window
    [prefix_offset, len) and emit only what extends the already-emitted window text, holding back while the
    tail is an incomplete character (the approach of vLLM / text-generation-inference).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self.tok = tokenizer
        self.ids = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end of the stream (possibly an incomplete character)."""
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""
