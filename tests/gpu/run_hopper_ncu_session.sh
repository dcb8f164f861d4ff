#!/usr/bin/env bash
# Nsight Compute on flash's Gluon Hopper kernels (forward, dK/dV, dQ), one profile per shape, to $OUT/ncu-*.txt.
# SHAPES: "B H N D causal;..." (default: the leaderboard shape, B2 N8192 D64 not causal, B2 N8192 D128 causal).
source tests/gpu/session_preamble.sh
SHAPES=${SHAPES:-"1 16 16384 64 1;2 16 8192 64 0;2 16 8192 128 1"}
SECTIONS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats --section MemoryWorkloadAnalysis"
METRICS="--metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.sum,smsp__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"
IFS=';' read -ra LIST <<< "$SHAPES"
for s in "${LIST[@]}"; do
  tag=$(echo $s | tr ' ' '-')
  stage "ncu $s"
  timeout ${NCU_TIMEOUT:-200} ncu --clock-control none --kernel-name regex:'attn_(fwd|bwd_dkdv|bwd_dq)_hopper' \
    --launch-skip 3 --launch-count 3 $SECTIONS $METRICS \
    python3 tests/gpu/experiments/flash_hopper_ncu_target.py $s > $OUT/ncu-$tag.txt 2>&1
  echo "rc=$?"; tail -3 $OUT/ncu-$tag.txt
done
for f in $OUT/ncu-*.txt; do
  echo "### $f"
  grep -E "attn_|Duration|Compute \(SM\) Throughput|Memory Throughput|No Instruction|Stall|Warp Cycles Per Issued|Issued Warp Per Scheduler|gmma|inst_executed|Registers Per|L2 Hit|Executed Ipc" $f | head -80
done
