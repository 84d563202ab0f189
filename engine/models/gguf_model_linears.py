"""A model's linears swapped for `GGUFLinear`s over a GGUF file's blocks (`--quantization auto|gguf`, CPU).

`use_gguf_linears` swaps each `nn.Linear` whose weight the file stores in a format a kernel reads for a
`GGUFLinear` over the file's blocks (merged q/k/v and gate/up projections concatenate their pieces' rows; a tied
`lm_head` reads the embedding's blocks), and the token embedding for a `GGUFEmbedding`: no fp32 copy stays. Where
the converted checkpoint holds the weights, the blocks are checked against them first (leading rows of each,
bitwise). `blocks_note` is the ready line's account of it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specstep.engine.errors import CheckpointError, ConfigError
from specstep.engine.gguf_checkpoint import quantized_blocks
from specstep.engine.kernels import binding as kernel_layer
from specstep.engine.loader import _MERGED  # merged projection -> its Hugging Face pieces, in row order
from specstep.engine.models.amx_crossover import lane_rows_for
from specstep.engine.models.gguf_kernel import FORMATS, kernel_isa, unavailable
from specstep.engine.models.gguf_linear import GGUFLinear, dequantize
from specstep.engine.models.int8_forms import kernel_activations

CHECK_ROWS = 4  # rows of each weight compared bitwise with the converted checkpoint at load


def _pieces(name: str, tied: bool) -> list[str]:
    """A linear's Hugging Face weight names, in row order: `layers.3.self_attn.qkv_proj` -> its q, k, v."""
    if name == "lm_head":
        return ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    parts = name.split(".")
    layer, sub = ".".join(parts[:2]), ".".join(parts[2:])
    if parts[0] == "layers" and sub in _MERGED:
        return [f"model.{layer}.{piece}.weight" for piece in _MERGED[sub]]
    return [f"model.{name}.weight"]


def _leading_rows(folder: Path, hf_name: str) -> torch.Tensor | None:
    """The converted checkpoint's first CHECK_ROWS rows of `hf_name`, read alone (the model's own copy of the
    weight may never have been read: `block_params`); None where a partial conversion left it in the file's blocks
    (nothing converted to be stale against)."""
    from safetensors import safe_open

    from specstep.engine.gguf_checkpoint import is_partial
    from specstep.engine.loader import safetensors_files

    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            if hf_name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                return f.get_slice(hf_name)[:CHECK_ROWS].float()
    if is_partial(folder):
        return None
    raise CheckpointError(f"{folder}: missing tensor {hf_name!r}")


def _matches(got: torch.Tensor, folder: Path, hf_name: str) -> bool:
    """Whether `got` (leading rows dequantised from the blocks) are the converted checkpoint's rows."""
    rows = _leading_rows(folder, hf_name)
    return rows is None or torch.equal(got, rows)


