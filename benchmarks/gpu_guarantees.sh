#!/bin/bash
# One GPU call (issue 35): the JIT build; the kernels' range events without rescaling against the reference's
# (tests/test_range.py, P = 2 and 4); faults with on_fault="reference" and the resumed rank (tests/
# test_faults_gpu.py, P = 2 and 4); the quick p2p suite at P = 2 (the kernel change's regression check);
# then a soak of ECHO_SOAK_CALLS calls (default 2000) at SOAK_P (default "2 4").
#
#   OUT=/some/dir bash benchmarks/gpu_guarantees.sh
#   SKIP_TESTS=1 SOAK_PARALLEL=1 ECHO_SOAK_CALLS=100000 SOAK_LIMIT_S=470 OUT=/some/dir \
#     bash benchmarks/gpu_guarantees.sh   # the long soak, P = 2 and 4 at once
#
# Writes to $OUT: range.log, faults.log, suite.log, soak_P<n>.log, misc.tgz (env.txt, build.log,
# p2p_log.txt).
set -u
OUT=${OUT:-/tmp/guarantees_out}
source benchmarks/gpu_env.sh
session_begin "$OUT"
PYTEST_GPU="$PYTEST -rfExX -m gpu"
quiet() { grep -v "^\[.*WARNING"; }
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 150 $PYTEST_GPU tests/test_range.py --timeout 140 2>&1 | quiet > "$OUT/range.log"
  grep -E "passed|failed|Error|assert" "$OUT/range.log" | cut -c1-400 | tail -6
  stamp "range done"
  timeout 200 $PYTEST_GPU tests/test_faults_gpu.py -k "cuda and (on_fault or resumed)" --timeout 190 2>&1 | quiet \
    > "$OUT/faults.log"
  grep -E "^P2P:|passed|failed|XFAIL|XPASS|Error" "$OUT/faults.log" | cut -c1-400 | tail -10
  stamp "faults done"
  ECHO_P2P_QUICK=1 timeout 150 $PYTEST_GPU "tests/test_p2p_gpu.py::test_gpu_suite[2]" --timeout 140 2>&1 | quiet \
    > "$OUT/suite.log"
  grep -E "passed|failed|Error" "$OUT/suite.log" | cut -c1-400 | tail -4
  stamp "suite done"
fi
soak() {
  ECHO_SOAK_CALLS=${ECHO_SOAK_CALLS:-2000} timeout ${SOAK_LIMIT_S:-120} $PYTEST_GPU tests/test_soak_gpu.py -k "$1" \
    --timeout ${SOAK_LIMIT_S:-120} 2>&1 | quiet > "$OUT/soak_P$1.log"
}
if [ -n "${SOAK_PARALLEL:-}" ]; then
  # Both world sizes at once (six ranks on the GPU): each rank's grid capped at its share of half the
  # resident blocks (the buffer's own cap counts only its group).
  export ECHO_P2P_MAX_BLOCKS=${ECHO_P2P_MAX_BLOCKS:-22}
  for P in ${SOAK_P:-2 4}; do soak "$P" & done
  wait
  for P in ${SOAK_P:-2 4}; do grep -E "soak|passed|failed|Error" "$OUT/soak_P$P.log" | cut -c1-600 | tail -4; done
  stamp "soaks done"
else
  for P in ${SOAK_P:-2 4}; do
    soak "$P"
    grep -E "soak|passed|failed|Error" "$OUT/soak_P$P.log" | cut -c1-600 | tail -4
    stamp "soak P=$P done"
  done
fi
stop_mps
(cd "$OUT" && tar czf misc.tgz env.txt build.log p2p_log.txt 2>/dev/null; rm -f env.txt build.log p2p_log.txt)
stamp "end"
