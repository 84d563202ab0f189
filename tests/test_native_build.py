"""The one native library (`engine/kernels/library.cpp`): its build cache (`engine.native.load_kernel`) is keyed by
every source it #includes, so an edit to any of them rebuilds it (a file missing from INCLUDES would keep serving the
stale build), and every module that calls C++ calls that one library, loaded once (one build a host, one copy of each
setting a caller pushes in)."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from specstep.engine import argmax, native
from specstep.engine.attention import cpu_attention
from specstep.engine.kernels import binding, library
from specstep.engine.models import decode_layers, gguf_kernel

LOCAL_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"', re.M)


def included(source: Path) -> set[Path]:
    """Every file `source` #includes with quotes, transitively (each name relative to the file that includes it)."""
    found: set[Path] = set()
    todo = [source]
    while todo:
        at = todo.pop()
        for name in LOCAL_INCLUDE.findall(at.read_text()):
            path = (at.parent / name).resolve()
            assert path.is_file(), f"{name} (included from {at.name}) is not a file"
            if path not in found:
                found.add(path)
                todo.append(path)
    return found


def test_every_included_source_keys_the_build():
    registered = {p.resolve() for p in library.INCLUDES}
    assert included(library.SOURCE) == registered
    # every C++ source of the engine is in the library's folder (one place, one build)
    sources = {p.resolve() for p in Path(native.__file__).parent.rglob("*.cpp")}
    assert sources == {p for p in registered | {library.SOURCE.resolve()} if p.suffix == ".cpp"}


HOST_BUILDS = (platform.machine() in ("x86_64", "AMD64")
               and all(f in native.cpu_flags() for f in native.NEEDED_CPU_FLAGS) and native._compiler() is not None)


@pytest.mark.skipif(not HOST_BUILDS, reason="this host builds no kernels (not x86 with AVX2/FMA/F16C and g++)")
def test_the_library_compiles_where_the_host_can_build():
    """A library that does not compile leaves its callers on their torch paths and their tests skipped (they skip
    where the kernels cannot run): on a host that builds kernels, a compile error must fail here instead."""
    lib, why = library.load()
    assert why == "", why
    # every caller holds that very library: one load, so a setting pushed in by one holds for all
    assert argmax._build() is lib
    for module in (binding, cpu_attention, gguf_kernel, decode_layers):
        assert module._build()[0] is lib, module.__name__
    # its C surface is declared once: every function it exports, and nothing else
    nm = shutil.which("nm")
    if nm is not None:
        out = subprocess.run([nm, "-D", "--defined-only", lib._name], capture_output=True, text=True).stdout
        exported = {line.split()[-1] for line in out.splitlines() if " T " in line and " _Z" not in line}
        assert exported == set(library.SIGNATURES)