def _linears(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    return [(f"{prefix}.{child_name}".lstrip("."), parent, child_name, child)
            for prefix, parent in model.named_modules() for child_name, child in parent.named_children()
            if type(child) is nn.Linear]


def use_gguf_linears(model: nn.Module, folder: Path, gguf_path: Path, required: bool,
                     activations: str = "fp32") -> str:
    """Swap the model's linears for `GGUFLinear`s over `gguf_path`'s blocks where the file stores them in a format
    the kernel reads; returns the ready line's note ("" if none). `required` (`--quantization gguf`, or int8
    `activations`, which only the kernel runs): where the kernel cannot run, an error rather than the fp32
    weights."""
    flag = "--quantization gguf" if activations in ("fp32", "auto") else f"--activations {activations}"
    required = required or activations not in ("fp32", "auto")
    why = unavailable()
    if why:
        if required:
            raise ConfigError(f"{flag}: the GGUF kernel cannot run here: {why}")
        return f"fp32 weights (GGUF kernel unavailable: {why})"
    activations, host_note = kernel_activations(activations, flag)
    if not gguf_path.is_file():
        if required:
            raise ConfigError(f"{flag}: {folder} was converted from {gguf_path}, which is gone")
        return f"fp32 weights ({gguf_path} is gone)"
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:  # the blocks are checked against (and replace) fp32 weights, bit for bit
        raise ConfigError(f"the GGUF kernel takes float32 activations; this model holds "
                          f"{', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))} weights")
    table_formats = () if kernel_layer.unavailable() else kernel_layer.formats()
    blocks = quantized_blocks(gguf_path, (*FORMATS, *table_formats))
    tied = bool(getattr(getattr(model, "cfg", None), "tie_word_embeddings", False))
    embed = getattr(model, "embed_tokens", None)
    swapped: dict[str, int] = {}
    nbytes = 0
    for name, parent, child_name, child in _linears(model):
        pieces = _pieces(name, tied)
        if not all(p in blocks for p in pieces):
            continue
        types = [blocks[p][0] for p in pieces]
        if len(set(types)) != 1:  # a merged projection of several formats: the kernel layer's, piece by piece
            if not all(t in table_formats and child.in_features % kernel_layer.block_of(t)[0] == 0 for t in types):
                continue
            got = dequantize(types[0], blocks[pieces[0]][1][:CHECK_ROWS], child.in_features)
            if not _matches(got, folder, pieces[0]):
                raise CheckpointError(f"{gguf_path}: {name}'s blocks do not hold the converted checkpoint's "
                                      "weights (a stale conversion? delete it from the cache)")
            lin = GGUFLinear.split([blocks[p] for p in pieces], child.in_features, child.bias, activations)
            setattr(parent, child_name, lin)
            swapped[lin.fmt] = swapped.get(lin.fmt, 0) + 1
            nbytes += lin.blocks.numel()
            continue
        fmt = blocks[pieces[0]][0]
        rows = torch.cat([blocks[p][1] for p in pieces]) if len(pieces) > 1 else blocks[pieces[0]][1]
        if tuple(rows.shape[:1]) != (child.out_features,):
            raise CheckpointError(f"{gguf_path}: {name}'s blocks have {rows.shape[0]} rows, the model "
                                  f"{child.out_features}")
        if fmt in table_formats and child.in_features % kernel_layer.block_of(fmt)[0]:
            continue  # (a width the format's blocks cannot hold: not written by llama.cpp)
        got = dequantize(fmt, rows[:CHECK_ROWS], child.in_features)
        if not _matches(got, folder, pieces[0]):
            raise CheckpointError(f"{gguf_path}: {name}'s {fmt} blocks do not hold the converted checkpoint's "
                                  "weights (a stale conversion? delete it from the cache)")
        is_tied = tied and name == "lm_head" and embed is not None
        setattr(parent, child_name, GGUFLinear(fmt, rows, child.in_features, child.bias,
                                               embed.weight if is_tied else None, activations))
        swapped[fmt] = swapped.get(fmt, 0) + 1
        nbytes += rows.numel()
    if not swapped:
        return ""
    embedding = _use_gguf_embedding(model, blocks, folder)
    return blocks_note(model, activations, swapped, nbytes, host_note) + embedding


def blocks_note(model: nn.Module, activations: str, swapped: dict[str, int], nbytes: int, host_note: str) -> str:
    """The ready line's note on the swapped linears."""
    table = [m for m in model.modules() if isinstance(m, GGUFLinear) and m.kernel is not None]
    if table:
        return _table_note(swapped, nbytes, table)
    kinds = ", ".join(f"{n} {fmt}" for fmt, n in sorted(swapped.items()))
    if activations == "int8":
        packed = sum(m.packed.numel() for m in model.modules() if isinstance(m, GGUFLinear) and m.packed is not None)
        copy = f", and a {packed / 2**20:.0f} MB copy of the Q4_1 ones repacked for the lanes" if packed else ""
        return (f"GGUF blocks ({kinds} linears, {nbytes / 2**20:.0f} MB{copy}) times int8 activations (llama.cpp's "
                f"arithmetic: not exact) in specstep's AVX2 kernel, batch-invariant{host_note}; --activations "
                "fp32 for exact")
    if activations == "int8-tiles":
        lanes = ", ".join(f"{fmt} up to {n}" for fmt, n in lane_rows_for(model).items())
        return (f"GGUF blocks ({kinds} linears, {nbytes / 2**20:.0f} MB, and a {nbytes / 2**20:.0f} MB copy "
                "repacked for AMX tiles) times int8 activations in AMX tiles (each block's products summed in "
                f"integers, llama.cpp's order: not exact; calls of few rows ({lanes}, measured faster here at load) in "
                "AVX-512 VNNI lanes over the same copy, the same bits), batch-invariant; --activations fp32 for exact")
    if activations == "int8-vnni":
        return (f"GGUF blocks ({kinds} linears, {nbytes / 2**20:.0f} MB, and a {nbytes / 2**20:.0f} MB copy "
                "repacked in 16-row groups) times int8 activations in AVX-512 VNNI lanes (each block's products "
                f"summed in integers, llama.cpp's order: not exact), batch-invariant{host_note}; --activations fp32 "
                "for exact")
    isa = "AVX-512" if kernel_isa() == "avx512" else "AVX2"
    return (f"GGUF blocks ({kinds} linears, {nbytes / 2**20:.0f} MB) in specstep's {isa} kernel, "
            "batch-invariant; --quantization none for fp32 weights")


def _table_note(swapped: dict[str, int], nbytes: int, table: list[GGUFLinear]) -> str:
    """The ready line's note for a model whose linears read the kernel layer's formats (some perhaps the older
    kernel's Q4_1 / Q8_0)."""
    kinds = ", ".join(f"{n} {fmt}" for fmt, n in sorted(swapped.items()))
    ariths = {k.arith for m in table for k, _, _ in m.parts}  # (a merged linear's parts may differ)
    isa = {"avx512": "AVX-512 VNNI", "avx2": "AVX2"}[table[0].kernel.isa]
    main = next(a for a in ("int8", "bf16", "fp32") if a in ariths)
    acts = {"int8": "int8 activations (llama.cpp's arithmetic: not exact; --activations fp32 for exact)",
            "bf16": "bf16 activations in AVX-512 BF16 dot products (not exact; --activations fp32 for exact)",
            "fp32": "fp32 activations (exact)"}[main]
    others = [text for a, text in (("bf16", "BF16 tensors in bf16 dot products"), ("fp32", "16-bit tensors in fp32"))
              if a in ariths and a != main]
    mixed = f" ({'; '.join(others)})" if others else ""
    return (f"GGUF blocks ({kinds} linears, {nbytes / 2**20:.0f} MB) in specstep's {isa} kernels, {acts}{mixed}, "
            "batch-invariant")


def _use_gguf_embedding(model: nn.Module, blocks: dict[str, tuple[str, torch.Tensor]], folder: Path) -> str:
    """Swap a one-rank model's token embedding for a `GGUFEmbedding` over the file's blocks (checked against the
    converted checkpoint's leading rows), and a tied `lm_head` onto those blocks alone: no fp32 table stays. The
    ready line's note ("" if not swapped)."""
    from specstep.engine.models.gguf_embedding import GGUFEmbedding

    embed, entry = getattr(model, "embed_tokens", None), blocks.get("model.embed_tokens.weight")
    tp = getattr(embed, "tp", None)
    if entry is None or not isinstance(embed, nn.Embedding) or (tp is not None and tp.world_size != 1):
        return ""
    fmt, rows = entry
    if rows.shape[0] != embed.num_embeddings:
        return ""
    gguf_embed = GGUFEmbedding(fmt, rows, embed.embedding_dim)
    if not _matches(gguf_embed(torch.arange(CHECK_ROWS)), folder, "model.embed_tokens.weight"):
        raise CheckpointError(f"the file's {fmt} embedding does not hold the converted checkpoint's rows (a stale "
                              "conversion? delete it from the cache)")
    model.embed_tokens = gguf_embed
    head = getattr(model, "lm_head", None)
    if isinstance(head, GGUFLinear) and head._tied[0] is embed.weight:
        head._tied = [None]  # its `weight` dequantises its own blocks (the embedding's storage)
    return f"; the embedding looked up in its {fmt} blocks ({rows.numel() / 2**20:.0f} MB)"
