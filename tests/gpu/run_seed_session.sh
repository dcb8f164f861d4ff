#!/usr/bin/env bash
# Device calls for issue 4. The seed preset takes about ten minutes on the H100 (100 fp32 passes per pass type,
# flash's fp32 path uses exact IEEE products), more than one device call, so it runs in two halves by head dim:
#   bash tests/gpu/run_seed_session.sh 16,32 long      # first half, then the lengths past the card
#   bash tests/gpu/run_seed_session.sh 64,128          # second half
# Results land in $OUT/results.tgz.
D_HEADS=${1:-16,32,64,128}; EXTRA=${2:-}
source "$(dirname "$0")/session_preamble.sh"

# The default flash tiles: autotuning 20 fp32 shapes would cost more than the sweep itself.
stage "seed preset, d_head $D_HEADS"
FLASH_ATTN_AUTOTUNE=0 timeout ${SEED_TIMEOUT:-330} python3 bench_attention.py --preset seed --d-heads $D_HEADS \
  --backends naive,compiled,flash,sdpa --out $R/seed-d${D_HEADS/,/-} > $R/seed.log 2>&1; echo "seed rc=$?"
if [ "$EXTRA" = long ]; then
  # One timed call each: the point is which backend runs out of memory, and flash's fp32 takes seconds here.
  stage "seed shape past the card: where each backend runs out of memory"
  FLASH_ATTN_AUTOTUNE=0 timeout ${OOM_TIMEOUT:-220} python3 bench_attention.py --preset seed --seq-lens 32768,65536 \
    --d-heads 64 --iters 1 --warmup 0 --backends naive,compiled,sdpa,flash --no-plots --out $R/seed-long > $R/seed_long.log 2>&1
  echo "seed_long rc=$?"
fi
stage "pack"
tar czf "$OUT/results.tgz" -C /tmp res; ls -la "$OUT"
for f in $R/*.log; do echo "-- $f"; tail -c 400 $f; done
