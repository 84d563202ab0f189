"""A 4,096-token byte-level BPE trained on the train split of the corpus.

Byte-level so that any input (non-ASCII identifiers, binary-ish strings) round-trips without an unknown
token; no prefix space so a prompt's first token is the same as mid-text. `<|endoftext|>` is special token 0
and serves as BOS, EOS and file separator.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from specstep.training.data import EOS_ID, EOS_TOKEN, corpus_files, read_source

VOCAB_SIZE = 4096


def train_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # the caller draws its own rich progress
    )
    files = corpus_files("train")
    tok.train_from_iterator((read_source(p) for p in files), trainer=trainer, length=len(files))
    if tok.token_to_id(EOS_TOKEN) != EOS_ID:
        raise RuntimeError(f"{EOS_TOKEN} got id {tok.token_to_id(EOS_TOKEN)}, expected {EOS_ID}")
    return tok


def save_tokenizer(tok: Tokenizer, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))


def load_tokenizer(path: str | Path) -> Tokenizer:
    return Tokenizer.from_file(str(path))
