#!/usr/bin/env bash
# Issue 51's measurement: the full step sharded over two GPUs (FSDP2 by blocks, every pass fused), for the
# reference model and for a user's model (tests.user_models:build_gpt), each beside the stock step in the
# same call; or, on one GPU, one rank's shapes predicting it. Figures and logs go to $OUT (or ./out).
#   bash benchmarks/two_gpu.sh reference   # 2 GPUs: torchrun run_step.py --compare stock, the reference model
#   bash benchmarks/two_gpu.sh user        # 2 GPUs: the same for tests.user_models:build_gpt
#   bash benchmarks/two_gpu.sh harness     # 2 GPUs: the leaderboard harness (do_bench) under torchrun, both models
#   bash benchmarks/two_gpu.sh one-rank    # 1 GPU: the leaderboard harness at one rank's batch (1 of 2), both
#                                          # models; no communication and the whole optimizer step (not half)
# Each part is sized to fit one 10-minute device call (compiles from empty caches: ~2 min per model).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
user=tests.user_models:build_gpt
torchrun2() { python3 -m torch.distributed.run --standalone --nproc-per-node 2 "$@"; }
case "${1:-}" in
  reference)
    torchrun2 run_step.py --compile --preset full --steps 5 --warmup 1 --compare stock \
        --json "$out/two_gpu_reference.json" 2>&1 | tee "$out/two_gpu_reference.log" ;;
  user)
    torchrun2 run_step.py --compile --preset full --steps 5 --warmup 1 --compare stock --model "$user" \
        --json "$out/two_gpu_user.json" 2>&1 | tee "$out/two_gpu_user.log" ;;
  harness)
    for model in reference "$user"; do
      opt=(); [ "$model" = reference ] || opt=(--model "$model")
      torchrun2 benchmarks/leaderboard_harness.py "${opt[@]}" --rep 10000 --warmup 3000 \
          --json "$out/two_gpu_harness_${model//[:.]/_}.json" 2>&1 | tee "$out/two_gpu_harness_${model//[:.]/_}.log"
    done ;;
  one-rank)
    for model in reference "$user"; do
      opt=(); [ "$model" = reference ] || opt=(--model "$model")
      python3 benchmarks/leaderboard_harness.py --batch 1 "${opt[@]}" --rep 10000 --warmup 3000 \
          --json "$out/one_rank_${model//[:.]/_}.json" 2>&1 | tee "$out/one_rank_${model//[:.]/_}.log"
    done ;;
  *) echo "usage: bash benchmarks/two_gpu.sh reference|user|harness|one-rank" >&2; exit 2 ;;
esac
