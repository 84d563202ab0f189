#!/usr/bin/env bash
# Build llama.cpp's own programs for side-by-side benchmarks (never a project dependency): llama-bench,
# llama-completion, llama-lookup, llama-speculative, llama-batched-bench, llama-perplexity and llama-quantize.
# They are measured as a llama.cpp user runs them: the Python binding's per-token loop halves llama.cpp's decode
# speed, so the binding is not a fair peer.
#
# The source is the llama-cpp-python sdist's vendored tree (PyPI is the one registry reachable here), built with
# cmake + ninja and fixed x86 flags instead of GGML_NATIVE: a native build turns on AMX where the flags say so, and
# a KVM guest that lists AMX died with SIGILL at `tileloadd`. AVX-512, VNNI and BF16 where /proc/cpuinfo lists
# them. About 25 minutes on 2 cores, at `nice -n 19` so that other work keeps its cores.
#     benchmarks/setup_llamacpp.sh [DIR]    (default: .llamacpp, ignored by git; programs in DIR/bin)
# LLAMA_CPP_VERSION picks another llama-cpp-python release; NICE=0 builds at normal priority; JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
D=${1:-.llamacpp}
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
PROGRAMS=(llama-bench llama-completion llama-lookup llama-speculative llama-batched-bench llama-perplexity
          llama-quantize)
if git rev-parse --is-inside-work-tree >/dev/null 2>&1 && ! git check-ignore -q "$D/bin"; then
    echo "warning: $D is not ignored by git; add it to .gitignore" >&2
fi

has() { grep -m1 '^flags' /proc/cpuinfo | grep -qw "$1"; }
ARGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
has avx512f && ARGS+=(-DGGML_AVX512=ON)
has avx512_vnni && ARGS+=(-DGGML_AVX512_VNNI=ON)
has avx512_bf16 && ARGS+=(-DGGML_AVX512_BF16=ON)
ARGS+=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
       -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF)

mkdir -p "$D"
SRC="$D/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -d "$SRC" ]; then
    pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: -d "$D" \
        "llama-cpp-python==$VERSION"
    tar -xzf "$D/llama_cpp_python-$VERSION.tar.gz" -C "$D"
fi
start=$(date +%s)
echo "cmake ${ARGS[*]}"
nice -n "${NICE:-19}" cmake -S "$SRC" -B "$D/build" "${ARGS[@]}" >/dev/null
nice -n "${NICE:-19}" cmake --build "$D/build" -j "${JOBS:-2}" --target "${PROGRAMS[@]}"
mkdir -p "$D/bin"
for p in "${PROGRAMS[@]}"; do ln -sf "$(realpath "$D/build/bin/$p")" "$D/bin/$p"; done
echo "built in $(( $(date +%s) - start )) s: $(realpath "$D/bin")"
"$D/bin/llama-bench" --version 2>&1 | head -n 2 || true
