#!/usr/bin/env bash
# One device call: the model tests and the CUDA-graph tests on the GPU (fp32 weight gradients through
# torch.mm(out_dtype=) on CUDA, under compile and whole-step graphs), then the training step with Linear weight
# gradients in fp32 (the default) against plain autocast (--weight-grads autocast), ours, sdpa, compiled, graphed,
# one after the other per size (TESTS=0 skips the tests; TRAIN_STEPS=N adds train.py runs on the default
# corpus, both ways). Usage: tests/gpu/run_weight_grad_session.sh [small] [large] [2.7B]
source "$(dirname "$0")/session_preamble.sh"
sizes=("$@"); [ ${#sizes[@]} -eq 0 ] && sizes=(small large 2.7B)
rm -rf $R/wg-*  # /tmp/res can outlive a call
if [ "${TESTS:-1}" = 1 ]; then  # TESTS=0 skips them
  stage "model and CUDA-graph tests"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/model tests/training/test_cuda_graph.py > $R/wg-tests.log 2>&1; echo "rc=$?"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_train.py tests/test_bench_model.py -k "cuda_graph or weight_grad" >> $R/wg-tests.log 2>&1; echo "rc=$?"
fi
common="--dtype bf16 --mode train-step --warmup 4 --steps 10 --no-progress --compile on --attn sdpa --impl ours --cuda-graph on"
for size in "${sizes[@]}"; do
  shape=$(step_shape $size)
  for wg in fp32 autocast; do
    stage "$size, weight grads $wg"
    timeout 150 python3 bench_model.py --sizes $size $shape $common --weight-grads $wg --out $R/wg-$size-$wg \
      > $R/wg-$size-$wg.log 2>&1; echo "rc=$?"
  done
done
if [ "${TRAIN_STEPS:-0}" -gt 0 ]; then  # train.py on the default corpus, both ways, same seed: the losses
  for wg in fp32 autocast; do
    stage "train.py small, $TRAIN_STEPS steps, weight grads $wg"
    timeout 200 python3 train.py --size small --dtype bf16 --compile --cuda-graph --batch-size 16 --context-length 1024 \
      --steps $TRAIN_STEPS --log-every 50 --eval-every $TRAIN_STEPS --no-checkpoint --wandb disabled \
      --weight-grads $wg --out $R/wg-train-small-$wg > $R/wg-train-small-$wg.log 2>&1; echo "rc=$?"
  done
fi
stage "pack"
tar czf "$OUT/weight-grads.tgz" -C $R $(cd $R && ls -d wg-*)
[ -f $R/wg-tests.log ] && grep -E "passed|failed" $R/wg-tests.log
grep -hE "train-step.*:" $R/wg-*.log
for f in $R/wg-train-*/metrics.jsonl; do [ -f $f ] && echo "-- $f" && cat $f; done
