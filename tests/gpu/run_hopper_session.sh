#!/usr/bin/env bash
# One device call: the flash GPU test suite (which includes the Hopper forward's tests), then the Hopper forward
# against flash's Triton forward and cuDNN at issue 6's shapes (tests/gpu/experiments/flash_hopper_fwd.py).
# Results land in $OUT/results.tgz; the summary lines print last. SUITE=0 skips the test suite.
source "$(dirname "$0")/session_preamble.sh"
rm -f $R/gpu-tests.json $R/gpu_suite.log $R/hopper-fwd.txt

if [ "${SUITE:-1}" = 1 ]; then stage "flash GPU test suite"; gpu_suite; fi
stage "Hopper forward against Triton and cuDNN"
PYTHONPATH=. timeout ${EXPERIMENT_TIMEOUT:-240} python3 tests/gpu/experiments/flash_hopper_fwd.py > $R/hopper-fwd.txt 2>&1
echo "rc=$?"
stage "pack"
tar czf "$OUT/results.tgz" -C /tmp res
[ -f $R/gpu_suite.log ] && grep -v "^\.\|^$" $R/gpu_suite.log | tail -8
grep "SUMMARY\|host per call\|WRONG\|FAILED\|Error" $R/hopper-fwd.txt
