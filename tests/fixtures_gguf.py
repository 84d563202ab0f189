"""Write a Hugging Face test checkpoint as a GGUF file the way llama.cpp's converter does (names, q/k row
permutation, tokenizer metadata), with the `gguf` package's writer and quantisers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from tests.kquants import QUANTIZERS

_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: interleave each head's rotary halves."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    parts = hf.split(".")  # model.layers.N.<module...>.weight|bias
    return f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"


def _tensor_type(qtype: str, hf: str) -> str:
    if qtype != "Q4_K_M":
        return qtype
    return "Q6_K" if hf.endswith(("embed_tokens.weight", "v_proj.weight", "down_proj.weight")) else "Q4_K"


def write_gguf(path: Path, folder: Path, arch: str = "llama", qtype: str = "F32", pre: str = "default",
               architecture_name: str | None = None, extra_tensor: tuple[str, str] | None = None) -> Path:
    """`folder` (a tests.helpers checkpoint with tokenizer.json) -> GGUF at `path`.

    qtype: the 2-D weights' GGML type (norms stay F32, as llama.cpp keeps them): one the `gguf` package quantises
    (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), a K-quant (Q4_K, Q5_K, Q6_K: `tests.kquants`), or Q4_K_M
    (llama.cpp's mix: Q6_K for the embedding, attn_v and ffn_down, Q4_K elsewhere; widths multiples of 256).
    extra_tensor: (name, raw GGML type) of one more tensor with arbitrary bytes (for error tests)."""
    import gguf

    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(path), architecture_name or arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 1e4)))
    w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in special else 1 for t, _ in vocab])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for hf, t in load_file(str(folder / "model.safetensors")).items():
        a = t.to(torch.float32).numpy()
        if arch == "llama" and hf.endswith("q_proj.weight"):
            a = _permute(a, heads)
        elif arch == "llama" and hf.endswith("k_proj.weight"):
            a = _permute(a, kv_heads)
        kind = gguf.GGMLQuantizationType[_tensor_type(qtype, hf)] if a.ndim == 2 else gguf.GGMLQuantizationType.F32
        if kind.name in QUANTIZERS:
            data = QUANTIZERS[kind.name](a)
        else:
            data = a if kind == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(a, kind)
        w.add_tensor(_gguf_name(hf), data, raw_dtype=kind)
    if extra_tensor is not None:
        name, raw = extra_tensor
        kind = gguf.GGMLQuantizationType[raw]
        block, size = gguf.GGML_QUANT_SIZES[kind]
        row_bytes = cfg["hidden_size"] // block * size  # a [hidden, hidden] tensor of that type
        w.add_tensor(name, np.zeros((cfg["hidden_size"], row_bytes), dtype=np.uint8), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# the Q4_1 / Q8_0 kernel's int8 forms, each pinned by the ISA it runs on (`--activations int8` plus SPECSTEP_CPU_ISA)
INT8_FORM_ISA = {"int8-lanes": "avx2", "int8-vnni": "avx512", "int8-tiles": "amx"}


def pin_int8_form(acts: str, monkeypatch) -> str:
    """The `--activations` value that runs kernel form `acts`: "int8" with SPECSTEP_CPU_ISA set to the form's ISA
    (for the rest of the test), or `acts` itself where it is not an int8 form."""
    if acts not in INT8_FORM_ISA:
        return acts
    monkeypatch.setenv("SPECSTEP_CPU_ISA", INT8_FORM_ISA[acts])
    return "int8"
