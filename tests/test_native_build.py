"""The C++ kernels' build cache (`engine.native.load_kernel`) is keyed by every source a kernel #includes, so an
edit to any of them rebuilds it: a file missing from a kernel's INCLUDES would keep serving the stale build."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specstep.engine import argmax
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
