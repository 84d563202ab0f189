"""Build and load the engine's native library (`engine/kernels/library.cpp`, every C++ kernel in one translation
unit): plain C++ with AVX2/FMA/F16C intrinsics and OpenMP, no torch headers, so it compiles in seconds with the
host's `g++` at the first load and is cached (`$SPECSTEP_CACHE/kernels`, keyed by the sources, the flags and the
compiler), like the measured linear plans. They are called through ctypes, which releases the
GIL for the call (a worker-thread stream keeps the host free while a kernel runs). Where one cannot run (not
x86, no AVX2/FMA/F16C in /proc/cpuinfo, no compiler, a failed build), `load_kernel` says why and the caller keeps
its torch path.
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

FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
NEEDED_CPU_FLAGS = ("avx2", "fma", "f16c")


@cache
def cpu_flags() -> set[str]:
    """The CPU's flags (/proc/cpuinfo), empty where it cannot be read."""
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _compile(cxx: str, source: Path, out: Path) -> str:
    """Compile `source` into `out` atomically (a concurrent start sees no library or the whole one); "" or why not."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *FLAGS, str(source), "-o", tmp], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return f"{source.name} did not compile ({cxx}): {done.stderr.strip()[-300:]}"
        os.replace(tmp, out)
        return ""
    except (OSError, subprocess.SubprocessError) as e:
        return f"{source.name} did not compile ({e})"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def load_kernel(source: Path, includes: tuple[Path, ...] = ()) -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library, "") or (None, why it cannot run here). Once per process and source. `includes`: the
    sources `source` #includes (they key the build cache with it)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"not x86 ({platform.machine()})"
    missing = [f for f in NEEDED_CPU_FLAGS if f not in cpu_flags()]
    if missing:
        return None, f"this CPU lacks {'/'.join(missing).upper()}"
    missing_source = next((p for p in (source, *includes) if not p.is_file()), None)
    if missing_source is not None:  # an install without the package data
        return None, f"{missing_source.name} is not installed"
    cxx = _compiler()
    if cxx is None:
        return None, "no C++ compiler (g++) found"
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cxx} does not run ({e})"
    texts = [p.read_text() for p in (source, *includes)]
    key = hashlib.sha256("\0".join([*texts, *FLAGS, version]).encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"{source.stem}-{key}.so"
    if not out.is_file():
        why = _compile(cxx, source, out)
        if why:
            return None, why
    torch.get_num_threads()  # torch (and its libgomp, which the library then shares: same soname) loads first
    try:
        return ctypes.CDLL(str(out)), ""
    except OSError as e:
        return None, f"{out.name} did not load ({e})"
