"""Write a random-weight GGUF file in a real model's shapes and block formats, with the `gguf` package: for
start-up, memory and decode-speed measurements of model sizes no package ships (the speed of a block format does
not depend on its values). The tokenizer and its metadata come from another GGUF file (the embedded SmolLM2's by
default), so the vocabulary is that file's.

    python -m benchmarks.random_gguf --shape qwen2.5-1.5b --out /tmp/q15.gguf
    python -m benchmarks.random_gguf --shape qwen2.5-7b --out /tmp/q7.gguf

Weights are Q4_K_M's mix (Q6_K for the embedding, attn_v and ffn_down; Q4_K elsewhere) with scales chosen so the
weights are small (activations stay finite); norms are ones, q/k/v biases zeros.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

# name -> (hidden, intermediate, layers, heads, kv heads)
SHAPES = {"qwen2.5-1.5b": (1536, 8960, 28, 12, 2), "qwen2.5-7b": (3584, 18944, 28, 28, 4),
          "qwen2.5-3b": (2048, 11008, 36, 16, 2)}
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")


def small_blocks(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random `fmt` blocks whose weights are of order 0.02."""
    from tests.kernel_blocks import BLOCK

    qk, nbytes = BLOCK[fmt]
    blk = rng.integers(0, 256, size=(rows, cols // qk, nbytes), dtype=np.uint8)
    scale = {"Q4_K": 2e-4, "Q6_K": 5e-5}[fmt]
    halves = rng.uniform(0.5, 1.0, (rows, cols // qk)).astype(np.float32) * scale
    at = (0, 2) if fmt == "Q4_K" else (208,)
    for off in at:
        blk[..., off:off + 2] = halves.astype(np.float16).view(np.uint8).reshape(rows, cols // qk, 2)
    return blk.reshape(rows, -1)


def main() -> None:
    import gguf

    from specstep.engine.model_source import pretrained_gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer-from", type=Path, default=None, help="a GGUF file (default: the embedded SmolLM2)")
    args = ap.parse_args()
    hidden, inter, layers, heads, kv_heads = SHAPES[args.shape]
    src = gguf.GGUFReader(str(args.tokenizer_from or pretrained_gguf()))
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(str(args.out), "qwen2")
    w.add_block_count(layers)
    w.add_context_length(32768)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_vocab_size(vocab)
    for key in TOKENIZER_KEYS:
        field = src.fields.get(key)
        if field is not None:
            value = field.contents()
            kind = field.types[0] if len(field.types) == 1 else gguf.GGUFValueType.ARRAY
            w.add_key_value(key, value, kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    q4, q6 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    w.add_tensor("token_embd.weight", small_blocks("Q6_K", vocab, hidden, rng), raw_dtype=q6)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for name, rows, cols, fmt in (("attn_q", hidden, hidden, q4), ("attn_k", kv_heads * head_dim, hidden, q4),
                                      ("attn_v", kv_heads * head_dim, hidden, q6),
                                      ("attn_output", hidden, hidden, q4), ("ffn_gate", inter, hidden, q4),
                                      ("ffn_up", inter, hidden, q4), ("ffn_down", hidden, inter, q6)):
            w.add_tensor(f"blk.{i}.{name}.weight", small_blocks(fmt.name, rows, cols, rng), raw_dtype=fmt)
        for name, rows in (("attn_q", hidden), ("attn_k", kv_heads * head_dim), ("attn_v", kv_heads * head_dim)):
            w.add_tensor(f"blk.{i}.{name}.bias", np.zeros(rows, np.float32))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{args.out}: {args.shape} shapes, vocabulary {vocab}, {args.out.stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
