"""The one native library (`library.cpp`: every C++ source in this folder, one translation unit): built once per
host by `engine.native` (one cache key: every source, the flags and the compiler) and loaded once per process.
Each Python module that calls into it declares the entry points it calls, once (`binding.py`, `gguf_kernel.py`,
`decode_layers.py`, `cpu_attention.py`, `argmax.py`)."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

from specstep.engine.native import load_kernel

HERE = Path(__file__).parent
SOURCE = HERE / "library.cpp"
# what SOURCE #includes, directly or not (keys the build)
INCLUDES = tuple(sorted(p for p in HERE.iterdir() if p.suffix in (".cpp", ".h", ".inc") and p != SOURCE))


@cache
def load() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why it cannot run here)."""
    return load_kernel(SOURCE, INCLUDES)
