"""Call `engine/kernels/gguf_kernel.cpp`: GGUF's quantised blocks (Q4_1, Q8_0) times fp32 activations, or times
activations quantised to int8 per 32-value block (`--activations int8`, llama.cpp's arithmetic: faster, not exact) in
AVX2 lanes or, where the host has AMX-INT8, in AMX tiles over a repacked copy of the blocks (`gguf_amx.cpp`: block sums,
verify rows nearly free), part of the one native library (`engine/kernels/library.py`); where it cannot run,
`unavailable()` says why and the loader keeps the dequantised fp32 weights."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from specstep.engine.kernels import library
from specstep.engine.native import cpu_flags
from specstep.engine.thread_choice import ThreadChoice, size_of

FORMATS = {"Q4_1": 0, "Q8_0": 1}  # the GGML type names the kernel reads -> its `fmt` argument
# The kernel's activation arithmetics -> the `fmt` argument's bits 1-3: fp32; int8 in AVX2 lanes; int8 in AMX
# tiles (block sums, over `amx_pack`'s copy of the blocks); int8 in AVX2 lanes over `lanes_pack`'s copy (Q4_1
# only: int8's bits, faster); int8 in AVX-512 VNNI lanes over `amx_pack`'s copy at every row count (the tiles'
# arithmetic and bits, where the host has AVX-512 VNNI and no AMX)
ACTIVATIONS = {"fp32": 0, "int8": 2, "int8-tiles": 6, "int8-packed": 10, "int8-vnni": 14}
LANES_PACKED = ("Q4_1",)  # the GGML types `lanes_pack` repacks
VNNI_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")
AMX_CPU_FLAGS = ("amx_tile", "amx_int8", *VNNI_CPU_FLAGS)
BF16_TILE_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # beside AMX_CPU_FLAGS: the AMX formats' prompt GEMM


def kernel_fmt(fmt: str, activations: str = "fp32") -> str:
    """The kernel's name for GGML type `fmt` times `activations`: "Q4_1", "Q4_1/int8" or "Q4_1/int8-tiles"."""
    return fmt if activations == "fp32" else f"{fmt}/{activations}"


def fmt_code(name: str) -> int:
    """The kernel's `fmt` argument for a `kernel_fmt` name."""
    fmt, _, act = name.partition("/")
    return FORMATS[fmt] | ACTIVATIONS[act or "fp32"]
BLOCK = 32  # weights a block
# One thread or all of torch's per call, chosen per kind of call (format, shape) by timing its row counts on their
# first calls (`engine.thread_choice`: waking a passive OpenMP thread costs as much as a small linear's work).
THREADS = ThreadChoice()


class KernelError(RuntimeError):
    """The kernel rejected its arguments (a shape it cannot take), or failed to allocate."""


def _build() -> tuple[ctypes.CDLL | None, str]:
    return library.load()


def unavailable() -> str:
    """Why the kernel cannot run here ("" if it can); builds it on first call."""
    return _build()[1]


def build_id() -> str:
    """The loaded build's name (its sources' hash): measurements of the kernel are cached under it."""
    lib = _build()[0]
    return Path(lib._name).stem if lib is not None else ""


def kernel_isa() -> str:
    """Which form fp32 activations run in here: "avx512" (two weight rows a register, where the CPU has AVX-512)
    or "avx2" (the same bits either way)."""
    lib, _ = _build()
    return "avx512" if lib is not None and lib.gguf_use_avx512(1) else "avx2"


@cache
def tiles_unavailable() -> str:
    """Why int8 activations cannot run in AMX tiles here ("" if they can): the kernel, the CPU's flags (AVX-512 and
    AMX-INT8) and the OS's grant of the tile state (asked for once per process)."""
    lib, why = _build()
    if lib is None:
        return why
    missing = [f for f in AMX_CPU_FLAGS if f not in cpu_flags()]
    if missing:
        return f"this CPU lacks {'/'.join(missing).upper()}"
    if lib.gguf_amx_init() != 0:
        return "the OS did not grant the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return ""


