#!/usr/bin/env bash
# The GPU machine's CPU as another host kind: `scripts/host_cpu_check.sh OUTDIR` (stage 5 of scripts/gpu_check.sh,
# or alone).                                                                                    -> OUTDIR/cpu.txt
#
# The development VMs are often AVX2-only; the GPU machine's CPU may have AVX-512, AVX512_BF16 and AMX. At 2 threads
# (the VMs' count) and with CUDA hidden (so `--device auto` is the CPU): its ISA flags, the CPU plan /
# batch-invariance / GGUF kernel tests (the bitwise verify-vs-decode test on whatever plan this host chooses), and
# bench_steps on a SmolLM2-135M-shaped random checkpoint (scripts/smollm2_shaped.py: the HF folder with
# --dtype auto's choice, the Q4_1 GGUF with fp32 activations and int8 in AVX2 lanes and in AMX tiles where the CPU
# has them). Timeouts 90 + 150 s.
set -uo pipefail

OUT="${1:?usage: scripts/host_cpu_check.sh OUTDIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
if [ -z "${NS:-}" ]; then
    source scripts/device_env.sh
fi
start=$SECONDS
{
    grep -m1 "model name" /proc/cpuinfo
    echo "cores: $(nproc); ISA flags: $(grep -m1 -o -w 'avx2\|avx512[a-z_0-9]*\|amx[a-z_0-9]*\|avx_vnni' /proc/cpuinfo \
        | sort -u | tr '\n' ' ' || true)"
    export SPECSTEP_CACHE="$(mktemp -d)" OMP_NUM_THREADS=2 CUDA_VISIBLE_DEVICES=""
    if "$PY" -c "import pytest" 2> /dev/null; then
        timeout 90 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cpu_kernels.py tests/test_cpu_linear.py \
            tests/test_batch_invariance.py tests/test_decode_layers.py tests/test_gguf_linear.py 2>&1
        echo "cpu tests: rc=$? ($((SECONDS - start)) s so far)"
    fi
    model="$(mktemp -d)"
    timeout 150 bash -c "'$PY' scripts/smollm2_shaped.py '$model' > /dev/null 2>&1 &&
        '$PY' -m benchmarks.bench_steps --model '$model/hf' --batches 1 --reps 8 --modes auto/off,auto/on &&
        '$PY' -m benchmarks.bench_steps --model '$model/model.gguf' --batches 1 --reps 8 \
            --modes auto/on,auto/on/auto/auto/int8-lanes,auto/on/auto/auto/int8" 2>&1 | grep -v '^Writing model shards'
    echo "cpu bench: rc=${PIPESTATUS[0]} ($((SECONDS - start)) s)"
} > "$OUT/cpu.txt" 2>&1
tail -n 40 "$OUT/cpu.txt"
