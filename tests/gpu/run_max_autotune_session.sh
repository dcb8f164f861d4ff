#!/usr/bin/env bash
# One device call: the `large` training step (ours, sdpa, compiled, whole-step CUDA graph) with Inductor's default
# GEMMs (cuBLAS) and then with TORCHINDUCTOR_MAX_AUTOTUNE=1 (Triton GEMM templates tuned against cuBLAS, with
# epilogue fusion where a template wins), same inputs, one after the other. Optionally first the attention shape
# B2 H16 N8192 D128 causal with the peers (ATTN_D128=1). Results land in $OUT/results.tgz.
source "$(dirname "$0")/session_preamble.sh"
rm -rf $R/attn-d128-causal* $R/step-large-default* $R/step-large-max-autotune*  # /tmp/res can outlive a call
if [ "${ATTN_D128:-0}" = 1 ]; then
  stage "B2 H16 N8192 D128 causal"
  timeout 120 python3 bench_attention.py --batch 2 --heads 16 --seq-lens 8192 --d-heads 128 --causal yes \
    --backends flash,sdpa-flash,sdpa-cudnn,flex --baseline sdpa-cudnn --no-plots --out $R/attn-d128-causal \
    > $R/attn-d128-causal.log 2>&1; echo "rc=$?"
fi
common="--sizes large --batch-size 4 --context-lengths 1024 --dtype bf16 --mode train-step --warmup 4 --steps 10
  --no-progress --compile on --attn sdpa --impl ours --cuda-graph on"
stage "large, default GEMMs"
timeout 150 python3 bench_model.py $common --out $R/step-large-default > $R/step-large-default.log 2>&1; echo "rc=$?"
stage "large, TORCHINDUCTOR_MAX_AUTOTUNE=1"
TORCHINDUCTOR_MAX_AUTOTUNE=1 timeout ${MAX_AUTOTUNE_TIMEOUT:-300} python3 bench_model.py $common \
  --out $R/step-large-max-autotune > $R/step-large-max-autotune.log 2>&1; echo "rc=$?"
stage "pack"
tar czf "$OUT/results.tgz" -C $R $(cd $R && ls -d attn-d128-causal* step-large-* 2>/dev/null)
[ -d $R/attn-d128-causal ] && sed -n '/Forward + backward time/,/^## Per backend/p' $R/attn-d128-causal/results.md
grep -hE "train-step.*:" $R/step-large-*.log