@cache
def bf16_tiles_unavailable() -> str:
    """Why the AMX formats' prompt GEMM cannot run in AMX-BF16 tiles here ("" if it can): the int8 tiles' needs,
    and the CPU's AMX-BF16 and AVX512-BF16 flags (`gguf_amx_bf16.cpp`)."""
    why = tiles_unavailable()
    if why:
        return why
    missing = [f for f in BF16_TILE_CPU_FLAGS if f not in cpu_flags()]
    return f"this CPU lacks {'/'.join(missing).upper()}" if missing else ""


@cache
def vnni_unavailable() -> str:
    """Why int8 activations cannot run in AVX-512 VNNI lanes over the tile layout here ("" if they can)."""
    lib, why = _build()
    if lib is None:
        return why
    missing = [f for f in VNNI_CPU_FLAGS if f not in cpu_flags()]
    return f"this CPU lacks {'/'.join(missing).upper()}" if missing else ""


def amx_lane_rows(rows: int) -> int:
    """Calls of at most `rows` rows of x (0-8) take the AMX formats' AVX-512 VNNI lanes, more the tiles; -1 restores
    the defaults (`set_amx_lane_defaults`, else `gguf_amx.cpp`'s built-in ones). The same bits either way: tests
    and benchmarks compare the two. Holds for the C++ layers' calls too (one library). Returns the previous
    setting."""
    lib = _build()[0]
    if lib is None:
        raise KernelError(f"the GGUF kernel cannot run here: {unavailable()}")
    return lib.gguf_amx_lane_rows(rows)


# The crossovers the loader measured (`engine.models.amx_crossover`), per GGML type: calls of at most that many rows
# take the AMX formats' VNNI lanes: the linears' calls and the C++ layers' alike (one library).
AMX_LANE_DEFAULTS: dict[str, int] = {}


def set_amx_lane_defaults(rows: dict[str, int]) -> None:
    """Calls of at most `rows[fmt]` rows (0-8) of the AMX formats take the VNNI lanes (the same bits); a format not
    named keeps its built-in default. Recorded (`AMX_LANE_DEFAULTS`) and given to the library (`apply_...`)."""
    AMX_LANE_DEFAULTS.update(rows)
    lib = _build()[0]
    if lib is not None:
        apply_amx_lane_defaults(lib)


def apply_amx_lane_defaults(lib: ctypes.CDLL) -> None:
    """Give the library the recorded crossovers (-1: its built-in default)."""
    lib.gguf_amx_lane_defaults(AMX_LANE_DEFAULTS.get("Q4_1", -1), AMX_LANE_DEFAULTS.get("Q8_0", -1))


def amx_lane_rows_now(fmt: str) -> int:
    """The row count up to which calls of GGML type `fmt`'s AMX format take the VNNI lanes now."""
    lib = _build()[0]
    if lib is None:
        raise KernelError(f"the GGUF kernel cannot run here: {unavailable()}")
    return lib.gguf_amx_lane_rows_now(FORMATS[fmt])


