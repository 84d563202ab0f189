"""The one native library (`library.cpp`: every C++ source in this folder, one translation unit): built once per
host by `engine.native` (one cache key: every source, the flags and the compiler), loaded once per process, and its
C surface declared once below (`SIGNATURES`, with the structs decode_layers.cpp takes), set on the library as it
loads. Callers (`binding.py`, `gguf_kernel.py`, `decode_layers.py`, `cpu_attention.py`, `argmax.py`) only call."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

from specstep.engine.native import load_kernel

HERE = Path(__file__).parent
SOURCE = HERE / "library.cpp"
# what SOURCE #includes, directly or not (keys the build)
INCLUDES = tuple(sorted(p for p in HERE.iterdir() if p.suffix in (".cpp", ".h", ".inc") and p != SOURCE))

i64, ptr, c_int, c_float, c_char_p = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_char_p
P = ctypes.POINTER


# decode_layers.cpp's structs, field for field
class Linear(ctypes.Structure):
    pass


Linear._fields_ = [("blocks", ptr), ("bias", ptr), ("n", i64), ("k", i64), ("fmt", i64), ("packed", ptr),
                   ("rest", P(Linear))]  # rest: the next rows' linear (another format), or null


class Layer(ctypes.Structure):
    _fields_ = [("norm_in", ptr), ("norm_post", ptr), ("qkv", Linear), ("o", Linear), ("gate_up", Linear),
                ("down", Linear)]


class Shape(ctypes.Structure):
    _fields_ = [("hidden", i64), ("heads", i64), ("kv_heads", i64), ("head_dim", i64), ("inter", i64),
                ("eps", c_float), ("scale", c_float)]


class Paging(ctypes.Structure):
    _fields_ = [("q_index", ptr), ("q_valid", ptr), ("q_pos", ptr), ("kv_len", ptr), ("table", ptr), ("B", i64),
                ("Q", i64), ("P", i64), ("page_size", i64)]


_GGUF_LINEAR = [ptr, i64, i64, ptr, i64, c_int, ptr, ptr, c_int]  # x, M, K, blocks, N, fmt, bias, y, threads
_PACK = [ptr, i64, i64, c_int, ptr]  # blocks, N, K, fmt, out
# Every exported function: name -> (result, arguments). A test checks this against the library's exports.
SIGNATURES = {
    # the kernel layer's table (kernels.cpp)
    "sk_lookup": (c_int, [c_char_p, c_char_p, c_char_p]),
    "sk_table_size": (c_int, []),
    "sk_row_name": (None, [c_int, c_char_p]),
    "sk_isa_runs": (c_int, [c_char_p]),
    "sk_format": (c_int, [c_char_p, P(i64), P(i64)]),
    "sk_dequantize": (c_int, [c_char_p, ptr, i64, ptr, c_int]),
    "sk_linear": (c_int, [c_int, ptr, i64, i64, ptr, i64, ptr, ptr, c_int]),
    "sk_has_gemm": (c_int, [c_int]),
    "sk_gemm": (c_int, [c_int, ptr, i64, i64, ptr, i64, ptr, ptr, c_int]),
    # Q4_1 / Q8_0 (gguf_kernel.cpp)
    "gguf_linear": (c_int, _GGUF_LINEAR),
    "gguf_gemm": (c_int, _GGUF_LINEAR),
    "gguf_amx_bytes": (i64, [c_int, i64, i64]),
    "gguf_amx_pack": (c_int, _PACK),
    "gguf_lanes_bytes": (i64, [c_int, i64, i64]),
    "gguf_lanes_pack": (c_int, _PACK),
    "gguf_amx_init": (c_int, []),
    "gguf_use_avx512": (c_int, [c_int]),
    "gguf_amx_lane_rows": (c_int, [c_int]),
    "gguf_amx_lane_defaults": (c_int, [c_int, c_int]),
    "gguf_amx_lane_rows_now": (c_int, [c_int]),
    # attention (cpu_attention.cpp)
    "cpu_attention": (c_int, [ptr, ptr, ptr, ptr, c_int, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, i64,
                              c_float, c_int]),
    "cpu_attention_use_avx512": (c_int, [c_int]),
    # decoder layers (decode_layers.cpp)
    "attention_in": (c_int, [P(Shape), P(Layer), ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, c_int, c_int]),
    "attention_out_mlp": (c_int, [P(Shape), P(Layer), ptr, i64, ptr, ptr, c_int]),
    "decode_stack": (c_int, [P(Shape), P(Layer), i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, P(Paging), ptr,
                             c_int, c_int]),
    "final_norm": (None, [P(Shape), ptr, ptr, i64]),
    "silu_mul_rows": (None, [ptr, ptr, i64, i64, c_int]),
    "bf16_round_rows": (None, [ptr, ptr, i64]),
    # greedy readout (argmax.cpp)
    "argmax_rows": (None, [ptr, i64, i64, i64, ptr, c_int]),
    "greedy_accept": (None, [ptr, i64, i64, i64, i64, ptr, i64, ptr, ptr, ptr, c_int]),
}


@cache
def load() -> tuple[ctypes.CDLL | None, str]:
    """(the library, its C surface declared) or (None, why it cannot run here)."""
    lib, why = load_kernel(SOURCE, INCLUDES)
    if lib is not None:
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    return lib, why
