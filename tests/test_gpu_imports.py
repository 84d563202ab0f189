"""The GPU check collects its tests on an image without the serving packages (msgspec, pyzmq, uvloop,
prometheus-client are not in the GPU machine's image): the engine, the step engine and the test helpers must
import without them. Collection runs in a subprocess whose import system refuses those packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVING_ONLY = ("msgspec", "zmq", "uvloop", "prometheus_client")

BLOCKED_COLLECT = f"""
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {SERVING_ONLY!r}:
            raise ImportError("not in the GPU image: " + name)
sys.meta_path.insert(0, Refuse())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py"]))
"""


def test_gpu_tests_collect_without_serving_packages():
    proc = subprocess.run([sys.executable, "-c", BLOCKED_COLLECT], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "test_gpu.py::" in proc.stdout
