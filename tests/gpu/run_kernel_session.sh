#!/usr/bin/env bash
# One device call: the flash GPU test suite (fp32/fp16/bf16), then the attention timings against the peers.
# Usage on the GPU machine: bash tests/gpu/run_kernel_session.sh   (writes under $OUT, default ./gpu-out)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
[ -d .wheels ] && python3 -m pip install -q --no-index --find-links .wheels einx wandb
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
date +%T; timeout ${SUITE_TIMEOUT:-270} python3 tests/gpu/run_gpu_suite.py --out "$OUT/gpu-tests.json" -- tests/attention -n 14 -q > "$OUT/gpu_suite.log" 2>&1; echo "suite rc=$?"
grep -v "^\.\|^$" "$OUT/gpu_suite.log" | tail -45
date +%T; timeout ${BENCH_TIMEOUT:-240} python3 bench_attention.py --preset leaderboard --no-plots --out /tmp/lb > "$OUT/leaderboard.log" 2>&1; echo "leaderboard rc=$?"
cp /tmp/lb/results.json "$OUT/leaderboard.json"; cat /tmp/lb/results.md
date +%T
