#!/bin/bash
# One GPU call (issue 34): the narrow compensator states on the kernels. The JIT build; the state's device
# functions against the reference (tests/test_state_narrow_kernels.py); the workspace views
# (tests/test_p2p_views.py); the p2p suites in their quick form (check_state_formats: bf16, int8 and int4 states,
# both residuals, pow2, chunks and graph replay, outputs and states bit-identical to the emulator); then
# bench_p2p, graph replay, compensated over uncompensated with the state as bf16 and int4 (STATES), P = 2 and
# 4, 4 MiB to 256 MiB (the ratio goal), in one session so the ratios compare.
#
#   OUT=/some/dir bash benchmarks/gpu_state.sh
#
# STATES (default "bf16 int4") picks the state formats benchmarked, BENCH_STAGES (default fused: one launch at
# every size; auto: the staged pipeline above 16 MiB) the path, TESTS the -k of tests/test_p2p_gpu.py (default
# "test_gpu_suite and not 8"). Writes to $OUT: test.log, bench_<state>.{log,json}, misc.tgz.
set -u
OUT=${OUT:-/tmp/state_out}
source benchmarks/gpu_env.sh
session_begin "$OUT"
{ timeout 100 $PYTEST tests/test_state_narrow_kernels.py tests/test_p2p_views.py tests/test_p2p_transport_gpu.py --timeout 90
  ECHO_P2P_QUICK=1 timeout 240 $PYTEST tests/test_p2p_gpu.py -k "${TESTS:-test_gpu_suite and not 8}" --timeout 230
} 2>&1 | grep -v "^\[.*WARNING" > "$OUT/test.log"; grep -E "passed|failed|format|Error|chunk" "$OUT/test.log" | tail -12
stamp "tests done"
for STATE in ${STATES:-bf16 int4}; do
  timeout 90 python3 benchmarks/bench_p2p.py --json "$OUT/bench_$STATE.json" --world-sizes 2,4 --min-bytes 4194304 \
    --max-bytes 268435456 --factor 4 --warmup 2 --iters 5 --graph-reps 5 --stages ${BENCH_STAGES:-fused} --bits 4 --pingpong 0 \
    --tile-sweep-bytes 0 --check-max-bytes 16777216 --state-dtype $STATE > "$OUT/bench_$STATE.log" 2>&1
  stamp "bench $STATE rc=$?"
  grep -h -A8 "graph ratio" "$OUT/bench_$STATE.log" | grep "^|"
done
stop_mps
(cd "$OUT" && tar czf misc.tgz env.txt build.log p2p_log.txt 2>/dev/null; rm -f env.txt build.log p2p_log.txt)
stamp "end"
