"""Build, load and call `gguf_kernel.cpp`: GGUF's quantised blocks (Q4_1, Q8_0) times fp32 activations.

The kernel is plain C++ with AVX2/FMA/F16C intrinsics and OpenMP, no torch headers, so it compiles in seconds
with the host's `g++` at the first load and is cached (`$SPECSTEP_CACHE/kernels`, keyed by the source, the
flags and the compiler), like the measured linear plans. It is called through ctypes, which releases the GIL for
the call (a worker-thread stream keeps the host free while the weights are read). Where it cannot run (not x86,
no AVX2/FMA/F16C in /proc/cpuinfo, no compiler, a failed build), `unavailable()` says why and the loader keeps
the dequantised fp32 weights.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from specstep.engine.model_source import cache_root

SOURCE = Path(__file__).with_name("gguf_kernel.cpp")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
NEEDED_CPU_FLAGS = ("avx2", "fma", "f16c")
FORMATS = {"Q4_1": 0, "Q8_0": 1}  # the GGML type names the kernel reads -> its `fmt` argument
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # bytes per 32 weights
BLOCK = 32


class KernelError(RuntimeError):
    """The kernel rejected its arguments (a shape it cannot take), or failed to allocate."""


def _cpu_flags() -> set[str]:
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


@cache
def _build() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library, "") or (None, why not)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"not x86 ({platform.machine()})"
    missing = [f for f in NEEDED_CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        return None, f"this CPU lacks {'/'.join(missing).upper()}"
    cxx = _compiler()
    if cxx is None:
        return None, "no C++ compiler (g++) found"
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cxx} does not run ({e})"
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version]).encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"gguf_kernel-{key}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".gguf_kernel-", suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            done = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode != 0:
                return None, f"the kernel did not compile ({cxx}): {done.stderr.strip()[-300:]}"
            os.replace(tmp, out)  # atomic: a concurrent start sees the old state or the whole library
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"the kernel did not compile ({e})"
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    torch.get_num_threads()  # torch (and its libgomp, which the library then shares) is loaded first
    try:
        lib = ctypes.CDLL(str(out))
    except OSError as e:
        return None, f"the kernel did not load ({e})"
    lib.gguf_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.gguf_linear.restype = ctypes.c_int
    return lib, ""


def unavailable() -> str:
    """Why the kernel cannot run here ("" if it can); builds it on first call."""
    return _build()[1]


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, out_features: int, fmt: str,
                bias: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """x [..., K] float32 on CPU @ W.T (+ bias): W [out_features, K] as `blocks` [out_features, K / 32 blocks]
    uint8 of GGML type `fmt`. Threads: torch's count unless given."""
    lib, why = _build()
    if lib is None:
        raise KernelError(f"the GGUF kernel cannot run here: {why}")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    y = x2.new_empty(x2.shape[0], out_features)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    rc = lib.gguf_linear(x2.data_ptr(), x2.shape[0], k, blocks.data_ptr(), out_features, FORMATS[fmt],
                         None if bias is None else bias.data_ptr(), y.data_ptr(),
                         threads or torch.get_num_threads())
    if rc != 0:
        raise KernelError(f"gguf_linear({fmt}, K={k}, N={out_features}) returned {rc}")
    return y.view(*x.shape[:-1], out_features)