def _repack(kind: str, blocks: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    lib, why = _build()
    if lib is None:
        raise KernelError(f"the GGUF kernel cannot run here: {why}")
    blocks = blocks.contiguous()
    n = blocks.shape[0]
    size = getattr(lib, f"gguf_{kind}_bytes")(FORMATS[fmt], n, in_features)
    out = torch.empty(max(size, 0), dtype=torch.uint8)
    if size < 0 or getattr(lib, f"gguf_{kind}_pack")(blocks.data_ptr(), n, in_features, FORMATS[fmt],
                                                        out.data_ptr()) != 0:
        raise KernelError(f"gguf_{kind}_pack({fmt}, K={in_features}) failed")
    return out


def amx_pack(blocks: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    """`blocks` [N, K / 32 blocks] of GGML type `fmt` repacked for the AMX tiles (`gguf_amx.cpp`: groups of 16
    weight rows, the same bytes a weight): what "int8-tiles" and "int8-vnni" kernel formats take in place of the
    blocks."""
    return _repack("amx", blocks, fmt, in_features)


def lanes_pack(blocks: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    """Q4_1 `blocks` [N, K / 32 blocks] repacked for int8 activations in AVX2 lanes (`gguf_int8.cpp`: a row's
    blocks in pairs, 32 bytes of nibbles a pair, then its d's and m's): what "int8-packed" kernel formats take in
    place of the blocks, for the same bits as "int8" over the blocks."""
    return _repack("lanes", blocks, fmt, in_features)


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, out_features: int, fmt: str,
                bias: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """x [..., K] float32 on CPU @ W.T (+ bias): W [out_features, K] as `blocks` [out_features, K / 32 blocks]
    uint8 of GGML type `fmt`, or `kernel_fmt(type, "int8")` for int8 activations (`kernel_fmt(type,
    "int8-tiles")`: `blocks` is `amx_pack`'s copy, and `tiles_unavailable()` must be ""; "int8-vnni": that copy,
    and `vnni_unavailable()` ""; "int8-packed": `lanes_pack`'s). Threads: one or all of
    torch's, whichever this kind of call measured faster (`THREADS`), unless given; the result does not depend
    on them."""
    lib, why = _build()
    if lib is None:
        raise KernelError(f"the GGUF kernel cannot run here: {why}")
    if fmt.endswith("-tiles") and tiles_unavailable():  # (also asks the OS for the tile state, once)
        raise KernelError(f"{fmt} cannot run here: {tiles_unavailable()}")
    if fmt.endswith("-vnni") and vnni_unavailable():
        raise KernelError(f"{fmt} cannot run here: {vnni_unavailable()}")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    y = x2.new_empty(x2.shape[0], out_features)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    m, xp, yp = x2.shape[0], x2.data_ptr(), y.data_ptr()
    bp, wp, code = None if bias is None else bias.data_ptr(), blocks.data_ptr(), fmt_code(fmt)

    def call(n: int) -> int:
        return lib.gguf_linear(xp, m, k, wp, out_features, code, bp, yp, n)

    rows = size_of(m)
    rc = call(threads) if threads else THREADS.run((fmt, out_features, k), rows, m * out_features * k,
                                                   torch.get_num_threads(), call)
    if rc != 0:
        raise KernelError(f"gguf_linear({fmt}, K={k}, N={out_features}) returned {rc}")
    return y.view(*x.shape[:-1], out_features)


def gguf_gemm(x: torch.Tensor, blocks: torch.Tensor, out_features: int, fmt: str,
              bias: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """As `gguf_linear`, by the prompt GEMM: for a GGML type `fmt` (fp32 activations) the dequantised weights
    unpacked in fp32 panels (`gguf_gemm.cpp`); for its "int8-tiles" format (`blocks`: `amx_pack`'s copy, and
    `bf16_tiles_unavailable()` must be "") bf16 weights and rows in AMX-BF16 tiles (`gguf_amx_bf16.cpp`). Faster
    from tens of rows, row-invariant too, but other bits than the kernel's. The C++ layers take it for prompt rows
    (`decode_layers`); here for tests and benchmarks. Threads: all of torch's unless given."""
    lib, why = _build()
    if lib is None:
        raise KernelError(f"the GGUF kernel cannot run here: {why}")
    if fmt.endswith("-tiles") and bf16_tiles_unavailable():  # (also asks the OS for the tile state, once)
        raise KernelError(f"the prompt GEMM of {fmt} cannot run here: {bf16_tiles_unavailable()}")
    if fmt not in FORMATS and not fmt.endswith("/int8-tiles"):
        raise KernelError(f"no prompt GEMM for {fmt}")
    k = x.shape[-1]
    x2 = x.reshape(-1, k).float().contiguous()
    y = x2.new_empty(x2.shape[0], out_features)
    bias = None if bias is None else bias.float().contiguous()
    rc = lib.gguf_gemm(x2.data_ptr(), x2.shape[0], k, blocks.data_ptr(), out_features, fmt_code(fmt),
                       None if bias is None else bias.data_ptr(), y.data_ptr(), threads or torch.get_num_threads())
    if rc != 0:
        raise KernelError(f"gguf_gemm({fmt}, K={k}, N={out_features}) returned {rc}")
    return y.view(*x.shape[:-1], out_features)
