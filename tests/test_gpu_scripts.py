"""The GPU check (scripts/gpu_check.sh, scripts/gpu_bench.py) on the CPU: the scripts parse, and the bench runs
end to end on a tiny shape, with the FlashInfer route over tests/fake_flashinfer.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from scripts.gpu_bench import main
from tests import fake_flashinfer


def run_tiny_bench(tmp_path: Path) -> dict:
    out = tmp_path / "bench.json"
    assert main(["--device", "cpu", "--shapes", "tiny", "--dtype", "float32", "--buckets", "1,2", "--iters", "1",
                 "--ctx", "8", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_gpu_check_scripts_parse_and_bench_runs_on_cpu(tmp_path):
    root = Path(__file__).resolve().parents[1]
    assert subprocess.run(["bash", "-n", str(root / "scripts/gpu_check.sh")]).returncode == 0
    help_out = subprocess.run([sys.executable, str(root / "scripts/gpu_bench.py"), "--help"], capture_output=True,
                              text=True)
    assert help_out.returncode == 0 and "--time-budget" in help_out.stdout
    data = run_tiny_bench(tmp_path)
    kinds = {(r["kind"], r["batch"], r["graphs"]) for r in data["results"]["tiny"]["steps"]}
    assert kinds == {(k, b, g) for k in ("decode", "verify", "draft", "refill") for b in (1, 2) for g in ("on", "off")}
    assert data["results"]["tiny"]["capture"]["graphs"] == 8 and data["summary"]["tiny"]["floor_ms"] > 0


def test_gpu_bench_flashinfer_route_smoke(tmp_path, monkeypatch):
    """The bench's fi_* kinds (FlashInfer installed on the target during the step, planned per batch) run
    end to end over the CPU fake of flashinfer; the real numbers come from scripts/gpu_check.sh."""
    fake_flashinfer.install(monkeypatch)
    tiny = run_tiny_bench(tmp_path)["results"]["tiny"]
    kinds = {(r["kind"], r["batch"], r["graphs"]) for r in tiny["steps"]}
    assert {(k, b, g) for k in ("fi_decode", "fi_verify") for b in (1, 2) for g in ("on", "off")} <= kinds
    assert tiny["flashinfer"] == "on" and tiny["flashinfer_calls"] > 0
