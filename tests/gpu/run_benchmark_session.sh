#!/usr/bin/env bash
# One device call: attention shapes beyond the leaderboard, flash vs sdpa training curves, the bench_model
# sweep, a profile, a memory snapshot and the training-step configs. Results land in $OUT/results.tgz.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; R=/tmp/res; mkdir -p $R
[ -d .wheels ] && python3 -m pip install -q --no-index --find-links .wheels einx wandb
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
stage() { echo "== $(date +%T) $1"; }

stage "attention shapes (issue 3/6)"
timeout 170 python3 bench_attention.py --batch 2 --heads 16 --seq-lens 8192 --d-heads 64,128 --causal both \
  --backends flash,sdpa-flash,sdpa-cudnn --baseline sdpa-cudnn --iters 50 --no-plots --out $R/attn_b2 > $R/attn_b2.log 2>&1
timeout 60 python3 bench_attention.py --batch 1 --heads 16 --seq-lens 4096 --d-heads 64 --causal yes \
  --backends flash,sdpa-flash,sdpa-cudnn --baseline sdpa-cudnn --iters 100 --no-plots --out $R/attn_n4096 > $R/attn_n4096.log 2>&1

stage "train small: flash vs sdpa, same seed"
for a in sdpa flash; do
  timeout 100 python3 train.py --size small --attn $a --dtype bf16 --batch-size 16 --context-length 1024 --steps 80 \
    --log-every 10 --eval-every 40 --eval-batches 4 --seed 0 --no-checkpoint --wandb disabled --out $R/train_$a > $R/train_$a.log 2>&1
done

stage "bench_model sweep (issue 5)"
timeout 200 python3 bench_model.py --sizes small,medium,large,xl,2.7B --context-lengths 128,256,512,1024 \
  --dtype fp32,bf16 --mode forward-backward --warmup 2 --steps 4 --no-progress --out $R/model_sweep > $R/model_sweep.log 2>&1

stage "profile small (naive attention) and memory snapshot 2.7B"
timeout 60 python3 bench_model.py --sizes small --context-lengths 512 --dtype bf16 --attn naive --mode train-step \
  --warmup 2 --steps 3 --profile $R/profile_small --no-progress --out $R/profile_run > $R/profile.log 2>&1
timeout 60 python3 bench_model.py --sizes 2.7B --context-lengths 512 --dtype bf16 --mode train-step --warmup 1 --steps 2 \
  --memory-snapshot $R/snapshot_2.7B.pickle --snapshot-max-entries 30000 --no-progress --out $R/snapshot_run > $R/snapshot.log 2>&1

stage "training-step configs (issue 6)"
timeout 100 python3 bench_model.py --sizes large --context-lengths 1024 --batch-size 4 --dtype bf16 --attn sdpa,flash \
  --compile on --mode train-step --warmup 3 --steps 8 --no-progress --out $R/step_large > $R/step_large.log 2>&1
timeout 60 python3 bench_model.py --sizes small --context-lengths 1024 --batch-size 16 --dtype bf16 --attn sdpa,flash \
  --compile on --mode train-step --warmup 3 --steps 8 --no-progress --out $R/step_small > $R/step_small.log 2>&1
timeout 60 python3 bench_model.py --sizes 2.7B --context-lengths 512 --batch-size 4 --dtype bf16 --attn sdpa,flash \
  --mode train-step --warmup 2 --steps 5 --no-progress --out $R/step_2.7B > $R/step_2.7B.log 2>&1

stage "pack"
find $R -name "*.png" -delete; find $R -name "*.pickle" -size +14M -delete
tar czf "$OUT/results.tgz" -C /tmp res; ls -la "$OUT"
for f in $R/attn_b2/results.md $R/attn_n4096/results.md; do grep -A8 "^## Summary\|^| backend" $f 2>/dev/null | head -12; done
for a in sdpa flash; do echo "-- train $a"; grep "^step" $R/train_$a.log | tail -3; done
for d in step_large step_small step_2.7B; do echo "-- $d"; grep -E "^\| (sdpa|flash)" $R/$d/results.md | head -4; done
