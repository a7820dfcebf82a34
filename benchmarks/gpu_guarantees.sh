#!/bin/bash
# One GPU call (issue 35): the JIT build, then the steps of STEPS (default "range faults suite soak"):
#   range   the kernels' range events without rescaling against the reference's (tests/test_range.py, P = 2
#           and 4; RANGE_K narrows it, a pytest -k expression);
#   faults  on_fault="reference" and the resumed rank (tests/test_faults_gpu.py; FAULTS_K, default
#           "cuda and (on_fault or resumed)");
#   suite   the quick p2p suite at P = 2 and the staged kernels (tests/test_p2p_gpu.py);
#   misuse  the chunked and staged mismatch tests (tests/test_misuse_paths.py, GPU part);
#   groups  DP 2 x TP 2 on four ranks (tests/test_groups_gpu.py);
#   soak    ECHO_SOAK_CALLS calls (default 2000) at each P of SOAK_P (default "2 4"), one after the other or,
#           with SOAK_PARALLEL=1, at once.
#
#   OUT=/some/dir bash benchmarks/gpu_guarantees.sh
#   STEPS=soak SOAK_PARALLEL=1 ECHO_SOAK_CALLS=100000 SOAK_LIMIT_S=470 OUT=/some/dir \
#     bash benchmarks/gpu_guarantees.sh   # the long soak, P = 2 and 4 at once
#
# Writes to $OUT: <step>.log (soak_P<n>.log), misc.tgz (env.txt, build.log, p2p_log.txt).
set -u
OUT=${OUT:-/tmp/guarantees_out}
STEPS=${STEPS:-range faults suite soak}
source benchmarks/gpu_env.sh
session_begin "$OUT"
PYTEST_GPU="$PYTEST -rfExX -m gpu"
quiet() { grep -v "^\[.*WARNING"; }
step() {  # step NAME LIMIT_S PYTEST_ARGS...: run, keep the log, print its summary
  local name=$1 limit=$2; shift 2
  timeout "$limit" $PYTEST_GPU "$@" --timeout $((limit - 10)) 2>&1 | quiet > "$OUT/$name.log"
  grep -E "^P2P:|passed|failed|XFAIL|XPASS|Error|assert" "$OUT/$name.log" | cut -c1-400 | tail -10
  stamp "$name done"
}
for s in $STEPS; do
  case $s in
    range) step range 150 tests/test_range.py -k "${RANGE_K:-kernel}" ;;
    faults) step faults 200 tests/test_faults_gpu.py -k "${FAULTS_K:-cuda and (on_fault or resumed)}" ;;
    suite) ECHO_P2P_QUICK=1 step suite 150 "tests/test_p2p_gpu.py::test_gpu_suite[2]" \
             tests/test_p2p_gpu.py::test_gpu_staged_kernels ;;
    misuse) step misuse 150 tests/test_misuse_paths.py ;;
    groups) step groups 100 tests/test_groups_gpu.py ;;
    soak)
      soak() {
        ECHO_SOAK_CALLS=${ECHO_SOAK_CALLS:-2000} timeout ${SOAK_LIMIT_S:-120} $PYTEST_GPU tests/test_soak_gpu.py \
          -k "$1" --timeout ${SOAK_LIMIT_S:-120} 2>&1 | quiet > "$OUT/soak_P$1.log"
      }
      if [ -n "${SOAK_PARALLEL:-}" ]; then
        # Both world sizes at once (six ranks on the GPU): each rank's grid capped at its share of half the
        # resident blocks (the buffer's own cap counts only its group).
        export ECHO_P2P_MAX_BLOCKS=${ECHO_P2P_MAX_BLOCKS:-22}
        for P in ${SOAK_P:-2 4}; do soak "$P" & done
        wait
        unset ECHO_P2P_MAX_BLOCKS
      else
        for P in ${SOAK_P:-2 4}; do soak "$P"; done
      fi
      for P in ${SOAK_P:-2 4}; do grep -E "soak|passed|failed|Error" "$OUT/soak_P$P.log" | cut -c1-600 | tail -3; done
      stamp "soak done" ;;
  esac
done
stop_mps
(cd "$OUT" && tar czf misc.tgz env.txt build.log p2p_log.txt 2>/dev/null; rm -f env.txt build.log p2p_log.txt)
stamp "end"
