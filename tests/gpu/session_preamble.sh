# Sourced by the run_*_session.sh scripts: shell options, $OUT and $R (results, packed at the end), the wheels
# the GPU image lacks, a Triton cache inside the tree, and `stage` to timestamp each step in the log.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; R=/tmp/res; mkdir -p $R
[ -d .wheels ] && python3 -m pip install -q --no-index --find-links .wheels einx wandb ${EXTRA_WHEELS:-}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
stage() { echo "== $(date +%T) $1"; }
# The flash GPU test suite (fixed tiles: autotuning every test shape would take longer than the tests).
gpu_suite() {
  FLASH_ATTN_AUTOTUNE=0 timeout ${SUITE_TIMEOUT:-240} python3 tests/gpu/run_gpu_suite.py --out $R/gpu-tests.json \
    -- tests/attention -n 14 -q > $R/gpu_suite.log 2>&1; echo "rc=$?"
}
# The training configs: batch and context per size (small, large, 2.7B).
step_shape() {
  case $1 in
    small) echo "--batch-size 16 --context-lengths 1024" ;;
    large) echo "--batch-size 4 --context-lengths 1024" ;;
    2.7B) echo "--batch-size 4 --context-lengths 512" ;;
  esac
}
