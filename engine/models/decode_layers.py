"""A GGUF model's decoder layers in C++ (`engine/kernels/decode_layers.cpp`, `--cpu-layers auto`): the CPU's counterpart
of a captured graph, for the part of a step that is not weights.

Eager torch runs ~40 small ops a layer around the four linears (norms, rotary, the KV write, residuals, the MLP
gate, views and casts), each dispatched from Python: at batch 1 on a 2-core host that was ~18 ms of a 42 ms
SmolLM2 step, as much as the weights. With every linear of every layer in the GGUF kernel, a layer becomes two
C++ calls around its attention (`attention_in`, `attention_out_mlp`), and a step of few positions a lane whose
attention takes the C++ kernel (decode, verify, draft, refill, and prompts it takes) one call for the whole stack
(`decode_stack`).
Each call is one OpenMP region whose threads split every phase and meet at spinning barriers, so a step wakes a
passive thread once rather than once a linear. Both ways run the same C++ functions, so a row's bits are the
same whichever way its step went, whatever shares it and whatever the threads (tested). Its arithmetic differs
from the torch layers' by rounding only (the RMS norm's sum order, the MLP gate's exp), tested against them.

It runs where the model is llama-family on one rank with every decoder linear read from GGUF blocks, fp32
activations and caches, and the library builds; the ready line says which way it went and why.
"""

from __future__ import annotations

import ctypes
from functools import partial

import torch
from torch import nn

from specstep.engine.attention import cpu_attention
from specstep.engine.attention.cpu_attention import KV_DTYPES
from specstep.engine.attention.invariant_attention import MAX_QUERY_ROWS
from specstep.engine.forward_batch import AttentionMetadata, ForwardBatch, SplitAttention
from specstep.engine.kernels import library
from specstep.engine.kv_cache import KVPool
from specstep.engine.models.gguf_kernel import bf16_tiles_unavailable, fmt_code
from specstep.engine.models.gguf_linear import GGUFLinear
from specstep.engine.thread_choice import ThreadChoice, size_of

# One thread or all of torch's for a call, chosen per kind of call (and model: a draft model's layers and the
# target's cost differently) by timing row counts (`engine.thread_choice`); a call's work is counted as its rows
# times its largest linear, so prompts take every thread untimed.
THREADS = ThreadChoice()

ptr = ctypes.c_void_p


class LayerKernelError(RuntimeError):
    """The C++ layers rejected a call (a shape or KV slot out of range) or failed to allocate."""


def _build() -> tuple[ctypes.CDLL | None, str]:
    return library.load()


def unavailable() -> str:
    """Why the C++ layers cannot run here ("" if they can); builds them on first call."""
    return _build()[1]


def why_not(model: nn.Module) -> str:
    """Why `model`'s layers cannot run in C++ ("" if they can)."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or cfg.architecture not in ("llama", "qwen2"):
        return "not a llama-family model"
    if model.tp.world_size > 1:
        return "tensor-parallel ranks"
    for layer in model.layers:
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if not all(isinstance(lin, GGUFLinear) for lin in linears):
            return "not every decoder linear reads GGUF blocks"
        if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in layer.parameters()):
            return "not fp32 on CPU"
    rank = model.rank_cfg
    if (rank.hidden_size % 8 or rank.intermediate_size % 8 or rank.head_dim % 8 or rank.head_dim > 256
            or rank.num_heads % rank.num_kv_heads):
        return f"a shape the C++ layers do not take (hidden {rank.hidden_size}, head_dim {rank.head_dim})"
    return unavailable()


# `prompt_rows`' flags: each linear's prompt GEMM (the fp32 one over dequantised panels; a K-quant's int8 one, where
# its kernel has it), or the AMX tiles' AMX-BF16 form
PROMPT_GEMM, PROMPT_GEMM_BF16_TILES = 1, 2


# What the ready line says of a kernel layer arithmetic's own prompt GEMM
OWN_GEMMS = {"int8": "; prompt rows of the blocks in an int8 GEMM (exact integer totals a block)",
             "bf16": "; BF16 prompt rows in a bf16 GEMM (AVX-512 BF16, one fp32 sum an output)"}


def prompt_gemm_kind(activations: list[str]) -> int:
    """The prompt GEMM a model's prompt rows take in the C++ layers, by its linears' activations: the AMX tiles'
    AMX-BF16 form where the host has it (else 0: the tiles themselves), 0 for the VNNI lanes (they take prompt
    rows themselves), each linear's own prompt GEMM otherwise."""
    if activations == ["int8-tiles"]:
        return 0 if bf16_tiles_unavailable() else PROMPT_GEMM_BF16_TILES
    return 0 if activations == ["int8-vnni"] else PROMPT_GEMM


