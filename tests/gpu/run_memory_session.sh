#!/usr/bin/env bash
# Where the peak memory of a training step goes, ours against the Hugging Face peer, same run:
#   bash tests/gpu/run_memory_session.sh [large] [2.7B] [small]
# GPU tests of the snapshot code, then for each size a bench_model train-step row per model with a one-step memory
# snapshot, whose peak report (what is live at the peak, by allocating line) goes to the log.
EXTRA_WHEELS=transformers source tests/gpu/session_preamble.sh
sizes=("${@:-large}")
declare -A SHAPE=([small]="16 1024" [large]="4 1024" [2.7B]="4 512")

stage "GPU tests: snapshots"
timeout 300 python3 -m pytest -q tests/profiling/test_memory_snapshot.py tests/test_bench_model.py -k "snapshot" 2>&1 | tail -3
for size in "${sizes[@]}"; do
  read -r b t <<< "${SHAPE[$size]}"
  stage "memory $size b$b T$t"
  timeout ${STEP_TIMEOUT:-420} python3 bench_model.py --sizes "$size" --context-lengths "$t" --batch-size "$b" \
    --dtype bf16 --mode train-step --compile on --attn ${ATTN:-sdpa} --impl ours,hf --warmup 3 --steps 5 \
    --memory-snapshot /tmp/snap-$size.pickle --snapshot-steps 1 --out $R/memory-$size 2>&1 \
    | grep -v "^\s*$" | tee $R/memory-$size.log | grep -v Warning | tail -60
done
cp -r $R/. "$OUT"/ 2>/dev/null; rm -f "$OUT"/*.pickle
