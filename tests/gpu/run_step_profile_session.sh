#!/usr/bin/env bash
# One device call: where the issue's training steps spend GPU time now (ours, sdpa, compiled, torch.profiler), kernel
# categories per step, and the graphed step with each compile scope. Usage: tests/gpu/run_step_profile_session.sh [large] [2.7B]
source "$(dirname "$0")/session_preamble.sh"
sizes=("$@"); [ ${#sizes[@]} -eq 0 ] && sizes=(large 2.7B)
rm -rf $R/prof-* $R/scope-*
common="--dtype bf16 --mode train-step --no-progress --compile on --attn sdpa"
for size in "${sizes[@]}"; do
  shape=$(step_shape $size)
  stage "profile $size: $shape"
  timeout ${PROFILE_TIMEOUT:-200} python3 bench_model.py --sizes $size $shape $common --warmup 3 --steps 2 \
    --profile $R/prof-$size --profile-steps 2 --out $R/prof-$size-bench > $R/prof-$size.log 2>&1; echo "rc=$?"
  trace=$(find $R/prof-$size -name trace.json | head -1)
  [ -n "$trace" ] && python3 tests/gpu/kernel_categories.py $trace 2 --top 45 > $R/kernels-$size.txt
  find $R/prof-$size -name trace.json -delete
done
for scope in ${SCOPES:-}; do
  stage "large graphed, compile scope $scope"
  timeout 240 python3 bench_model.py --sizes large $(step_shape large) $common --compile-scope $scope --cuda-graph on \
    --warmup 4 --steps 10 --out $R/scope-$scope > $R/scope-$scope.log 2>&1; echo "rc=$?"
done
stage "pack"
find $R -name "*.png" -delete
tar czf "$OUT/results.tgz" -C /tmp res
for size in "${sizes[@]}"; do echo "## $size"; head -8 $R/kernels-$size.txt; done
grep -hE "train-step.*:" $R/scope-*.log 2>/dev/null
