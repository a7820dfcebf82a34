#!/bin/bash
# One GPU call (issue 35, items 3-5): the JIT build; several groups at once (DP 2 x TP 2 on four ranks sharing
# the GPU, a call on the wrong group refused: tests/test_groups_gpu.py); a rank killed, stopped, or stopped and
# resumed in the middle of a long run at P = 2 and 4 (tests/test_faults_gpu.py; the resumed rank must
# return no wrong result: a rank whose wait failed publishes no flag); then a short soak (tests/test_soak_gpu.py, ECHO_SOAK_CALLS per world size, default 2000). The
# steps' limits add up to 450 s after the build.
#
#   OUT=/some/dir bash benchmarks/gpu_reliability.sh
#
# Writes to $OUT: groups.log, faults.log, soak.log, misc.tgz (env.txt, build.log, p2p_log.txt: the lines the
# tests log, among them every survivor's error message).
set -u
OUT=${OUT:-/tmp/reliability_out}
source benchmarks/gpu_env.sh
session_begin "$OUT"
PYTEST_GPU="$PYTEST -rfExX -m gpu"
timeout 100 $PYTEST_GPU tests/test_groups_gpu.py --timeout 90 2>&1 | grep -v "^\[.*WARNING" > "$OUT/groups.log"
grep -E "^P2P:|passed|failed|Error" "$OUT/groups.log" | tail -6
stamp "groups done"
timeout 220 $PYTEST_GPU tests/test_faults_gpu.py --timeout 200 2>&1 | grep -v "^\[.*WARNING" > "$OUT/faults.log"
grep -E "^P2P:|passed|failed|XFAIL|XPASS|Error" "$OUT/faults.log" | cut -c1-400 | tail -16
stamp "faults done"
ECHO_SOAK_CALLS=${ECHO_SOAK_CALLS:-2000} timeout 130 $PYTEST_GPU tests/test_soak_gpu.py --timeout 120 2>&1 \
  | grep -v "^\[.*WARNING" > "$OUT/soak.log"
grep -E "soak|passed|failed|Error" "$OUT/soak.log" | tail -4
stamp "soak done"
stop_mps
(cd "$OUT" && tar czf misc.tgz env.txt build.log p2p_log.txt 2>/dev/null; rm -f env.txt build.log p2p_log.txt)
stamp "end"
