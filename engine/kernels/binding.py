"""The one binding of specstep's CPU kernel layer (`kernels.cpp`: formats.h's block formats times linear.inc's
arithmetics, one dispatch table keyed by names): part of the one native library (`library.py`, where its C surface
is declared with the rest), its table rows looked up by name.

A row is (weight format, activation arithmetic, ISA): formats are GGML type names (Q4_0, Q5_0, Q5_1, Q2_K, Q3_K,
Q4_K, Q5_K, Q6_K, F16, BF16); arithmetics "fp32" (exact: gguf's dequantised weights times fp32 activations, batch-
invariant), "int8" (llama.cpp's: activations quantised per block, integer products; block formats only) and "bf16"
(BF16 weights times activations rounded to bf16, in AVX-512 BF16 dot products; hosts with them); ISAs "avx2" and
"avx512" (AVX-512 with VNNI: the same bits). The host probe picks the widest ISA that runs here;
`SPECSTEP_CPU_ISA=avx2|avx512` pins one (tests and A/B benchmarks compare them; `amx` pins the older Q4_1 / Q8_0
kernel's tiles, and avx512 here).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import numpy as np
import torch

from specstep.engine.errors import ConfigError, SpecstepError
from specstep.engine.kernels import library
from specstep.engine.kernels.library import i64

ISAS = ("avx512", "avx2")  # widest first
ISA_ENV = "SPECSTEP_CPU_ISA"
ARITHMETICS = ("fp32", "int8", "bf16")

TABLE_BIT = 1 << 16  # kernels.cpp's: a table row's handle in a C++ caller's `fmt` field


class KernelError(SpecstepError, RuntimeError):
    """The kernel layer cannot run here, has no such row, or rejected its arguments (a SpecstepError: the CLI
    reports it as a message, not a traceback)."""


def _build() -> tuple[ctypes.CDLL | None, str]:
    return library.load()


def _lib() -> ctypes.CDLL:
    lib, why = _build()
    if lib is None:
        raise KernelError(f"specstep's CPU kernels cannot run here: {why}")
    return lib


def unavailable() -> str:
    """Why the kernel layer cannot run here ("" if it can); builds it on first call."""
    return _build()[1]


def isa_runs(isa: str) -> bool:
    return bool(_lib().sk_isa_runs(isa.encode()))


def pinned_isa() -> str:
    """`SPECSTEP_CPU_ISA` ("" where unset): the one parser of it, for this layer and the Q4_1 / Q8_0 kernel."""
    chosen = os.environ.get(ISA_ENV, "")
    if chosen and chosen not in (*ISAS, "amx"):
        raise ConfigError(f"{ISA_ENV}={chosen!r}: one of {', '.join(ISAS)} or amx")
    return chosen


def host_isa() -> str:
    """The ISA the kernels run in here: `SPECSTEP_CPU_ISA` if set (an error where it cannot run), else the widest
    the CPU has."""
    chosen = pinned_isa()
    chosen = {"amx": "avx512"}.get(chosen, chosen)  # (AMX pins the Q4_1 / Q8_0 kernel's tiles: no rows here)
    if chosen:
        if not isa_runs(chosen):
            raise KernelError(f"{ISA_ENV}={chosen}: this CPU cannot run it")
        return chosen
    return next(isa for isa in ISAS if isa_runs(isa))


def table() -> list[str]:
    """Every row's name, "format/arith/isa", in the table's order."""
    lib, buf = _lib(), ctypes.create_string_buffer(64)
    names = []
    for i in range(lib.sk_table_size()):
        lib.sk_row_name(i, buf)
        names.append(buf.value.decode())
    return names


def formats() -> tuple[str, ...]:
    return tuple(dict.fromkeys(name.split("/")[0] for name in table()))


def dequantizes(fmt: str) -> bool:
    """Whether `dequantize` reads `fmt`: every table format, and Q4_1 / Q8_0 (whose linears run in the older
    kernel, `engine/models/gguf_kernel.py`)."""
    return _lib().sk_format(fmt.encode(), ctypes.byref(i64()), ctypes.byref(i64())) == 0


def block_of(fmt: str) -> tuple[int, int]:
    """(values, bytes) of one block of `fmt`."""
    qk, nbytes = i64(), i64()
    if _lib().sk_format(fmt.encode(), ctypes.byref(qk), ctypes.byref(nbytes)) != 0:
        raise KernelError(f"no block format {fmt!r} (the kernels read {', '.join(formats())})")
    return qk.value, nbytes.value


def runs(fmt: str, arith: str) -> bool:
    """Whether the table has `fmt` x `arith` (on some ISA)."""
    return any(name.startswith(f"{fmt}/{arith}/") for name in table())


@dataclass(frozen=True, slots=True)
class LinearKernel:
    """One table row, resolved: what a linear over `fmt` blocks calls."""

    fmt: str
    arith: str
    isa: str
    row: int  # the table's index
    qk: int  # values a block
    block_bytes: int
    gemm: bool = False  # a prompt GEMM of its own (the K-quants' int8 rows on AVX-512, BF16's bf16 row)

    @property
    def name(self) -> str:
        return f"{self.fmt}/{self.arith}/{self.isa}"

    @property
    def handle(self) -> int:
        """The row as a C++ caller's `fmt` code (decode_layers.cpp)."""
        return TABLE_BIT | self.row << 4


