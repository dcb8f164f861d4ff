#!/usr/bin/env bash
# One device call: the CUDA-graph tests on the GPU, then the issue's training steps for the sizes given (default:
# small large) with and without the whole step replayed as a CUDA graph: ours with sdpa and with flash, and the
# Hugging Face peer, in the same run (TESTS=0 skips the tests). Usage: [ATTN=sdpa] tests/gpu/run_graph_session.sh [small] [large] [2.7B] [--profile]
EXTRA_WHEELS=transformers source "$(dirname "$0")/session_preamble.sh"
sizes=(); profile=0
for a in "$@"; do [ "$a" = --profile ] && profile=1 || sizes+=("$a"); done
[ ${#sizes[@]} -eq 0 ] && sizes=(small large)
rm -rf $R/step-* $R/prof* $R/graph_tests.log  # /tmp/res can outlive a call

if [ "${TESTS:-1}" = 1 ]; then  # TESTS=0 skips them
  stage "CUDA graph tests"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/training/test_cuda_graph.py > $R/graph_tests.log 2>&1; echo "rc=$?"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_train.py tests/test_bench_model.py -k cuda_graph >> $R/graph_tests.log 2>&1; echo "rc=$?"
fi
common="--dtype bf16 --mode train-step --warmup 4 --steps 10 --no-progress --compile on --attn ${ATTN:-sdpa,flash} --impl ours,hf --cuda-graph both"
for size in "${sizes[@]}"; do
  shape=$(step_shape $size)
  stage "$size: $shape"
  timeout ${STEP_TIMEOUT:-280} python3 bench_model.py --sizes $size $shape $common --out $R/step-$size > $R/step-$size.log 2>&1; echo "rc=$?"
done
if [ $profile = 1 ]; then
  stage "profile large, ours (sdpa)"
  timeout 150 python3 bench_model.py --sizes large --context-lengths 1024 --batch-size 4 --dtype bf16 --mode train-step \
    --warmup 3 --steps 3 --no-progress --compile on --attn sdpa --profile $R/prof --profile-steps 2 \
    --out $R/prof-large > $R/prof-large.log 2>&1; echo "rc=$?"
  find $R/prof -name "trace.json" -size +5M -delete
fi
stage "pack"
find $R -name "*.png" -delete
tar czf "$OUT/results.tgz" -C /tmp res
[ -f $R/graph_tests.log ] && tail -2 $R/graph_tests.log
grep -hE "train-step.*:" $R/step-*.log
if [ $profile = 1 ]; then grep -E "^\|" $R/prof-large.log | head -18; fi