def prompt_rows(meta: AttentionMetadata | SplitAttention, tokens: int, kind: int = PROMPT_GEMM
                ) -> torch.Tensor | None:
    """uint8 [tokens]: `kind` for the rows whose lane has more than MAX_QUERY_ROWS positions in this step (prompts
    and prompt chunks: their linears take the prompt GEMM, `gguf_gemm.cpp`, or for `PROMPT_GEMM_BF16_TILES` its
    AMX-BF16 form over the tiles' copy, `gguf_amx_bf16.cpp`), 0 for the others (decode, verify, draft and refill
    rows keep the kernel, so their bits never depend on a prompt beside them); None if no row is a prompt's."""
    parts = meta.parts if isinstance(meta, SplitAttention) else [(0, tokens, meta)]
    flags = None
    for t0, _, part in parts:
        long = part.q_valid.sum(1) > MAX_QUERY_ROWS
        if bool(long.any()):
            flags = torch.zeros(tokens, dtype=torch.uint8) if flags is None else flags
            flags[t0 + part.q_index[part.q_valid & long.unsqueeze(1)]] = kind
    return flags


def _linear(lin: GGUFLinear, keep: list) -> library.Linear:
    """The C++ struct of `lin`: for the kernel layer's formats one struct a part (a merged projection of several
    formats), chained by `rest`; `keep` holds what the structs point at."""
    bias = None if lin.bias is None else lin.bias.detach().float().contiguous()
    if bias is not None:
        keep.append(bias)
    if lin.kernel is None:
        return library.Linear(lin.blocks.data_ptr(), 0 if bias is None else bias.data_ptr(), lin.out_features,
                              lin.in_features, fmt_code(lin.kernel_fmt),
                              0 if lin.packed is None else lin.packed.data_ptr())
    rest, first = None, lin.out_features
    for i in reversed(range(len(lin.parts))):
        kernel, rows, _ = lin.parts[i]
        first -= rows
        part = library.Linear(lin.part_blocks(i).data_ptr(), 0 if bias is None else bias[first:].data_ptr(), rows,
                              lin.in_features, kernel.handle, 0, None if rest is None else ctypes.pointer(rest))
        keep.append(part)
        rest = part
    return rest


