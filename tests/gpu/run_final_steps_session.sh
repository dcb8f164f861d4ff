#!/usr/bin/env bash
# One device call: the flash GPU suite again (3xTF32 kept to d_head <= 128), then the large and 2.7B training
# steps with every compiled variant (ours with sdpa and with flash, the Hugging Face peer) in the same run.
EXTRA_WHEELS=transformers source "$(dirname "$0")/session_preamble.sh"

stage "flash GPU test suite"
gpu_suite
common="--dtype bf16 --mode train-step --warmup 4 --steps 10 --no-progress --compile on --attn sdpa,flash --impl ours,hf"
stage "large, batch 4, context 1024"
timeout 180 python3 bench_model.py --sizes large --context-lengths 1024 --batch-size 4 $common --out $R/step-large > $R/step-large.log 2>&1; echo "rc=$?"
stage "2.7B, batch 4, context 512"
timeout 170 python3 bench_model.py --sizes 2.7B --context-lengths 512 --batch-size 4 $common --out $R/step-2.7B > $R/step-2.7B.log 2>&1; echo "rc=$?"
stage "pack"
find $R -name "*.png" -delete
tar czf "$OUT/results.tgz" -C /tmp res
grep -v "^\.\|^$" $R/gpu_suite.log | tail -12
grep -hE "compile=.*train-step:" $R/step-*.log
