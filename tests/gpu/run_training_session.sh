#!/usr/bin/env bash
# One device call for issue 6: the three training-step configs, ours against the Hugging Face Llama peer
# (bench_model.py --impl ours,hf) in the same run. Needs transformers in .wheels
# (../shared/gpu/fetch-wheels.sh .wheels transformers). Results land in $OUT/results.tgz; tables print last.
EXTRA_WHEELS=transformers source "$(dirname "$0")/session_preamble.sh"
common="--dtype bf16 --mode train-step --warmup ${WARMUP:-4} --steps ${STEPS:-10} --no-progress --impl ours,hf"

stage "small, batch 16, context 1024"
timeout ${SMALL_TIMEOUT:-160} python3 bench_model.py --sizes small --context-lengths 1024 --batch-size 16 \
  --attn sdpa,flash --compile both $common --out $R/step-small > $R/step-small.log 2>&1; echo "rc=$?"
stage "large, batch 4, context 1024"
timeout ${LARGE_TIMEOUT:-200} python3 bench_model.py --sizes large --context-lengths 1024 --batch-size 4 \
  --attn sdpa,flash --compile on $common --out $R/step-large > $R/step-large.log 2>&1; echo "rc=$?"
stage "2.7B, batch 4, context 512"
timeout ${XL_TIMEOUT:-190} python3 bench_model.py --sizes 2.7B --context-lengths 512 --batch-size 4 \
  --attn sdpa,flash --compile both $common --out $R/step-2.7B > $R/step-2.7B.log 2>&1; echo "rc=$?"
stage "pack"
find $R -name "*.png" -delete
tar czf "$OUT/results.tgz" -C /tmp res
for d in small large 2.7B; do echo "-- $d"; grep -E "compile=.*train-step:" $R/step-$d.log | sed 's/train-step: //'; tail -2 $R/step-$d.log; done
