"""Which of a model's parameters a GGUF file's blocks supply, so that the loader never reads them as fp32.

`block_params` names them before the load (the model is still on meta); the loader skips them, `use_gguf_linears`
builds the block modules from the file, and the loader then reads whatever the blocks did not take after all."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from specstep.engine.gguf_checkpoint import _hf_name, tensor_index
from specstep.engine.kernels import binding as kernel_layer
from specstep.engine.models.gguf_kernel import FORMATS, unavailable
from specstep.engine.models.gguf_model_linears import _linears, _pieces


def block_params(model: nn.Module, gguf_path: Path) -> frozenset[str]:
    """The parameters of `model` (built on meta, one rank) that `use_gguf_linears` will read from `gguf_path`'s
    blocks: the weights of linears whose every piece the file stores in a format a kernel reads, and the
    embedding's. The loader leaves them unread, so a 7B-class Q4_K_M file never exists as fp32 weights (28 GiB);
    any that the blocks do not take after all are read afterwards (`model_loader._load_weights`)."""
    if unavailable() or not gguf_path.is_file():
        return frozenset()
    kinds = (*FORMATS, *(() if kernel_layer.unavailable() else kernel_layer.formats()))
    stored = {_hf_name(t["name"], gguf_path) for t in tensor_index(gguf_path)["tensors"]
              if t["type"] in kinds and len(t["shape"]) == 2}
    tied = bool(getattr(getattr(model, "cfg", None), "tie_word_embeddings", False))
    out = {f"{name}.weight" for name, _, _, _ in _linears(model) if all(p in stored for p in _pieces(name, tied))}
    if isinstance(getattr(model, "embed_tokens", None), nn.Embedding) and "model.embed_tokens.weight" in stored:
        out.add("embed_tokens.weight")
    return frozenset(out)

