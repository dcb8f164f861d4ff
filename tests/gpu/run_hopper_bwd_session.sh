#!/usr/bin/env bash
# One device call: the Hopper kernels' test file, then the Hopper backward against flash's Triton backward and
# cuDNN (tests/gpu/experiments/flash_hopper_bwd.py; SHAPES picks shape indices, all by default).
# Results land in $OUT/results.tgz; the summary lines print last. TESTS=0 skips the tests.
source "$(dirname "$0")/session_preamble.sh"
rm -f $R/hopper-tests.log $R/hopper-bwd.txt

if [ "${TESTS:-1}" = 1 ]; then
  stage "Hopper kernel tests"
  timeout ${TESTS_TIMEOUT:-240} python3 -m pytest tests/attention/test_flash_hopper.py -n 14 -q -x \
    > $R/hopper-tests.log 2>&1; echo "rc=$?"
fi
stage "Hopper backward against Triton and cuDNN"
PYTHONPATH=. timeout ${EXPERIMENT_TIMEOUT:-300} python3 tests/gpu/experiments/flash_hopper_bwd.py ${SHAPES:-} \
  > $R/hopper-bwd.txt 2>&1
echo "rc=$?"
stage "pack"
tar czf "$OUT/results.tgz" -C /tmp res
[ -f $R/hopper-tests.log ] && grep -v "^\.\|^$" $R/hopper-tests.log | tail -15
grep "SUMMARY\|WRONG\|FAILED\|Error\|repeatable\|dkdv c\|dq c\|forward:\|second stream" $R/hopper-bwd.txt | cut -c1-400
