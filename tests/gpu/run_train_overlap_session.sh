#!/usr/bin/env bash
# One device call: train.py on `large` (batch 4, context 1024, compiled, graphed, no clipping) with AdamW after the
# backward and during it (--overlap-optimizer): the same losses, the step times side by side.
source "$(dirname "$0")/session_preamble.sh"
rm -rf $R/train-*
common="--size large --attn sdpa --dtype bf16 --compile --cuda-graph --batch-size 4 --context-length 1024 --steps ${STEPS:-60}
  --grad-clip 0 --log-every 20 --eval-every 0 --no-checkpoint --wandb disabled"
for variant in plain overlap; do
  stage "train.py large, $variant"
  extra=$([ $variant = overlap ] && echo --overlap-optimizer)
  timeout 280 python3 train.py $common $extra --out $R/train-$variant > $R/train-$variant.log 2>&1; echo "rc=$?"
  grep -E "^step" $R/train-$variant.log | tail -3
done
stage "pack"
tar czf "$OUT/results.tgz" -C /tmp res
