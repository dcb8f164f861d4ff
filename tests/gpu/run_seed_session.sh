#!/usr/bin/env bash
# One device call for issue 4: the seed preset to the end, the lengths where each backend runs out of memory
# on the card, and the leaderboard preset. Results land in $OUT/results.tgz; the tables print last.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; R=/tmp/res; mkdir -p $R
[ -d .wheels ] && python3 -m pip install -q --no-index --find-links .wheels einx wandb
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
stage() { echo "== $(date +%T) $1"; }

# fp32 seed sweep: the default flash tiles (autotuning 20 fp32 shapes would cost more than the sweep itself).
stage "seed preset"
FLASH_ATTN_AUTOTUNE=0 timeout ${SEED_TIMEOUT:-270} python3 bench_attention.py --preset seed \
  --backends naive,compiled,flash,sdpa --out $R/seed > $R/seed.log 2>&1; echo "seed rc=$?"
stage "seed shape past the card: where each backend runs out of memory"
FLASH_ATTN_AUTOTUNE=0 timeout ${OOM_TIMEOUT:-120} python3 bench_attention.py --preset seed --seq-lens 32768,65536 \
  --d-heads 64 --iters 5 --warmup 1 --backends naive,compiled,flash,sdpa --out $R/seed_long > $R/seed_long.log 2>&1
echo "seed_long rc=$?"
stage "leaderboard preset"
timeout ${LB_TIMEOUT:-150} python3 bench_attention.py --preset leaderboard --no-plots --out $R/leaderboard > $R/leaderboard.log 2>&1
echo "leaderboard rc=$?"
stage "pack"
tar czf "$OUT/results.tgz" -C /tmp res; ls -la "$OUT"
for d in seed seed_long leaderboard; do echo "-- $d"; tail -5 $R/$d.log; done
