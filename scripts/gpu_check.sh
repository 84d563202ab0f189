#!/usr/bin/env bash
# One prepared GPU check for an H200 machine without internet: `scripts/gpu_check.sh OUTDIR`.
#
#   1. environment: nvidia-smi, torch/CUDA versions, which optional modules import       -> OUTDIR/env.txt
#   2. wheels in .whl/ (FlashInfer and anything else missing: pytest, transformers, ...) are installed with
#      `pip install --no-index --no-deps --target /tmp/site` and put on PYTHONPATH; without them FlashInfer
#      checks are skipped with a message. Bring flashinfer-python together with its kernel wheels
#      (flashinfer-cubin / flashinfer-jit-cache) so nothing is JIT-compiled inside the time budget.
#   3. pytest -m gpu (graph replay vs eager per kind and bucket, padding, FlashInfer vs torch, speculative
#      greedy equality, bf16 MTP), verbose so a stage timeout still names the test it stopped in, and the
#      slowest tests listed to size the next run                                             -> OUTDIR/pytest.txt
#      FlashInfer runs only on head_dim 64 / 128 shapes, which its prebuilt kernels cover (tests/test_gpu_scripts.py
#      checks that on the CPU): nothing should compile.
#   4. scripts/gpu_bench.py: step times per kind/bucket, graphs on/off, verify/decode, bandwidth floor; the torch
#      figures are written before FlashInfer's, which a failure there does not lose
#                                                                -> OUTDIR/bench.json, OUTDIR/bench.txt
#   5. this machine's CPU, 2 threads: another host kind than the 2-core development VMs (those are often AVX2-only;
#      this one may have AVX-512, AVX512_BF16, AMX). Its ISA flags, the CPU plan / batch-invariance / GGUF kernel
#      tests (the bitwise verify-vs-decode test on whatever plan this host chooses), and bench_steps on a
#      SmolLM2-135M-shaped random checkpoint (scripts/smollm2_shaped.py: the HF folder with --dtype auto's
#      choice, the Q4_1 GGUF with fp32 and int8 activations)                                 -> OUTDIR/cpu.txt
# The project runs from the checkout, nothing is installed into site-packages: its folders are linked under a
# temporary `specstep/` namespace (the import names an install maps them to) and the checkout is on PYTHONPATH
# for `tests.*`.
# Every stage has a timeout (30 + 180 + 130 + 90 + 120 s at worst; a few minutes normally), so the script ends
# within 9.5 minutes. The bench writes its JSON after each part of every shape, so a timeout keeps what was measured.
# Table last.
set -uo pipefail

OUT="${1:?usage: scripts/gpu_check.sh OUTDIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE
NS="$(mktemp -d)"
mkdir -p "$NS/specstep"
for d in engine scheduler cuda_graphs traces training loadgen; do ln -s "$PWD/$d" "$NS/specstep/$d"; done
export PYTHONPATH="$NS:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
start=$SECONDS

if compgen -G ".whl/*.whl" > /dev/null; then
    if timeout 30 "$PY" -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1; then
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
        echo "installed $(ls .whl/*.whl | wc -l) wheel(s) from .whl/ into /tmp/site"
    else
        echo "WARNING: installing .whl/ wheels failed (see $OUT/pip.log); continuing without them"
    fi
else
    echo "no .whl/ directory with wheels: FlashInfer checks and the fi_* benchmarks will be skipped"
fi

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
{
    grep -m1 "model name" /proc/cpuinfo
    echo "cores: $(nproc); ISA flags: $(grep -m1 -o -w 'avx2\|avx512[a-z_0-9]*\|amx[a-z_0-9]*\|avx_vnni' /proc/cpuinfo \
        | sort -u | tr '\n' ' ' || true)"
    export SPECSTEP_CACHE="$(mktemp -d)" OMP_NUM_THREADS=2
    if "$PY" -c "import pytest" 2> /dev/null; then
        timeout 90 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cpu_kernels.py tests/test_cpu_linear.py \
            tests/test_batch_invariance.py tests/test_decode_layers.py tests/test_gguf_linear.py 2>&1
        echo "cpu tests: rc=$? ($((SECONDS - start)) s so far)"
    fi
    model="$(mktemp -d)"
    timeout 120 bash -c "'$PY' scripts/smollm2_shaped.py '$model' > /dev/null 2>&1 &&
        '$PY' -m benchmarks.bench_steps --model '$model/hf' --batches 1 --reps 8 --modes auto/on &&
        '$PY' -m benchmarks.bench_steps --model '$model/model.gguf' --batches 1 --reps 8 \
            --modes auto/on,auto/on/auto/auto/int8" 2>&1 | grep -v '^Writing model shards'
    echo "cpu bench: rc=${PIPESTATUS[0]} ($((SECONDS - start)) s total)"
} > "$OUT/cpu.txt" 2>&1
tail -n 40 "$OUT/cpu.txt"

echo "tests_rc=$tests_rc bench_rc=$bench_rc seconds=$((SECONDS - start))" > "$OUT/status.txt"
echo
cat "$OUT/bench.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
