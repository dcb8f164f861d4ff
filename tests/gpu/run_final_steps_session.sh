#!/usr/bin/env bash
# One device call: the flash GPU suite again (3xTF32 kept to d_head <= 128), then the large and 2.7B training
# steps with every compiled variant (ours with sdpa and with flash, the Hugging Face peer) in the same run.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; R=/tmp/res; mkdir -p $R
[ -d .wheels ] && python3 -m pip install -q --no-index --find-links .wheels einx wandb transformers
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
stage() { echo "== $(date +%T) $1"; }

stage "flash GPU test suite"
FLASH_ATTN_AUTOTUNE=0 timeout ${SUITE_TIMEOUT:-200} python3 tests/gpu/run_gpu_suite.py --out $R/gpu-tests.json \
  -- tests/attention -n 14 -q > $R/gpu_suite.log 2>&1; echo "rc=$?"
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
