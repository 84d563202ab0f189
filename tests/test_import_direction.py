"""Imports point one way: scheduler -> engine -> cuda_graphs. `cuda_graphs` imports nothing from the engine or the
scheduler, and the engine nothing from the scheduler, counting lazy imports inside functions and imports under
`TYPE_CHECKING` (a type is a dependency too). Read from the source (AST), so an import that runs only on some path
is found without running it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"cuda_graphs": ("specstep.engine", "specstep.scheduler"), "engine": ("specstep.scheduler",)}


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, relative ones resolved against `package` (its dotted name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from specstep import engine` names the package in the alias, not in the module
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


def violations_in(folder: Path, package: str, forbidden: tuple[str, ...]) -> list[str]:
    """`path:line imports module` for each forbidden import under `folder`, the package `package`."""
    out = []
    for path in sorted(folder.rglob("*.py")):
        sub = ".".join([package, *path.relative_to(folder).parent.parts])
        for line, module in imported_modules(path, sub):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                out.append(f"{path}:{line} imports {module}")
    return out


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_imports_point_one_way(folder):
    assert (ROOT / folder / "__init__.py").exists()
    assert violations_in(ROOT / folder, f"specstep.{folder}", FORBIDDEN[folder]) == []


def test_the_scan_sees_lazy_relative_and_package_imports(tmp_path):
    src = ("def f():\n    from specstep.engine.kv_cache import KVPool\n"
           "from specstep import scheduler\nfrom ..engine import step_engine\nimport specstep.engine.config as c\n")
    (tmp_path / "m.py").write_text(src)
    found = sorted(m for _, m in imported_modules(tmp_path / "m.py", "specstep.cuda_graphs"))
    assert found == ["specstep.engine.config", "specstep.engine.kv_cache.KVPool", "specstep.engine.step_engine",
                     "specstep.scheduler"]
    assert len(violations_in(tmp_path, "specstep.cuda_graphs", FORBIDDEN["cuda_graphs"])) == 4
