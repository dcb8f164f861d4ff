#!/usr/bin/env bash
# Multi-GPU checks of train.py on one host with 2 GPUs (about 3-5 minutes on 2 H200s):
#   1. DDP scaling: the large preset (context 1024, bf16, synthetic tokens) for 30 steps on 1 GPU, then on 2 GPUs
#      with the same per-GPU batch; prints tokens/s of each and the ratio (goal >= 1.85x).
#   2. FSDP: the 10B preset (12.7B parameters: 204 GB of fp32 weights, gradients and AdamW moments, more than
#      one GPU holds) on 2 GPUs, bf16, context 512, global batch 4, activation checkpointing; losses and peak
#      memory per rank for 8 steps on byte-level text (the Python standard library's sources).
# Logs and metrics go to $OUT (default runs/gpu_distributed); the runs themselves to $RUN_DIR.
# Needs torch with CUDA + NCCL and einx importable; W&B is off. DEVICE=cpu runs the same steps with a tiny model
# over gloo, to check this script on a machine without GPUs.
set -uo pipefail
cd "$(dirname "$0")/../.."

# Required on this machine: never use NVLink multicast (NVLS / symmetric-memory multicast).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The 10B run allocates and frees tens of GiB at start-up (full weights, then shards): avoid fragmentation.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

PY="${PYTHON:-python}"
LOGS="${OUT:-runs/gpu_distributed}"
RUN_DIR="${RUN_DIR:-/tmp/flash-lm-distributed}"
DEVICE="${DEVICE:-cuda}"
PER_GPU_BATCH="${PER_GPU_BATCH:-8}"
mkdir -p "$LOGS" "$RUN_DIR"

if [ "$DEVICE" = cuda ]; then
    n_gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())") || exit 1
    if [ "$n_gpus" -lt 2 ]; then echo "error: needs 2 GPUs, found $n_gpus" >&2; exit 1; fi
    DDP_MODEL=(--size large --context-length 1024 --dtype bf16 --attn sdpa)
    FSDP_MODEL=(--size 10B --context-length 512 --dtype bf16 --attn sdpa)
else  # a tiny stand-in, to test the script itself
    DDP_MODEL=(--size tiny --n-layers 2 --context-length 64 --dtype fp32 --attn sdpa --device cpu)
    FSDP_MODEL=(--size tiny --n-layers 2 --context-length 64 --dtype fp32 --attn sdpa --device cpu)
fi
COMMON=(--wandb disabled --no-checkpoint --eval-every 0 --eval-batches 1)

status=0
run() {  # run NAME NPROC TIMEOUT_S ARGS...: torchrun train.py, log to $LOGS/NAME.log, keep metrics.jsonl
    local name=$1 nproc=$2 limit=$3
    shift 3
    echo "== $name: torchrun --nproc-per-node $nproc train.py $*"
    rm -rf "${RUN_DIR:?}/$name"
    OMP_NUM_THREADS=4 timeout "$limit" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
        train.py --out "$RUN_DIR/$name" "$@" 2>&1 | tee "$LOGS/$name.log"
    local rc=${PIPESTATUS[0]}
    [ -f "$RUN_DIR/$name/metrics.jsonl" ] && cp "$RUN_DIR/$name/metrics.jsonl" "$LOGS/$name.metrics.jsonl"
    if [ "$rc" -ne 0 ]; then echo "!! $name failed with exit code $rc (see $LOGS/$name.log)"; status=1; fi
}

# 1. DDP: same per-GPU batch, so the 2-GPU run should move twice the tokens per second.
DDP_ARGS=("${DDP_MODEL[@]}" --data synthetic --steps 30 --warmup-steps 5 --log-every 10 "${COMMON[@]}" --parallel ddp)
run ddp-1gpu 1 120 "${DDP_ARGS[@]}" --batch-size "$PER_GPU_BATCH"
run ddp-2gpu 2 120 "${DDP_ARGS[@]}" --batch-size $((2 * PER_GPU_BATCH))

# 2. FSDP: the 10B preset sharded over 2 GPUs. This init spikes the loss in the first steps at any size (seen in
# one process too); a peak LR of 3e-4 after 2 warm-up steps diverged on an H200 pair, 1.5e-4 over 10 falls.
run fsdp-10B-2gpu 2 200 "${FSDP_MODEL[@]}" --batch-size 4 --steps 40 --warmup-steps 10 --lr 1.5e-4 --min-lr 1.5e-5 \
    --log-every 2 --activation-checkpointing "${COMMON[@]}" --parallel fsdp

"$PY" - "$LOGS" <<'EOF' | tee "$LOGS/summary.txt"
import json, sys
from pathlib import Path

logs = Path(sys.argv[1])
def rows(name):
    path = logs / f"{name}.metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

print(f"\n{'run':<15} {'tokens/s':>10} {'step ms':>8} {'MFU':>6} {'peak GiB/rank':>14}  losses")
for name in ("ddp-1gpu", "ddp-2gpu", "fsdp-10B-2gpu"):
    r = rows(name)
    if not r:
        print(f"{name:<15} {'(failed: no metrics)':>10}")
        continue
    last = r[-1]  # the last window: steady state, warm-up excluded
    mfu = f"{100 * last['mfu']:.1f}%" if last.get("mfu") is not None else "-"
    peak = f"{last['mem_peak_gib']:.1f}" if "mem_peak_gib" in last else "-"
    losses = " ".join(f"{x['loss']:.3f}" for x in r)
    print(f"{name:<15} {last['tokens_per_s']:>10,.0f} {last['step_ms']:>8.0f} {mfu:>6} {peak:>14}  {losses}")
one, two = rows("ddp-1gpu"), rows("ddp-2gpu")
if one and two:
    ratio = two[-1]["tokens_per_s"] / one[-1]["tokens_per_s"]
    print(f"\nDDP 2 GPUs / 1 GPU tokens/s: {ratio:.2f}x (goal >= 1.85x): {'ok' if ratio >= 1.85 else 'BELOW GOAL'}")
fsdp = rows("fsdp-10B-2gpu")
if fsdp:
    falling = fsdp[-1]["loss"] < fsdp[0]["loss"]
    print(f"FSDP 10B loss {fsdp[0]['loss']:.3f} -> {fsdp[-1]['loss']:.3f}: {'falling' if falling else 'NOT FALLING'}")
EOF
exit $status
