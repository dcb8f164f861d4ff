#!/usr/bin/env bash
# One device call: the overlapped optimizer's GPU tests (TESTS=0 skips them), then the issue's training steps for the
# sizes given (default: large 2.7B), graphed and compiled: ours with sdpa and flash, AdamW after the backward and
# during it (training/overlapped_optimizer.py), and the Hugging Face peer, in the same run.
# Usage: [ATTN=sdpa,flash] [IMPL=ours,hf] tests/gpu/run_overlap_session.sh [small] [large] [2.7B]
EXTRA_WHEELS=transformers source "$(dirname "$0")/session_preamble.sh"
sizes=("$@"); [ ${#sizes[@]} -eq 0 ] && sizes=(large 2.7B)
rm -rf $R/overlap-*
if [ "${TESTS:-1}" = 1 ]; then
  stage "GPU tests"
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/training/test_overlapped_optimizer.py \
    tests/training/test_cuda_graph.py tests/test_bench_model.py tests/test_train.py -k "overlap or cuda_graph or graph" \
    > $R/overlap-tests.log 2>&1; echo "rc=$?"
  tail -3 $R/overlap-tests.log
fi
for size in "${sizes[@]}"; do
  stage "$size: $(step_shape $size)"
  timeout ${STEP_TIMEOUT:-330} python3 bench_model.py --sizes $size $(step_shape $size) --dtype bf16 --mode train-step \
    --warmup 4 --steps 10 --no-progress --compile on --attn ${ATTN:-sdpa,flash} --impl ${IMPL:-ours,hf} \
    --cuda-graph on --overlap-optimizer both --out $R/overlap-$size > $R/overlap-$size.log 2>&1; echo "rc=$?"
done
stage "pack"
find $R -name "*.png" -delete
tar czf "$OUT/results.tgz" -C /tmp res
grep -hE "train-step.*:" $R/overlap-*.log
