#!/usr/bin/env bash
# One device call after the custom-op and 3xTF32 changes: the flash GPU test suite, the small training step with
# each compile scope against the Hugging Face peer, B1 N4096 attention, and the fp32 seed points.
# Results land in $OUT/results.tgz; the tables print last.
EXTRA_WHEELS=transformers source "$(dirname "$0")/session_preamble.sh"

stage "flash GPU test suite"
gpu_suite
stage "small, batch 16, context 1024: compile scopes, flash compiled, the peer"
common="--sizes small --context-lengths 1024 --batch-size 16 --dtype bf16 --mode train-step --warmup 4 --steps 10 --no-progress --compile on"
timeout 100 python3 bench_model.py $common --attn sdpa,flash --impl ours,hf --out $R/step-small-blocks > $R/step-small-blocks.log 2>&1; echo "rc=$?"
timeout 70 python3 bench_model.py $common --attn sdpa --compile-scope model --out $R/step-small-model > $R/step-small-model.log 2>&1; echo "rc=$?"
stage "B1 H16 N4096 D64 causal"
timeout 70 python3 bench_attention.py --batch 1 --heads 16 --seq-lens 4096 --d-heads 64 --causal yes \
  --backends flash,sdpa-flash,sdpa-cudnn --baseline sdpa-cudnn --no-plots --out $R/attn-n4096 > $R/attn-n4096.log 2>&1; echo "rc=$?"
stage "fp32 seed points (flash now 3xTF32)"
FLASH_ATTN_AUTOTUNE=0 timeout 80 python3 bench_attention.py --preset seed --seq-lens 4096,16384 --d-heads 64,128 \
  --backends flash,sdpa --iters 20 --no-plots --out $R/seed-fp32 > $R/seed-fp32.log 2>&1; echo "rc=$?"
stage "pack"
find $R -name "*.png" -delete
tar czf "$OUT/results.tgz" -C /tmp res
grep -v "^\.\|^$" $R/gpu_suite.log | tail -25
grep -hE "compile=.*train-step:" $R/step-small-*.log
for d in attn-n4096 seed-fp32; do echo "-- $d"; sed -n '/Forward + backward time/,/^## Per backend/p' $R/$d/results.md; done
