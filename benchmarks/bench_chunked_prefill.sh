#!/usr/bin/env bash
# Chunked prefill (serve's default: mixed steps paced to an ITL target, speculation on in them) against whole-prompt
# prefill (--no-chunked-prefill), with `specstep loadgen` on the default model: code workload, 128-token prompts,
# 64 new tokens, closed loop, 32 requests per point, concurrency 1, 4, 16, 64. The two settings alternate point by
# point, each with its own started server, the order flipped every point. Then the long-prompt workload's stall:
# 4 steady streams while one 3,000-token prompt arrives, both settings. A summary table: $OUT/summary.md.
#   benchmarks/bench_chunked_prefill.sh [OUT]        (default: benchmarks/results/chunked-prefill)
#   CONC="1 16" benchmarks/bench_chunked_prefill.sh  (fewer points)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/chunked-prefill}
CONC=${CONC:-1 4 16 64}
export OMP_WAIT_POLICY=PASSIVE
LG=(.venv/bin/python -m specstep.scheduler.cli loadgen --quiet --no-plots)
CHUNKED="default="
WHOLE="whole=--no-chunked-prefill"
flip=0
for c in $CONC; do
  if ((flip)); then first=$WHOLE second=$CHUNKED; else first=$CHUNKED second=$WHOLE; fi
  "${LG[@]}" --workload code --prompt-tokens 128 --max-tokens 64 --mode closed --concurrency "$c" \
    --num-requests 32 --output-dir "$OUT/code-c$c" --setting "$first" --setting "$second"
  flip=$((1 - flip))
done
"${LG[@]}" --workload long-prompt --concurrency 4 --long-prompts 1 --long-prompt-tokens 3000 \
  --output-dir "$OUT/long-prompt" --setting "$CHUNKED" --setting "$WHOLE"
.venv/bin/python benchmarks/chunked_prefill_summary.py "$OUT" | tee "$OUT/summary.md"
