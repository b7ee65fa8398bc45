#!/usr/bin/env bash
# Issue 53's measurement: the default plan (no memory options) of the full preset on one GPU.
#   H100 80 GB: the default step (it must run, offloading what the GPU cannot hold) and
#               --compare stock (refused by its estimate there: the log says so, no crash).
#   H200:       the default step, then --offload-activations 0.88 (the plan the default must match).
#   bash benchmarks/default_plan.sh [extra run_step.py options]
# Logs and JSON summaries go to $OUT (or ./out); each run starts from empty caches, so each
# "first step" is a cold start. LEADERBOARD=1 also times the leaderboard harness's default line.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
gpu=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)
echo "gpu: $gpu; commit $(git rev-parse --short HEAD 2>/dev/null)" | tee "$out/machine.log"
free -g | tee -a "$out/machine.log"
grep -E "MemTotal|MemAvailable" /proc/meminfo | tee -a "$out/machine.log"

run() {  # run NAME run_step-options...
    local name=$1; shift
    local start=$(date +%s)
    ( while sleep 5; do grep MemAvailable /proc/meminfo; done ) > "$out/$name.host_mem.log" &
    local watcher=$!
    python3 run_step.py --compile --preset full --fresh-cache --cache-dir "/tmp/cs_$name" --steps 3 --warmup 1 \
        --json "$out/$name.json" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    kill "$watcher" 2>/dev/null
    echo "$name: exit $rc, $(( $(date +%s) - start )) s; least MemAvailable: $(sort -k2 -n "$out/$name.host_mem.log" | head -1)" \
        | tee -a "$out/machine.log"
    grep -E "estimated plan|does not fit|^ *(step_ms|peak_mem_gib|compile_s|stock)|note: memory|\[stock\]|out of memory" \
        "$out/$name.log" | tee -a "$out/machine.log"
}

case "$gpu" in
    *H100*)
        run h100_default --compare stock "$@"
        if [ "${LEADERBOARD:-0}" = 1 ]; then
            python3 benchmarks/leaderboard_harness.py --rep 3000 --warmup 1000 --json "$out/h100_leaderboard.json" \
                > "$out/h100_leaderboard.log" 2>&1; echo "leaderboard: exit $?" | tee -a "$out/machine.log"
        fi ;;
    *H200*)
        run h200_default "$@"
        run h200_offload088 --offload-activations 0.88 "$@" ;;
    *)
        run default "$@" ;;
esac
