#!/usr/bin/env bash
# One device call: the flash GPU test suite, then every attention shape of issue 6 against the peers in the same
# run: the leaderboard preset (B1 H16 N16384 D64 causal), B1 H16 N4096 D64 causal, and B2 H16 N8192 at D64/D128,
# causal and not. Results land in $OUT/results.tgz; the tables print last. SUITE=0 skips the test suite;
# BENCHES picks among "leaderboard n4096 n8192" (all by default); GRAPH_TIMING=1 adds each backend's graphed
# times (bench_attention --graph-timing).
source "$(dirname "$0")/session_preamble.sh"
rm -rf $R/attn-leaderboard $R/attn-n4096 $R/attn-n8192 $R/*.log

if [ "${SUITE:-1}" = 1 ]; then stage "flash GPU test suite"; gpu_suite; fi
graph=""; [ "${GRAPH_TIMING:-0}" = 1 ] && graph="--graph-timing"
peers="--backends flash,sdpa-flash,sdpa-cudnn,flex --baseline sdpa-cudnn --no-plots $graph"
BENCHES=${BENCHES:-leaderboard n4096 n8192}
if [[ " $BENCHES " == *" leaderboard "* ]]; then
  stage "leaderboard preset"
  timeout 150 python3 bench_attention.py --preset leaderboard --no-plots $graph --out $R/attn-leaderboard > $R/attn-leaderboard.log 2>&1; echo "rc=$?"
fi
if [[ " $BENCHES " == *" n4096 "* ]]; then
  stage "B1 H16 N4096 D64 causal"
  timeout 90 python3 bench_attention.py --batch 1 --heads 16 --seq-lens 4096 --d-heads 64 --causal yes $peers \
    --out $R/attn-n4096 > $R/attn-n4096.log 2>&1; echo "rc=$?"
fi
if [[ " $BENCHES " == *" n8192 "* ]]; then
  stage "B2 H16 N8192 D64/D128, causal and not"
  timeout ${N8192_TIMEOUT:-180} python3 bench_attention.py --batch 2 --heads 16 --seq-lens 8192 --d-heads 64,128 --causal both $peers \
    --out $R/attn-n8192 > $R/attn-n8192.log 2>&1; echo "rc=$?"
fi
stage "pack"
tar czf "$OUT/results.tgz" -C /tmp res
[ -f $R/gpu_suite.log ] && grep -v "^\.\|^$" $R/gpu_suite.log | tail -8
for d in attn-leaderboard attn-n4096 attn-n8192; do [ -d $R/$d ] || continue; echo "-- $d"; sed -n '/Forward + backward time/,/^## Per backend/p' $R/$d/results.md | head -30; done
