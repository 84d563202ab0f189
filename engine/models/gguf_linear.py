"""Linears that read a GGUF checkpoint's quantised blocks as they are (`--quantization auto|gguf`, CPU).

A GGUF file is converted once into an fp32 checkpoint (`engine.gguf_checkpoint`): every weight d * q + m of a
Q4_1 block becomes 4 bytes. A batch-1 decode step reads every weight once, so on a CPU its cost is the bytes
read: SmolLM2-135M is 538 MB in fp32 and 96 MB in its file's Q4_1 / Q8_0 blocks. `use_gguf_linears` swaps each
`nn.Linear` whose weight the file stores in a format the kernel reads for a `GGUFLinear` over the file's blocks
(merged q/k/v and gate/up projections concatenate their pieces' rows; a tied `lm_head` reads the embedding's
blocks), and drops the fp32 copy. The embedding keeps its fp32 rows (a lookup reads a few).

Same weights, other roundings: the kernel computes each output as the dequantised weights' dot product in fp32,
in a fixed order of its own (`gguf_kernel.cpp`), so its results differ from an fp32 GEMM's by rounding only, and
every row's bits are independent of the rows beside it (batch-invariant by construction, at every row count).
`--quantization none` keeps the fp32 weights and the oneDNN / MKL linears. The loader checks the blocks
against the converted checkpoint's weights (leading rows of each, bitwise) before it drops them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specstep.engine.errors import CheckpointError, ConfigError
from specstep.engine.gguf_checkpoint import quantized_blocks
from specstep.engine.kernels import binding as kernel_layer
from specstep.engine.loader import _MERGED  # merged projection -> its Hugging Face pieces, in row order
from specstep.engine.models.amx_crossover import lane_rows_for
from specstep.engine.models.gguf_kernel import (
    ACTIVATIONS,
    BLOCK,
    FORMATS,
    LANES_PACKED,
    amx_pack,
    gguf_linear,
    kernel_fmt,
    kernel_isa,
    lanes_pack,
    tiles_unavailable,
    unavailable,
    vnni_unavailable,
)

CHECK_ROWS = 4  # rows of each weight compared bitwise with the converted checkpoint at load


def dequantize(fmt: str, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """The fp32 weights of `blocks` [rows, bytes] (the `gguf` package's dequantiser: what the checkpoint holds)."""
    from gguf import GGMLQuantizationType, quants

    w = quants.dequantize(blocks.numpy(), GGMLQuantizationType[fmt])
    return torch.from_numpy(np.ascontiguousarray(w.reshape(blocks.shape[0], in_features), dtype=np.float32))


class GGUFLinear(nn.Module):
    """y = x @ W.T + b with W read from GGUF blocks (`blocks` [out_features, in_features / 32 blocks], uint8);
    `activations` "int8": x quantised per 32-value block first (`gguf_kernel.cpp`'s header: not exact), in AVX2
    lanes (Q4_1 over a copy of the blocks repacked for them, `packed`: the same bits); "int8-tiles": the same
    quantisation in AMX tiles over a copy repacked for the tiles (`packed`; `gguf_amx.cpp`: block sums, other
    roundings); "int8-vnni": the tiles' arithmetic and copy in AVX-512 VNNI lanes (hosts without AMX). `blocks`
    stay for prompt rows (the C++ layers' prompt GEMM) and the fp32 weights."""

    def __init__(self, fmt: str, blocks: torch.Tensor, in_features: int, bias: nn.Parameter | None,
                 tied: nn.Parameter | None = None, activations: str = "fp32") -> None:
        super().__init__()
        # the kernel layer's table row (engine/kernels) for the formats it reads, else None (Q4_1 / Q8_0: the
        # older kernel, `gguf_kernel`)
        self.kernel: kernel_layer.LinearKernel | None = None
        if fmt not in FORMATS:
            self._init_table([(fmt, blocks)], in_features, bias, tied, activations)
            return
        if in_features % BLOCK:
            raise CheckpointError(f"a {fmt} weight's input width {in_features} is not a multiple of {BLOCK}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        self.fmt, self.activations = fmt, activations
        layout = "int8-packed" if activations == "int8" and fmt in LANES_PACKED else activations
        self.kernel_fmt = kernel_fmt(fmt, layout)
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        pack = {"int8-tiles": amx_pack, "int8-vnni": amx_pack, "int8-packed": lanes_pack}.get(layout)
        self.register_buffer("packed", None if pack is None else pack(self.blocks, fmt, in_features),
                             persistent=False)
        self.bias = bias
        self._tied = [tied]  # a list: not registered (the embedding owns it)

    @classmethod
    def split(cls, pieces: list[tuple[str, torch.Tensor]], in_features: int, bias: nn.Parameter | None,
              activations: str = "fp32") -> GGUFLinear:
        """A merged projection whose pieces the file stores in different formats of the kernel layer (a Q4_K_M
        file's q and k in Q4_K, v in Q6_K): each piece's rows keep their own blocks and kernel."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._init_table(pieces, in_features, bias, None, activations)
        return self

    def _init_table(self, pieces: list[tuple[str, torch.Tensor]], in_features: int, bias: nn.Parameter | None,
                    tied: nn.Parameter | None, activations: str) -> None:
        """The kernel layer's formats: `parts` (kernel, rows, byte offset) over one buffer of the pieces' blocks."""
        self.parts: list[tuple[kernel_layer.LinearKernel, int, int]] = []
        offset = 0
        for fmt, rows in pieces:
            arith = "int8" if activations != "fp32" and kernel_layer.runs(fmt, "int8") else "fp32"
            kernel = kernel_layer.linear_kernel(fmt, arith)
            if in_features % kernel.qk:
                raise CheckpointError(f"a {fmt} weight's input width {in_features} is not a multiple of {kernel.qk}")
            self.parts.append((kernel, rows.shape[0], offset))
            offset += rows.numel()
        self.kernel = self.parts[0][0]
        self.fmt = "+".join(dict.fromkeys(fmt for fmt, _ in pieces))
        self.activations = "int8" if any(k.arith == "int8" for k, _, _ in self.parts) else "fp32"
        self.kernel_fmt = "+".join(dict.fromkeys(k.name for k, _, _ in self.parts))
        self.in_features, self.out_features = in_features, sum(n for _, n, _ in self.parts)
        blocks = pieces[0][1].contiguous() if len(pieces) == 1 else torch.cat([r.reshape(-1) for _, r in pieces])
        self.register_buffer("blocks", blocks, persistent=False)
        self.register_buffer("packed", None, persistent=False)
        self.bias = bias
        self._tied = [tied]

    def part_blocks(self, i: int) -> torch.Tensor:
        """Part i's blocks [rows, bytes a row] (a view of `blocks`)."""
        kernel, rows, offset = self.parts[i]
        return self.blocks.reshape(-1)[offset:offset + rows * self.in_features // kernel.qk * kernel.block_bytes] \
            .view(rows, -1)

    def _table_forward(self, x: torch.Tensor) -> torch.Tensor:
        outs, first = [], 0
        for i, (kernel, rows, _) in enumerate(self.parts):
            blocks = self.blocks if len(self.parts) == 1 else self.part_blocks(i)
            bias = None if self.bias is None else self.bias[first:first + rows]
            first += rows
            outs.append(kernel_layer.linear(x, blocks, rows, kernel, bias))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    @property
    def weight(self) -> torch.Tensor:
        """The fp32 weights (a tied embedding's own, else dequantised on demand: e.g. a drafter's reduced
        vocabulary takes rows of it at load)."""
        tied = self._tied[0]
        if tied is not None:
            return tied
        if self.kernel is not None:
            return torch.cat([torch.from_numpy(kernel_layer.dequantize(k.fmt, self.part_blocks(i)))
                              .view(rows, self.in_features) for i, (k, rows, _) in enumerate(self.parts)])
        return dequantize(self.fmt, self.blocks, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:  # training through it: the kernel has no backward
            return F.linear(x, self.weight, self.bias)
        if self.kernel is not None:
            return self._table_forward(x)
        return gguf_linear(x, self.kernel_weights, self.out_features, self.kernel_fmt, self.bias)

    @property
    def kernel_weights(self) -> torch.Tensor:
        """What the kernel's `kernel_fmt` reads: the blocks, or their repacked copy."""
        return self.blocks if self.packed is None else self.packed

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.kernel_fmt}"


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


def kernel_activations(activations: str, flag: str) -> tuple[str, str]:
    """`activations` (fp32 | int8 | auto) as the kernels run them on this host: int8 and auto take the fastest
    int8 form (AMX tiles, else AVX-512 VNNI lanes, else AVX2 lanes) unless `SPECSTEP_CPU_ISA` pins one; with a
    note on the forms the host lacks. A pinned form the host cannot run is a ConfigError naming `flag`."""
    if kernel_layer.pinned_isa() and activations in ("int8", "auto"):
        flag = f"{kernel_layer.ISA_ENV}={kernel_layer.pinned_isa()}"
    activations = _pinned_isa(activations)  # before the checks: a pinned ISA the host lacks is refused by them
    if activations == "int8-tiles" and tiles_unavailable():
        raise ConfigError(f"{flag}: AMX tiles cannot run here: {tiles_unavailable()} ({kernel_layer.ISA_ENV}=avx2 "
                          "runs in AVX2 lanes)")
    if activations == "int8-vnni" and vnni_unavailable():
        raise ConfigError(f"{flag}: AVX-512 VNNI lanes cannot run here: {vnni_unavailable()} "
                          f"({kernel_layer.ISA_ENV}=avx2 runs in AVX2 lanes)")
    host_note = ""
    if activations in ("int8", "auto"):  # the host's fastest: AMX tiles, else AVX-512 VNNI lanes, else AVX2 lanes
        if not tiles_unavailable():
            activations = "int8-tiles"
        elif not vnni_unavailable():
            activations, host_note = "int8-vnni", f" (AMX tiles: {tiles_unavailable()})"
        else:
            activations = "int8"
            host_note = f" (AMX tiles: {tiles_unavailable()}; AVX-512 VNNI: {vnni_unavailable()})"
    return {"int8-lanes": "int8"}.get(activations, activations), host_note  # the AVX2 pin -> the kernel's name


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


# SPECSTEP_CPU_ISA (engine.kernels.binding) -> the older Q4_1 / Q8_0 kernel's int8 form on that ISA
_OLD_KERNEL_INT8 = {"amx": "int8-tiles", "avx512": "int8-vnni", "avx2": "int8-lanes"}


def _pinned_isa(activations: str) -> str:
    """`int8` / `auto` where `SPECSTEP_CPU_ISA` pins an ISA: the older kernel's form on it (`amx` is that kernel's
    only: the kernel layer has no AMX rows)."""
    isa = kernel_layer.pinned_isa()
    if activations not in ("int8", "auto") or not isa:
        return activations
    return _OLD_KERNEL_INT8[isa]


def _table_note(swapped: dict[str, int], nbytes: int, table: list[GGUFLinear]) -> str:
    """The ready line's note for a model whose linears read the kernel layer's formats (some perhaps the older
    kernel's Q4_1 / Q8_0)."""
    kinds = ", ".join(f"{n} {fmt}" for fmt, n in sorted(swapped.items()))
    ariths = sorted({m.activations for m in table})
    isa = {"avx512": "AVX-512 VNNI", "avx2": "AVX2"}[table[0].kernel.isa]
    acts = ("int8 activations (llama.cpp's arithmetic: not exact; --activations fp32 for exact)"
            if "int8" in ariths else "fp32 activations (exact)")
    mixed = " (16-bit tensors in fp32)" if len(ariths) > 1 else ""
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
