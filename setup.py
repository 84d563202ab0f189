"""The packages: every folder with an `__init__.py` under the project's top-level folders, installed as one import
namespace (`specstep.engine`, `specstep.engine.parallel`, ...; generic names such as `scheduler` collide with
other distributions, and `specstep` itself is a namespace package).

This is the one thing pyproject.toml cannot say: setuptools' `find` discovers `engine.parallel`, never
`specstep.engine.parallel` (it has no prefix), and a hand-kept list misses new packages, so a wheel could
not import them. Everything else is in pyproject.toml.
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
FOLDERS = ("engine", "scheduler", "cuda_graphs", "traces", "training", "loadgen")

setup(
    package_dir={f"specstep.{top}": top for top in FOLDERS},
    packages=[f"specstep.{top}{sub}" for top in FOLDERS
              for sub in ["", *(f".{p}" for p in find_packages(where=str(ROOT / top)))]],
)
