#!/usr/bin/env bash
# Build llama-cpp-python in a separate venv for side-by-side benchmarks (never a project dependency).
# Recipe from ../shared/CPU_NOTES.md: it is an sdist, built here with fixed x86 flags instead of -march=native
# (a native build turns on AMX, and this VM dies with SIGILL at `tileloadd`), AVX-512 only where /proc/cpuinfo
# lists it, and none of llama.cpp's programs. About 20 minutes on 2 cores; it runs under `nice -n 19` so that
# other work on the machine keeps its cores.
#     benchmarks/setup_llamacpp.sh [VENV]    (default: .venv-llamacpp, ignored by git)
# LLAMA_CPP_VERSION picks another release; NICE=0 builds at normal priority.
set -euo pipefail
cd "$(dirname "$0")/.."
V=${1:-.venv-llamacpp}
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
if git rev-parse --is-inside-work-tree >/dev/null 2>&1 && ! git check-ignore -q "$V/bin/python"; then
    echo "warning: $V is not ignored by git; add it to .gitignore" >&2
fi

has() { grep -m1 '^flags' /proc/cpuinfo | grep -qw "$1"; }
ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
has avx512f && ARGS+=" -DGGML_AVX512=ON"
has avx512_vnni && ARGS+=" -DGGML_AVX512_VNNI=ON"
has avx512_bf16 && ARGS+=" -DGGML_AVX512_BF16=ON"
ARGS+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF"
ARGS+=" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
echo "CMAKE_ARGS=$ARGS"

[ -x "$V/bin/python" ] || python3 -m venv "$V"
"$V/bin/pip" install -q --disable-pip-version-check --upgrade pip
start=$(date +%s)
CMAKE_ARGS="$ARGS" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    nice -n "${NICE:-19}" "$V/bin/pip" install --disable-pip-version-check --no-binary llama-cpp-python \
    "llama-cpp-python==$VERSION"
echo "built in $(( $(date +%s) - start )) s"
"$V/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'in', '$V')"
