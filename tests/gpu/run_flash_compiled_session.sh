#!/usr/bin/env bash
# One device call: flash under torch.compile as triton_ops (Inductor launches the kernels). The compile tests, then
# train.py as a user runs it (compiled, bf16, 60 steps, synthetic tokens) with sdpa and with flash, then bench_model's
# train step for ours with both. Usage: tests/gpu/run_flash_compiled_session.sh [small|large] [--suite] [--bench]
source "$(dirname "$0")/session_preamble.sh"
size=small; suite=0; bench=0
for a in "$@"; do case $a in --suite) suite=1 ;; --bench) bench=1 ;; *) size=$a ;; esac; done
batch=16; [ "$size" = large ] && batch=4
if [ $suite = 1 ]; then stage "flash GPU suite"; gpu_suite; tail -3 $R/gpu_suite.log; fi
stage tests
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/attention/test_flash_triton_compile.py > $R/compile_tests.log 2>&1; echo rc=$?; tail -1 $R/compile_tests.log
for a in sdpa flash; do
  stage "train.py $size $a"
  timeout 170 python3 train.py --size $size --dtype bf16 --compile --batch-size $batch --context-length 1024 --steps 60 \
    --log-every 10 --eval-every 60 --eval-batches 4 --no-checkpoint --data synthetic --vocab-size 10000 --wandb disabled \
    --attn $a --out $R/train-$size-$a > $R/train-$size-$a.log 2>&1; echo rc=$?
done
if [ $bench = 1 ]; then
  stage "bench_model $size"
  timeout 240 python3 bench_model.py --sizes $size --batch-size $batch --context-lengths 1024 --dtype bf16 --mode train-step \
    --warmup 4 --steps 20 --no-progress --compile on --attn sdpa,flash --impl ours --cuda-graph off --out $R/step-$size \
    > $R/step-$size.log 2>&1; echo rc=$?
fi
stage pack
find $R -name "*.png" -delete
tar czf "$OUT/results.tgz" -C /tmp res
for f in $R/train-*/metrics.jsonl; do echo "-- $f"; tail -1 $f | cut -c1-160; done
grep -hE "train-step.*:" $R/step-*.log 2>/dev/null
