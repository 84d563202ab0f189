#!/usr/bin/env bash
# One prepared GPU check for an H200 machine without internet: `scripts/gpu_check.sh OUTDIR`.
#
#   1. environment: nvidia-smi, torch/CUDA versions, which optional modules import       -> OUTDIR/env.txt
#   2. wheels in .whl/ (what the image lacks: msgspec, pyzmq, nvtx, gguf; FlashInfer) are installed with
#      `pip install --no-index --no-deps --target /tmp/site` and put on PYTHONPATH (scripts/device_env.sh);
#      without FlashInfer's, its checks are skipped with a message. Bring flashinfer-python together with its
#      kernel wheels (flashinfer-cubin / flashinfer-jit-cache) so nothing is JIT-compiled inside the time budget.
#   3. pytest -m gpu (graph replay vs eager per kind and bucket, padding, FlashInfer vs torch, speculative
#      greedy equality, bf16 MTP), verbose so a stage timeout still names the test it stopped in, and the
#      slowest tests listed to size the next run                                             -> OUTDIR/pytest.txt
#      FlashInfer runs only on head_dim 64 / 128 shapes, which its prebuilt kernels cover (tests/test_gpu_scripts.py
#      checks that on the CPU): nothing should compile.
#   4. scripts/gpu_bench.py: step times per kind/bucket, graphs on/off, verify/decode, bandwidth floor; the torch
#      figures are written before FlashInfer's, which a failure there does not lose
#                                                                -> OUTDIR/bench.json, OUTDIR/bench.txt
#   5. scripts/host_cpu_check.sh: this machine's CPU as another host kind (ISA flags, the CPU plan and
#      batch-invariance tests, bench_steps, at 2 threads)                                    -> OUTDIR/cpu.txt
# The project runs from the checkout, nothing installed (scripts/device_env.sh).
# Every stage has a timeout (30 + 180 + 130 + 90 + 150 s at worst; a few minutes normally), so the script ends
# within 9.5 minutes. The bench writes its JSON after each part of every shape, so a timeout keeps what was measured.
# Table last.
set -uo pipefail

OUT="${1:?usage: scripts/gpu_check.sh OUTDIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
source scripts/device_env.sh
start=$SECONDS

{
    nvidia-smi || echo "nvidia-smi failed"
    "$PY" - <<'EOF'
import importlib
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
for mod in ("numpy", "pytest", "transformers", "safetensors", "tokenizers", "msgspec", "zmq", "nvtx", "flashinfer",
            "triton"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod:<13}", getattr(m, "__version__", "ok"))
    except Exception as e:  # noqa: BLE001
        print(f"{mod:<13} MISSING ({type(e).__name__}: {e})")
EOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if "$PY" -c "import pytest" 2> /dev/null; then
    timeout 180 "$PY" -m pytest -m gpu -v -rs --durations=15 -p no:cacheprovider tests/test_gpu.py \
        --junitxml="$OUT/pytest.xml" 2>&1 | tee "$OUT/pytest.txt"
    tests_rc=${PIPESTATUS[0]}
else
    echo "pytest is not installed (bring its wheels in .whl/): GPU tests skipped" | tee "$OUT/pytest.txt"
    tests_rc=3
fi
echo "gpu tests: rc=$tests_rc ($((SECONDS - start)) s so far)"

timeout 130 "$PY" scripts/gpu_bench.py --out "$OUT/bench.json" --time-budget 90 > "$OUT/bench.txt" 2>&1
bench_rc=$?
echo "gpu bench: rc=$bench_rc ($((SECONDS - start)) s total)"

# 5. the host CPU (after the GPU figures are saved: a failure here loses none of them)
bash scripts/host_cpu_check.sh "$OUT"

echo "tests_rc=$tests_rc bench_rc=$bench_rc seconds=$((SECONDS - start))" > "$OUT/status.txt"
echo
cat "$OUT/bench.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
