"""The C++ kernels' build cache (`engine.native.load_kernel`) is keyed by every source a kernel #includes, so an
edit to any of them rebuilds it: a file missing from a kernel's INCLUDES would keep serving the stale build."""

from __future__ import annotations

import platform
import re
from pathlib import Path

import pytest

from specstep.engine import argmax, native
from specstep.engine.attention import cpu_attention
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


@pytest.mark.parametrize("module", [argmax, cpu_attention, gguf_kernel, decode_layers],
                         ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_included_source_keys_the_build(module):
    registered = {p.resolve() for p in getattr(module, "INCLUDES", ())}
    assert included(module.SOURCE) == registered


HOST_BUILDS = (platform.machine() in ("x86_64", "AMD64")
               and all(f in native.cpu_flags() for f in native.NEEDED_CPU_FLAGS) and native._compiler() is not None)


@pytest.mark.skipif(not HOST_BUILDS, reason="this host builds no kernels (not x86 with AVX2/FMA/F16C and g++)")
@pytest.mark.parametrize("module", [argmax, cpu_attention, gguf_kernel, decode_layers],
                         ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_kernel_compiles_where_the_host_can_build(module):
    """A kernel that does not compile leaves its callers on their torch paths and its tests skipped (they skip
    where the kernel cannot run): on a host that builds kernels, a compile error must fail here instead."""
    _, why = native.load_kernel(module.SOURCE, tuple(getattr(module, "INCLUDES", ())))
    assert why == "", why
