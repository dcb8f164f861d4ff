#!/usr/bin/env bash
# One device call for attention.graph_replay (flash takes its Hopper kernels on short problems when the launches are
# replayed from a CUDA graph): the GPU tests, bench_attention --graph-timing at the issue's N4096 shape and the
# `large` model's attention shape, then graphed training steps with sdpa and flash (sizes given; default large small).
# Usage: [TESTS=0] [ATTENTION=0] [STEPS=0] tests/gpu/run_graph_replay_session.sh [large] [small]
source "$(dirname "$0")/session_preamble.sh"
sizes=("$@"); [ ${#sizes[@]} -eq 0 ] && sizes=(large small)
rm -rf $R/replay-*
if [ "${TESTS:-1}" = 1 ]; then
  stage "GPU tests: tests/attention"
  SUITE_TIMEOUT=300 gpu_suite; tail -3 $R/gpu_suite.log
  stage "GPU tests: timing, bench_attention, CUDA-graph steps"
  timeout 400 python3 -m pytest -q -p no:cacheprovider tests/benchmarking/test_timing.py tests/training/test_cuda_graph.py \
    tests/test_bench_attention.py tests/test_bench_model.py tests/test_train.py -k "graph or capture or timer" \
    > $R/replay-tests.log 2>&1; echo "rc=$?"
  tail -3 $R/replay-tests.log
fi
[ "${ATTENTION:-1}" = 1 ] && stage "bench_attention --graph-timing" && for shape in "--batch 1 --heads 16 --seq-lens 4096" "--batch 4 --heads 20 --seq-lens 1024"; do
  name=replay-attention-$(echo $shape | tr -d ' -' | sed 's/batch/b/;s/heads/h/;s/seqlens/n/')
  timeout 300 python3 bench_attention.py $shape --d-heads 64 --dtype bf16 --causal yes --no-plots --graph-timing \
    --backends flash,sdpa-cudnn,sdpa-flash,flex --baseline sdpa-cudnn --out $R/$name > $R/$name.log 2>&1
  echo "rc=$? $name"
  python3 - $R/$name/results.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    f = lambda x: "-" if x is None else f"{x:.4f}"
    print(f"{r['backend']:11s} B{r['batch']} H{r['heads']} N{r['seq']} fwd {f(r['fwd_ms'])} fwd+bwd {f(r['fwdbwd_ms'])}"
          f" | graphed fwd {f(r['fwd_graph_ms'])} fwd+bwd {f(r['fwdbwd_graph_ms'])} {r['check']} {r['note'] or ''}")
PY
done
[ "${STEPS:-1}" = 1 ] && for size in "${sizes[@]}"; do
  stage "$size: $(step_shape $size)"
  timeout ${STEP_TIMEOUT:-330} python3 bench_model.py --sizes $size $(step_shape $size) --dtype bf16 --mode train-step \
    --warmup 4 --steps 10 --no-progress --compile on --attn sdpa,flash --impl ours --cuda-graph on \
    --overlap-optimizer ${OVERLAP:-off} --out $R/replay-$size > $R/replay-$size.log 2>&1; echo "rc=$?"
done
stage "pack"
find $R -name "*.png" -delete
tar czf "$OUT/results.tgz" -C /tmp res
grep -hE "train-step.*:" $R/replay-*.log