def runs_here(fmt: str, arith: str) -> bool:
    """Whether the table has `fmt` x `arith` on the host's ISA, and this CPU runs it."""
    return _lib().sk_lookup(fmt.encode(), arith.encode(), host_isa().encode()) >= 0


def linear_kernel(fmt: str, arith: str, isa: str | None = None) -> LinearKernel:
    """The row for `fmt` x `arith` on `isa` (the host's, `host_isa()`, if None)."""
    isa = isa or host_isa()
    row = _lib().sk_lookup(fmt.encode(), arith.encode(), isa.encode())
    if row == -2:
        needs = f"{isa} with AVX-512 BF16" if arith == "bf16" else isa
        raise KernelError(f"{fmt}/{arith}/{isa}: this CPU cannot run {needs}")
    if row < 0:
        raise KernelError(f"no kernel for {fmt} weights with {arith} activations (the table: {', '.join(table())})")
    qk, nbytes = block_of(fmt)
    return LinearKernel(fmt, arith, isa, row, qk, nbytes, bool(_lib().sk_has_gemm(row)))


def linear(x: torch.Tensor, blocks: torch.Tensor, out_features: int, kernel: LinearKernel,
           bias: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias), W [out_features, K] as `blocks` [out_features, K / qk * block bytes] uint8 of
    `kernel.fmt`. Threads: all of torch's unless given; the result does not depend on them."""
    return _call("sk_linear", x, blocks, out_features, kernel, bias, threads)


def gemm(x: torch.Tensor, blocks: torch.Tensor, out_features: int, kernel: LinearKernel,
         bias: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """`linear` with every row taken as a prompt's: the row's prompt GEMM (`kernel.gemm`: int8_gemm.inc,
    bf16_dot.cpp), whose bits are its own (another fp32 order than `linear`'s), whatever the rows beside it and the
    threads."""
    if not kernel.gemm:
        raise KernelError(f"{kernel.name} has no prompt GEMM")
    return _call("sk_gemm", x, blocks, out_features, kernel, bias, threads)


def _call(fn: str, x: torch.Tensor, blocks: torch.Tensor, out_features: int, kernel: LinearKernel,
          bias: torch.Tensor | None, threads: int | None) -> torch.Tensor:
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    if blocks.dtype != torch.uint8 or not blocks.is_contiguous() or blocks.numel() != \
            out_features * (k // kernel.qk) * kernel.block_bytes:
        raise KernelError(f"{kernel.name}: blocks {tuple(blocks.shape)} {blocks.dtype} are not [{out_features}, "
                          f"{k} / {kernel.qk} blocks of {kernel.block_bytes} bytes] contiguous uint8")
    y = x2.new_empty(x2.shape[0], out_features)
    rc = getattr(_lib(), fn)(kernel.row, x2.data_ptr(), x2.shape[0], k, blocks.data_ptr(), out_features,
                             None if bias is None else bias.data_ptr(), y.data_ptr(),
                             threads or torch.get_num_threads())
    if rc != 0:
        raise KernelError(f"{fn}({kernel.name}, K={k}, N={out_features}) returned {rc}")
    return y.view(*x.shape[:-1], out_features)


def dequantize(fmt: str, blocks: np.ndarray | torch.Tensor, threads: int | None = None) -> np.ndarray:
    """`blocks` (uint8, whole blocks of `fmt`) -> their fp32 weights, flat: bit for bit `gguf.quants.dequantize`."""
    raw = np.ascontiguousarray(blocks.numpy() if isinstance(blocks, torch.Tensor) else blocks, dtype=np.uint8)
    qk, nbytes = block_of(fmt)
    if raw.size % nbytes:
        raise KernelError(f"{raw.size} bytes are not whole {fmt} blocks of {nbytes} bytes")
    out = np.empty(raw.size // nbytes * qk, dtype=np.float32)
    if _lib().sk_dequantize(fmt.encode(), raw.ctypes.data, raw.size // nbytes, out.ctypes.data,
                            threads or torch.get_num_threads()) != 0:
        raise KernelError(f"sk_dequantize({fmt}) failed")
    return out
