#!/usr/bin/env bash
# One device call: where ours and the Hugging Face peer differ, kernel by kernel (large, batch 4, context 1024,
# compiled train-step, torch.profiler); then the CUDA-graph bench test (peak memory counted from the capture).
EXTRA_WHEELS=transformers source "$(dirname "$0")/session_preamble.sh"

stage "profile large: ours (sdpa) and hf"
timeout 300 python3 bench_model.py --sizes large --context-lengths 1024 --batch-size 4 --dtype bf16 --mode train-step \
  --warmup 3 --steps 3 --no-progress --compile on --attn sdpa --impl ours,hf --profile $R/prof --profile-steps 2 \
  --out $R/prof-large > $R/prof-large.log 2>&1; echo "rc=$?"
stage "CUDA graph bench test"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_bench_model.py -k cuda_graph > $R/graph_tests.log 2>&1; echo "rc=$?"
stage "pack"
find $R -name "*.json" -path "*prof/*" -size +5M -delete
tar czf "$OUT/results.tgz" -C /tmp res
tail -2 $R/graph_tests.log
grep -v "^$" $R/prof-large.log | grep -v "Warning\|warn" | tail -60
