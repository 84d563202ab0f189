"""Call `engine/kernels/cpu_attention.cpp`: paged attention for steps of at most MAX_QUERY_ROWS positions, and prompts
of at most PROMPT_ROWS, on CPU (fp32 queries, fp32 or bf16 caches), one call a layer and batch-invariant by construction
(a row's bits never depend on what shares its step). Part of the one native library (`engine/kernels/library.py`); where
it cannot run (`unavailable()` says why), `invariant_attention` (torch ops) is the batch-invariant path."""

from __future__ import annotations

import ctypes

import torch

from specstep.engine.forward_batch import AttentionMetadata
from specstep.engine.kernels import library
from specstep.engine.thread_choice import ThreadChoice

# One thread or all of torch's, whichever a call of this much work (multiply-adds: rows x keys x head_dim, both
# GEMM-like passes; its size the work's power of two, since the keys grow every step) measured faster
# (`engine.thread_choice`, as `gguf_kernel.THREADS`: a batch-1 decode step's layer, ~9 x 200 x 64 x 2, is far
# below a wake-up's worth).
THREADS = ThreadChoice()


class AttentionKernelError(RuntimeError):
    """The kernel rejected a shape (head_dim not a multiple of 8 or over 256, keys past the page table)."""


def _build() -> tuple[ctypes.CDLL | None, str]:
    return library.load()


# Forwards of more positions a lane (prompts, prompt chunks outside mixed steps) take the kernel too, up to
# PROMPT_ROWS while a thread's scores (query heads a KV head x rows x keys floats) stay within PROMPT_SCORES; past
# them, SDPA's blocked GEMMs. The kernel reads the pages where they are, where a prompt's SDPA first gathers every
# lane's keys and values into contiguous copies and expands them to the query heads, each layer; and with the
# kernel attending, the C++ layers run the whole prompt in one call (`decode_layers`). SmolLM2 prompts to their
# first token, int8 activations, 2 threads, AMX host, SDPA (a call a layer) / the kernel (one call), ms: 128 tokens
# x 1 68 / 41, x 8 353 / 271; 512 x 1 239 / 197, x 4 1,884 / 973; 1,024 x 1 572 / 622. The kernel's AVX2 form
# (what an AVX2 host runs; SDPA still AVX-512 here): 256 x 1 115 / 100, 512 x 1 244 / 234.
PROMPT_ROWS = 512
KV_DTYPES = (torch.float32, torch.bfloat16)  # the caches the kernel reads (bf16 widened to fp32 exactly)
SCORE_PAD = 16  # keys a row's scores are padded by (`cpu_attention.cpp`'s SCORE_PAD)
PROMPT_SCORES = 1 << 22  # 16 MB a thread: 512 rows over ~2,700 keys at 3 query heads a KV head


def takes_prompt(rows: int, keys: int, group: int) -> bool:
    """Whether a forward of `rows` positions a lane over at most `keys` keys, `group` query heads a KV head, takes
    the kernel (rows past MAX_QUERY_ROWS: a prompt's)."""
    return rows <= PROMPT_ROWS and group * rows * (keys + SCORE_PAD) <= PROMPT_SCORES


def unavailable() -> str:
    """Why the kernel cannot run here ("" if it can); builds it on first call."""
    return _build()[1]


def runs(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this forward can take the kernel: CPU, fp32 queries, an fp32 or bf16 cache, a head size it
    takes."""
    return (q.device.type == "cpu" and q.dtype == torch.float32
            and k_cache.dtype in KV_DTYPES and k_cache.shape[-1] % 8 == 0 and k_cache.shape[-1] <= 256
            and not unavailable())


def _indices(meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
    """The metadata as the kernel reads it (int64 / uint8, contiguous), once a forward: every layer shares it."""
    key = ("cpu_attention",)
    if key not in meta._blocks:
        meta._blocks[key] = tuple(t.contiguous() for t in (
            meta.q_index.long(), meta.q_valid.to(torch.uint8), meta.q_pos.long(), meta.kv_len.long(),
            meta.page_table.long()))
    return meta._blocks[key]


def cpu_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  num_heads: int, scale: float, threads: int | None = None) -> torch.Tensor:
    """q [T, H * D] -> [T, H * D]. Threads: one or all of torch's, whichever this much work measured faster
    (`THREADS`), unless given; the result does not depend on them."""
    lib, why = _build()
    if lib is None:
        raise AttentionKernelError(f"the CPU attention kernel cannot run here: {why}")
    _, hkv, d = k_cache.shape
    q = q.contiguous()
    out = q.new_zeros(q.shape)  # rows no valid query row writes (a graph's padding lanes) stay 0
    q_index, q_valid, q_pos, kv_len, table = _indices(meta)
    b, qn = q_index.shape
    if v_cache.dtype != k_cache.dtype or k_cache.dtype not in KV_DTYPES:
        raise AttentionKernelError(f"K and V caches of one dtype, float32 or bfloat16, got {k_cache.dtype} and "
                                   f"{v_cache.dtype}")
    bf16 = int(k_cache.dtype == torch.bfloat16)
    work = 2 * b * qn * num_heads * meta.keys * d

    def call(n: int) -> int:
        return lib.cpu_attention(q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bf16, b, qn,
                                 num_heads, hkv, d, q_index.data_ptr(), q_valid.data_ptr(), q_pos.data_ptr(),
                                 kv_len.data_ptr(), table.data_ptr(), table.shape[1], meta.page_size, scale, n)

    rc = call(threads) if threads else THREADS.run(("attention", bf16), work.bit_length(), work,
                                                   torch.get_num_threads(), call)
    if rc != 0:
        raise AttentionKernelError(f"cpu_attention(B={b}, Q={qn}, H={num_heads}, Hkv={hkv}, D={d}) returned {rc}")
    return out
