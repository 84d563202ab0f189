"""The GPU check (scripts/gpu_check.sh, scripts/gpu_bench.py) on the CPU: the scripts parse, the bench runs end to
end on a tiny shape, with the FlashInfer route over tests/fake_flashinfer.py (a failure there loses none of the
torch figures), and what the check runs FlashInfer on needs no kernel compiled at first use."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from scripts import gpu_bench
from scripts.gpu_bench import main
from specstep.engine.config import ModelConfig
from tests import fake_flashinfer
from tests.fixtures_models import FLASHINFER_HEAD_DIMS, make_flashinfer_checkpoint

TORCH_KINDS = {(k, b, g) for k in ("decode", "verify", "draft", "refill") for b in (1, 2) for g in ("on", "off")}


def run_tiny_bench(tmp_path: Path, rc: int = 0) -> dict:
    out = tmp_path / "bench.json"
    assert main(["--device", "cpu", "--shapes", "tiny", "--dtype", "float32", "--buckets", "1,2", "--iters", "1",
                 "--ctx", "8", "--out", str(out)]) == rc
    return json.loads(out.read_text())


def test_gpu_check_scripts_parse_and_bench_runs_on_cpu(tmp_path):
    root = Path(__file__).resolve().parents[1]
    assert subprocess.run(["bash", "-n", str(root / "scripts/gpu_check.sh")]).returncode == 0
    help_out = subprocess.run([sys.executable, str(root / "scripts/gpu_bench.py"), "--help"], capture_output=True,
                              text=True)
    assert help_out.returncode == 0 and "--time-budget" in help_out.stdout
    data = run_tiny_bench(tmp_path)
    kinds = {(r["kind"], r["batch"], r["graphs"]) for r in data["results"]["tiny"]["steps"]}
    assert kinds == TORCH_KINDS
    assert data["results"]["tiny"]["capture"]["graphs"] == 8 and data["summary"]["tiny"]["floor_ms"] > 0


def test_gpu_bench_flashinfer_route_smoke(tmp_path, monkeypatch):
    """The bench's fi_* kinds (FlashInfer installed on the target during the step, planned per batch) run
    end to end over the CPU fake of flashinfer; the real numbers come from scripts/gpu_check.sh."""
    fake_flashinfer.install(monkeypatch)
    tiny = run_tiny_bench(tmp_path)["results"]["tiny"]
    kinds = {(r["kind"], r["batch"], r["graphs"]) for r in tiny["steps"]}
    assert {(k, b, g) for k in ("fi_decode", "fi_verify") for b in (1, 2) for g in ("on", "off")} <= kinds
    assert tiny["flashinfer"] == "on" and tiny["flashinfer_calls"] > 0
    # the torch kinds and FlashInfer's were captured by runners of their own
    assert tiny["capture"]["graphs"] == 8 and tiny["flashinfer_capture"]["graphs"] == 4


def test_gpu_bench_keeps_the_torch_figures_when_flashinfer_fails(tmp_path, monkeypatch):
    """FlashInfer runs after the torch figures are on disk (a timeout or a crash there keeps them), and a failure
    of its kernels is recorded in the output, the bench's exit code 1, and nothing else lost."""
    fake_flashinfer.install(monkeypatch)
    on_disk = []

    def failing_run(self, q, paged_kv_cache):
        on_disk.append(json.loads((tmp_path / "bench.json").read_text()))
        raise RuntimeError("no prebuilt kernel")
    monkeypatch.setattr(fake_flashinfer._FakeWrapper, "run", failing_run)
    data = run_tiny_bench(tmp_path, rc=1)
    tiny = data["results"]["tiny"]
    saved = {(r["kind"], r["batch"], r["graphs"]) for r in on_disk[0]["results"]["tiny"]["steps"]}
    assert saved == TORCH_KINDS, "the torch figures were not written before FlashInfer ran"
    assert {(r["kind"], r["batch"], r["graphs"]) for r in tiny["steps"]} == TORCH_KINDS
    assert tiny["flashinfer"] == "failed: RuntimeError: no prebuilt kernel"
    assert data["errors"] == {"tiny flashinfer": tiny["flashinfer"]} and data["summary"]["tiny"]["decode_ms"] > 0


def test_gpu_flashinfer_runs_need_no_kernel_compiled(tmp_path):
    """FlashInfer compiles kernels for any head_dim but its prebuilt ones on first use (minutes: past the check's
    test stage). The shapes the GPU check gives it: the bench's default shapes, tests/test_gpu.py's problems and
    the checkpoints its engine test builds (target, draft model, and an MTP head of the target's shape)."""
    import inspect

    from tests import test_gpu

    for shape in gpu_bench.parse_args([]).shapes.split(","):  # scripts/gpu_check.sh passes no --shapes
        assert gpu_bench.SHAPES[shape]["head_dim"] in FLASHINFER_HEAD_DIMS, shape
    assert test_gpu.FI_CFG.head_dim in FLASHINFER_HEAD_DIMS
    assert ModelConfig.from_folder(make_flashinfer_checkpoint(tmp_path / "t")).head_dim in FLASHINFER_HEAD_DIMS
    engine_test = inspect.getsource(test_gpu.test_flashinfer_engine_follows_torch_engine)
    assert "make_checkpoint(" not in engine_test, "the FlashInfer engine test builds a head_dim 16 checkpoint"
