"""A Hugging Face folder saved in bf16 or fp16 runs in its own 16-bit weights (CPU, one rank).

Such a checkpoint's weights are bf16 (fp16) values: widened to fp32 at load they take 4 bytes a weight, and a batch-1
decode step, which reads every weight once, reads twice the bytes it must. Here the loader reads the tensors in the
file's dtype, and every linear's rows, as they are, become the kernel layer's BF16 / F16 blocks (`engine/kernels`,
summed in a fixed order, batch-invariant); the embedding is looked up in the same rows, and a tied `lm_head` reads
them too (one storage). Norms and biases are widened to fp32 (a few KB). The weights are what the file holds. With
`--activations fp32` the linears take fp32 activations times the exactly widened weights: exact for these
checkpoints but for the summation order. By default (`auto`) a bf16 checkpoint on a CPU with AVX-512 BF16 takes
bf16 dot products, its activations rounded to bf16 at each linear as the checkpoint's dtype computes in other
engines (verify and batched steps 1.1-1.9x faster than the widened form; a batch-1 decode step reads its weights
from memory at the same speed either way); elsewhere, and for fp16, the fp32 form. fp32 folders, `--quantization
none`, `--dtype bfloat16|float16` and tensor-parallel ranks keep the torch linears."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specstep.engine.config import DTYPES, ModelConfig
from specstep.engine.cpu_kernels import CpuKernels
from specstep.engine.kernels import binding as kernel_layer
from specstep.engine.models.gguf_embedding import GGUFEmbedding
from specstep.engine.models.gguf_linear import GGUFLinear, table_arith

HALF_FORMATS = {torch.bfloat16: "BF16", torch.float16: "F16"}  # torch dtype -> the kernel layer's format


def half_format(folder: Path, cfg: ModelConfig, kernels: str | CpuKernels, dtype: torch.dtype,
                world_size: int) -> str | None:
    """The kernel layer's format for a 16-bit Hugging Face checkpoint loaded for fp32 compute on one rank
    (`dtype`: the resolved compute dtype), or None: the checkpoint loads as `dtype` weights."""
    if not isinstance(kernels, CpuKernels) or kernels.quantization == "none" or dtype != torch.float32:
        return None
    if world_size > 1 or (folder / "specstep_source.json").is_file():  # (a converted GGUF file: its own blocks)
        return None
    fmt = HALF_FORMATS.get(DTYPES.get(cfg.torch_dtype, torch.float32))
    if fmt is None or kernel_layer.unavailable() or fmt not in kernel_layer.formats():
        return None
    return fmt


def _linears(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    return [(f"{prefix}.{child_name}".lstrip("."), parent, child_name, child)
            for prefix, parent in model.named_modules() for child_name, child in parent.named_children()
            if type(child) is nn.Linear]


def use_half_linears(model: nn.Module, fmt: str, activations: str = "fp32") -> str:
    """Swap a model loaded in its checkpoint's 16-bit dtype onto `fmt` blocks over its own weights' storage (no
    copy), and widen what is left (norms, biases) to fp32; returns the ready line's note. `activations`: fp32
    (exact), or auto / int8 (the fastest arithmetic the format has here: `table_arith`)."""
    qk = kernel_layer.block_of(fmt)[0]
    linears = _linears(model)
    narrow = [(name, lin.in_features) for name, _, _, lin in linears if lin.in_features % qk]
    if narrow:  # a width the kernel's rows do not take: the fp32 weights, as before
        model.float()
        return f"fp32 weights ({narrow[0][0]}'s input width {narrow[0][1]} is not a multiple of {qk})"
    embed = getattr(model, "embed_tokens", None)
    tied = bool(getattr(getattr(model, "cfg", None), "tie_word_embeddings", False))
    nbytes = 0
    for _name, parent, child_name, child in linears:
        rows = child.weight.detach().contiguous().view(torch.uint8)  # [out, in * 2]: the same bytes, as blocks
        bias = None if child.bias is None else nn.Parameter(child.bias.detach().float(), requires_grad=False)
        setattr(parent, child_name, GGUFLinear(fmt, rows, child.in_features, bias, activations=activations))
        if not (tied and child.weight is getattr(embed, "weight", None)):
            nbytes += rows.numel()
    note = ""
    if isinstance(embed, nn.Embedding) and getattr(getattr(embed, "tp", None), "world_size", 1) == 1:
        rows = embed.weight.detach().contiguous().view(torch.uint8)
        model.embed_tokens = GGUFEmbedding(fmt, rows, embed.embedding_dim)
        note = f"; the embedding looked up in its {fmt} rows ({rows.numel() / 2**20:.0f} MB)"
    model.float()  # what is left in 16 bits: norms, biases (the blocks are uint8: untouched)
    isa = {"avx512": "AVX-512", "avx2": "AVX2"}[kernel_layer.host_isa()]
    name = {"BF16": "bf16", "F16": "fp16"}[fmt]
    acts = ("bf16 activations in AVX-512 BF16 dot products (not exact; --activations fp32 for exact)"
            if table_arith(fmt, activations) == "bf16" else "fp32 activations (exact)")
    return (f"{name} weights as the checkpoint holds them ({len(linears)} linears, {nbytes / 2**20:.0f} MB, "
            f"2 bytes a weight) in specstep's {isa} {fmt} kernels, {acts}, batch-invariant{note}")
