"""Any Hugging Face folder's linears quantised to Q8_0 at load (`--quantization q8_0`, CPU, one rank).

What a llama.cpp user does with `llama-quantize ... Q8_0`, done as the model loads: each linear's weights (and the
token embedding's, which a tied `lm_head` shares) become GGUF Q8_0 blocks, 32 weights in 34 bytes (an fp16 scale
amax / 127 and 32 int8 values, rounded as llama.cpp's reference quantiser rounds them: the `gguf` package's
`quants.quantize`). A batch-1 decode step reads every weight once, so it reads 1.06 bytes a weight where a bf16
folder's own weights take 2 and an fp32 folder's 4. The blocks then run as a GGUF file's Q8_0 tensors do
(`GGUFLinear`, and the C++ decoder layers), with the `--activations` the kernels take: `auto` multiplies them by
activations quantised per 32 values, as llama.cpp does. Not exact: the weights themselves change (a relative error
of about 0.2% a weight). A 16-bit folder is read in its own dtype and quantised from it, so loading never holds an
fp32 copy of the linears."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import nn

from specstep.engine.errors import ConfigError
from specstep.engine.models.gguf_embedding import GGUFEmbedding
from specstep.engine.models.gguf_kernel import BLOCK, unavailable
from specstep.engine.models.gguf_linear import GGUFLinear
from specstep.engine.models.gguf_model_linears import blocks_note
from specstep.engine.models.int8_forms import kernel_activations

FLAG = "--quantization q8_0"
ROWS_A_TASK = 1024  # rows a worker quantises at a time (numpy releases the GIL: both cores quantise)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """[rows, cols] weights of any float dtype -> their Q8_0 blocks [rows, cols / 32 * 34] uint8 (`cols` a
    multiple of 32), each row quantised on its own."""
    from gguf import GGMLQuantizationType, quants

    rows = weight.shape[0]
    out = np.empty((rows, weight.shape[1] // BLOCK * 34), dtype=np.uint8)

    def task(r0: int) -> None:
        part = weight[r0:r0 + ROWS_A_TASK].float().numpy()
        out[r0:r0 + part.shape[0]] = quants.quantize(part, GGMLQuantizationType.Q8_0)

    with ThreadPoolExecutor(max(1, min(torch.get_num_threads(), 8))) as pool:
        list(pool.map(task, range(0, rows, ROWS_A_TASK)))
    return torch.from_numpy(out)


def use_q8_0_linears(model: nn.Module, activations: str) -> str:
    """Swap every `nn.Linear` whose input width holds whole blocks for a Q8_0 `GGUFLinear`, look the embedding up
    in Q8_0 blocks (one storage with a tied `lm_head`), widen what is left to fp32; the ready line's note."""
    why = unavailable()
    if why:
        raise ConfigError(f"{FLAG}: the GGUF kernel cannot run here: {why}")
    acts, host_note = kernel_activations(activations, FLAG)
    embed = getattr(model, "embed_tokens", None)
    tied = bool(getattr(getattr(model, "cfg", None), "tie_word_embeddings", False))
    embed_blocks = None
    if isinstance(embed, nn.Embedding) and embed.embedding_dim % BLOCK == 0:
        embed_blocks = quantize_q8_0(embed.weight.detach())
    swapped: dict[str, int] = {}
    kept: list[str] = []
    nbytes = 0
    for prefix, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            if child.in_features % BLOCK:
                kept.append(f"{prefix}.{child_name}".lstrip("."))
                continue
            shares = tied and embed_blocks is not None and child.weight is embed.weight
            rows = embed_blocks if shares else quantize_q8_0(child.weight.detach())
            bias = None if child.bias is None else nn.Parameter(child.bias.detach().float(), requires_grad=False)
            setattr(parent, child_name, GGUFLinear("Q8_0", rows, child.in_features, bias, None, acts))
            swapped["Q8_0"] = swapped.get("Q8_0", 0) + 1
            nbytes += 0 if shares else rows.numel()
    note = ""
    if embed_blocks is not None:
        model.embed_tokens = GGUFEmbedding("Q8_0", embed_blocks, embed.embedding_dim)
        note = f"; the embedding looked up in Q8_0 blocks ({embed_blocks.numel() / 2**20:.0f} MB)"
    model.float()  # norms, biases and any linear kept whole (the blocks are uint8: untouched)
    if kept:
        note += f"; {len(kept)} linears kept in fp32 (input widths not a multiple of {BLOCK}: {kept[0]}, ...)"
    if not swapped:
        return f"fp32 weights ({FLAG}: no linear's input width is a multiple of {BLOCK})"
    return f"quantised to Q8_0 at load ({FLAG}): {blocks_note(model, acts, swapped, nbytes, host_note)}{note}"
