#!/usr/bin/env bash
# Serving benchmarks with `specstep loadgen` against `specstep serve` on the default models (one run each; the
# ratios in the tables are measured side by side). Results: $OUT/*/results.{json,csv}, *.png, server logs.
#   benchmarks/bench_serve.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/bench}
SPEC=${SPEC:-mtp}
export OMP_WAIT_POLICY=PASSIVE
LG=(.venv/bin/python -m specstep.scheduler.cli loadgen --max-tokens 64 --prompt-tokens 64 --quiet)

# Throughput vs concurrency, speculation off / on (fixed k), held-out code.
"${LG[@]}" --workload code --concurrency 1,4,16,32 --output-dir "$OUT/concurrency" \
  --setting off --setting "spec=--spec $SPEC --spec-policy fixed --num-spec-tokens 4"

# Overlap on vs off at concurrency 16 (speculation off and on), and a trace of the overlapped server.
"${LG[@]}" --workload code --concurrency 16 --output-dir "$OUT/overlap" \
  --setting "overlap-on=--spec none --overlap on --trace $OUT/overlap/trace-on.json" \
  --setting "overlap-off=--spec none --overlap off" \
  --setting "spec-overlap-on=--spec $SPEC --spec-policy fixed --num-spec-tokens 4 --overlap on" \
  --setting "spec-overlap-off=--spec $SPEC --spec-policy fixed --num-spec-tokens 4 --overlap off"
.venv/bin/python -m specstep.scheduler.cli trace report "$OUT/overlap/trace-on.json" | tee "$OUT/overlap/trace-report.txt"

# Adaptive against every fixed k and speculation off, on predictable, unpredictable and mixed load.
for wl in code random mix; do
  "${LG[@]}" --workload "$wl" --concurrency 1,16 --output-dir "$OUT/adaptive-$wl" \
    --setting off \
    --setting "k1=--spec $SPEC --spec-policy fixed --num-spec-tokens 1" \
    --setting "k2=--spec $SPEC --spec-policy fixed --num-spec-tokens 2" \
    --setting "k4=--spec $SPEC --spec-policy fixed --num-spec-tokens 4" \
    --setting "adaptive=--spec $SPEC --spec-policy adaptive --num-spec-tokens 4"
done

# Long prompts beside streams: four steady streams while two 4,000-token prompts arrive, whole-prompt prefill against serve's
# default (chunked prefill, the budget calibrated at start-up and paced live: a mixed step <= 3 decode steps),
# one server per run, alternating, two runs each (the host's noise moves single runs a lot).
for rep in 1 2; do
  for s in "off=--no-chunked-prefill" "default=--spec-policy adaptive"; do
    "${LG[@]}" --workload long-prompt --concurrency 4 --long-prompts 2 --long-prompt-tokens 4000 --no-plots \
      --output-dir "$OUT/long-prompt/${s%%=*}-$rep" --server-args "--kv-cache-tokens 16384 --max-batch-size 16" \
      --setting "$s"
  done
done