class NativeLayers:
    """`model`'s decoder layers as the C++ library runs them (`why_not(model)` must be ""). Holds pointers to the
    model's weights: built after the weights are final (GGUF blocks swapped in), and dropped with the model."""

    def __init__(self, model: nn.Module) -> None:
        self._lib = _build()[0]
        cfg = model.rank_cfg
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.scale = model.layers[0].self_attn.scale
        self._max_work = max(lin.out_features * lin.in_features for lin in model.modules()
                             if isinstance(lin, GGUFLinear) and lin is not getattr(model, "lm_head", None))
        # this model's calls time apart from another's (a draft's; the same model's with other activations)
        acts = sorted({lin.activations for lin in model.modules() if isinstance(lin, GGUFLinear)})
        self._model_key = (len(model.layers), self._max_work, *acts)
        # Which prompt GEMM prompt rows take (`prompt_rows`' flag; 0: none, they take the kernel). fp32 and the AVX2
        # lanes: the fp32 GEMM. AMX tiles: their AMX-BF16 GEMM where the host has it (bf16 weights and rows summed
        # in fp32: 1.6x / 1.9x the int8 tiles at 128 / 1,024 rows of SmolLM2's layers, 2 threads, and 2-5x nearer
        # the exact product than int8 activations), else the tiles themselves (2.4-2.9x the fp32 GEMM at 128-512
        # rows); the VNNI lanes over the tiles' copy take prompt rows too (1.8-2.3x the fp32 GEMM at 32-512 rows, 2
        # threads, AMD EPYC with AVX-512 VNNI).
        # The kernel layer's fp32 linears (16-bit tensors and folders, K-quants with fp32 activations) take the fp32
        # GEMM over their dequantised panels (a bf16 SmolLM2 folder's 512-token prompt: 1.41 s in the kernel); its
        # int8 and bf16 ones their own GEMM where the host has it (`int8_gemm.inc`: 2x the kernel at 128 rows on one
        # AMD EPYC core for the K-quants, 4x for the legacy formats; `bf16_dot.cpp`); the others take prompt rows
        # themselves.
        asked = sorted({lin.activations for lin in model.modules()
                        if isinstance(lin, GGUFLinear) and (lin.kernel is None or lin.activations == "fp32"
                                                            or any(k.gemm for k, _, _ in lin.parts))})
        self.prompt_gemm = prompt_gemm_kind(asked) if asked else 0
        # the arithmetics whose kernels bring a prompt GEMM of their own (`OWN_GEMMS`)
        self.own_gemms = sorted({k.arith for lin in model.modules() if isinstance(lin, GGUFLinear) and lin.kernel
                                 for k, _, _ in lin.parts if k.gemm})
        self._shape = library.Shape(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                    cfg.intermediate_size, cfg.rms_norm_eps, self.scale)
        self._keep: list[torch.Tensor] = []  # contiguous copies the structs point at
        layers = []
        for layer in model.layers:
            norms = [n.weight.detach().contiguous() for n in (layer.input_layernorm, layer.post_attention_layernorm)]
            self._keep += norms
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(library.Layer(norms[0].data_ptr(), norms[1].data_ptr(), _linear(attn.qkv_proj, self._keep),
                                        _linear(attn.o_proj, self._keep), _linear(mlp.gate_up_proj, self._keep),
                                        _linear(mlp.down_proj, self._keep)))
        self._layers = (library.Layer * len(layers))(*layers)
        # the final norm's weight (its eps is the layers', the model's rms_norm_eps)
        self._norm = model.norm.weight.detach().float().contiguous()
        self._keep.append(self._norm)
        self._caches: tuple[tuple[int, ...], ctypes.Array, ctypes.Array] | None = None

    def _cache_arrays(self, kv: KVPool) -> tuple[ctypes.Array, ctypes.Array]:
        """The pool's per-layer K and V pointers (rebuilt only when the pool is reallocated)."""
        ptrs = tuple(t.data_ptr() for t in kv.k) + tuple(t.data_ptr() for t in kv.v)
        if self._caches is None or self._caches[0] != ptrs:
            n = len(kv.k)
            self._caches = (ptrs, (ptr * n)(*ptrs[:n]), (ptr * n)(*ptrs[n:]))
        return self._caches[1], self._caches[2]

    @staticmethod
    def runs(kv: KVPool) -> bool:
        """Whether this pool is one the C++ layers write (fp32 or bf16 on CPU, [slots, kv_heads, head_dim]
        contiguous)."""
        k = kv.k[0]
        return k.dtype in KV_DTYPES and k.device.type == "cpu" and k.is_contiguous()

    def _run(self, kind: tuple, size: int, rows: int, fn, *args) -> None:
        """fn(*args, threads) with the thread count this kind of call (its name and the cache dtype it reads)
        over `size` rows (`rows`, or the power of two a prompt's rows are timed as) takes (`THREADS`)."""
        rc = THREADS.run((*kind, self._model_key), size, rows * self._max_work, torch.get_num_threads(),
                         partial(fn, *args))
        if rc != 0:
            raise LayerKernelError(f"{kind[0]} over {rows} rows returned {rc}")

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVPool, rope: tuple[torch.Tensor, torch.Tensor],
                attention) -> torch.Tensor:
        """The final hidden states: every decoder layer, then the model's final norm (x [T, hidden] from the
        embedding, not modified). One call where `attention` would attend the whole step in the C++ kernel, else
        two a layer around it and the norm; both end in the same norm arithmetic, so a row's bits do not depend
        on which ran."""
        x = x.float().contiguous().clone()
        m = x.shape[0]
        cos, sin = (t.reshape(m, self.head_dim).float().contiguous() for t in rope)
        slots = batch.slot_mapping.long().contiguous()
        step = (ctypes.byref(self._shape), x.data_ptr(), m, cos.data_ptr(), sin.data_ptr(), slots.data_ptr())
        if attention.runs_kernel(x, kv.k[0], batch.attn, self.num_heads):
            self._stack(step, batch.attn, kv)
        else:
            self._per_layer(step, batch.attn, kv, attention)
            self._lib.final_norm(ctypes.byref(self._shape), self._norm.data_ptr(), x.data_ptr(), m)
        return x

    def _stack(self, step: tuple, meta: AttentionMetadata, kv: KVPool) -> None:
        shape, x, m, cos, sin, slots = step
        q_index, q_valid, q_pos, kv_len, table = cpu_attention._indices(meta)
        paging = library.Paging(q_index.data_ptr(), q_valid.data_ptr(), q_pos.data_ptr(), kv_len.data_ptr(),
                                table.data_ptr(), q_index.shape[0], q_index.shape[1], table.shape[1], meta.page_size)
        ks, vs = self._cache_arrays(kv)
        # prompts the kernel attends (`cpu_attention.takes_prompt`) come here too, their linears' rows flagged for
        # the prompt GEMM; a step of few positions asks nothing of the host (a captured step may not)
        long = q_index.shape[1] > MAX_QUERY_ROWS
        gemm = prompt_rows(meta, m, self.prompt_gemm) if long and self.prompt_gemm else None
        rows = size_of(m)
        bf16 = kv_bf16(kv)
        self._run(("decode_stack", bf16), rows, m, self._lib.decode_stack, shape, self._layers, len(self._layers),
                  self._norm.data_ptr(), x, m, cos, sin, slots, ks, vs, kv.k[0].shape[0], ctypes.byref(paging),
                  None if gemm is None else gemm.data_ptr(), bf16)

    def _per_layer(self, step: tuple, meta: AttentionMetadata | SplitAttention, kv: KVPool, attention) -> None:
        shape, x, m, cos, sin, slots = step
        rows = size_of(m)
        q = torch.empty(m, self.num_heads * self.head_dim)
        gemm = prompt_rows(meta, m, self.prompt_gemm) if self.prompt_gemm else None
        gemm_ptr = None if gemm is None else gemm.data_ptr()
        bf16 = kv_bf16(kv)
        for i in range(len(self._layers)):
            layer = ctypes.byref(self._layers[i])  # an element shares the array's memory
            self._run(("attention_in", bf16), rows, m, self._lib.attention_in, shape, layer, x, m, cos, sin, slots,
                      kv.k[i].data_ptr(), kv.v[i].data_ptr(), kv.k[i].shape[0], q.data_ptr(), gemm_ptr, bf16)
            o = attention.forward(q, kv.k[i], kv.v[i], meta, self.num_heads, self.scale).contiguous()
            self._run(("attention_out_mlp",), rows, m, self._lib.attention_out_mlp, shape, layer, x, m, o.data_ptr(),
                      gemm_ptr)


def kv_bf16(kv: KVPool) -> int:
    """The C++ layers' cache flag: 1 for a bf16 pool, 0 for fp32."""
    return int(kv.k[0].dtype == torch.bfloat16)


def use_native_layers(model: nn.Module, mode: str) -> str:
    """Install `NativeLayers` on `model` (`model.native`) where `mode` ("auto" | "torch") and the model allow;
    the ready line's note ("" where the model has no GGUF linears, so nothing to say)."""
    model.native = None
    if not any(isinstance(m, GGUFLinear) for m in model.modules()):
        return ""
    if mode == "torch":
        return "decoder layers in torch (--cpu-layers torch)"
    why = why_not(model)
    if why:
        return f"decoder layers in torch ({why})"
    model.native = NativeLayers(model)
    prompts = ("; prompt rows in AMX-BF16 tiles (weights and rows rounded to bf16, products summed in fp32)"
               if model.native.prompt_gemm == PROMPT_GEMM_BF16_TILES else
               "".join(OWN_GEMMS[a] for a in model.native.own_gemms) if model.native.prompt_gemm else "")
    return (f"decoder layers in specstep's C++ (one call a step for decode, verify, draft, refill and prompts the "
            f"attention kernel takes{prompts})")

