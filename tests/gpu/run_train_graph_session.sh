#!/usr/bin/env bash
# One device call: train.py as a user runs it, bf16, compiled, context 1024, 60 steps on the same synthetic tokens:
# plain steps against --cuda-graph, with sdpa and with flash. Loss, step time, MFU and memory of each run print last
# (train.py's own step timing). Usage: tests/gpu/run_train_graph_session.sh [small|large] (batch 16 or 4).
source "$(dirname "$0")/session_preamble.sh"
size=${1:-small}; batch=16; [ "$size" = large ] && batch=4
common="--size $size --dtype bf16 --compile --batch-size $batch --context-length 1024 --steps 60 --log-every 10
  --eval-every 60 --eval-batches 4 --no-checkpoint --data synthetic --vocab-size 10000 --wandb disabled"
for run in "sdpa" "sdpa --cuda-graph" "flash" "flash --cuda-graph"; do
  name=$(echo "$run" | tr ' ' '_' | tr -d '-')
  stage "train.py --attn $run"
  timeout 160 python3 train.py $common --attn $run --out $R/train-$size-$name > $R/train-$size-$name.log 2>&1; echo "rc=$?"
done
stage "pack"
tar czf "$OUT/results.tgz" -C /tmp res
for f in $R/train-*/metrics.jsonl; do echo "-- $f"; tail -1 $f; done
