#!/usr/bin/env bash
# Issue 6's measurement on one H200: the full preset from empty caches
# (compile + 3 warm-up + 10 timed steps, next to the stock step in the same process), then
# again with warm caches. Figures and logs go to $OUT (or ./out).
#   bash benchmarks/full_step.sh [extra run_step.py options, e.g. --memory-budget 0.1]
# Measured on the H200: the cold part takes ~455 s (ours ~115 s compile + 14 steps, stock ~3 min);
# with the warm part it exceeds one 10-minute device call: pass e.g. `--steps 5 --warmup 1` there.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
cache=/tmp/compile_stack_full
start=$(date +%s)
python3 run_step.py --compile --preset full --fresh-cache --cache-dir "$cache" --compare stock \
    --json "$out/full_cold.json" "$@" 2>&1 | tee "$out/full_cold.log"
echo "cold run, all phases: $(( $(date +%s) - start )) s" | tee -a "$out/full_cold.log"
python3 run_step.py --compile --preset full --cache-dir "$cache" --steps 3 --warmup 1 \
    --json "$out/full_warm.json" "$@" 2>&1 | tee "$out/full_warm.log"
