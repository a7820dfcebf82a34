#!/bin/bash
# The one-launch p2p call on one GPU, in one session: build echo_ds.ops (JIT, timed), the p2p suites with
# stages "fused" (bit-identical to the emulator, graph replay, mixed-size stress), the killed-rank tests of
# both pipelines, and bench_p2p's staged-against-one-launch table. Ranks share the GPU under MPS.
#
#   OUT=/some/dir bash benchmarks/gpu_one_launch.sh          # ECHO_P2P_QUICK=1: smaller suites
#   BENCH_ARGS="..." overrides the benchmark's arguments; SKIP_SUITE=1 / SKIP_BENCH=1 skip a part;
#   ECHO_P2P_STAGES=auto runs the suites with the default choice (one launch up to 16 MiB, staged above).
#   TESTS="..." replaces the suites' -k selection; SKIP_KILLED=1 skips the killed-rank tests;
#   POW2_MODES="false auto true" runs the benchmark once per pow2_rescale mode (default: false).
# Writes to $OUT: env.txt, ops_build.log, test.log, p2p_log.txt, bench[_MODE].log, bench[_MODE].json.
set -u
OUT=${OUT:-/tmp/one_launch_out}
source benchmarks/gpu_env.sh
session_start "$OUT"

source benchmarks/gpu_mps.sh
start_mps
stamp "MPS: $MPS"

build_ops "$OUT/ops_build.log"; tail -3 "$OUT/ops_build.log"
stamp "built"

PYTEST="python3 -m pytest -q -rfE -p no:cacheprovider -s"
if [ -z "${SKIP_SUITE:-}" ]; then
  { ECHO_P2P_STAGES=${ECHO_P2P_STAGES:-fused} timeout 300 $PYTEST tests/test_p2p_gpu.py -k "${TESTS:-suite or staged}" --timeout 250
    stamp "suites done"
    if [ -z "${SKIP_KILLED:-}" ]; then
      timeout 120 $PYTEST tests/test_p2p_gpu.py -k "killed and fused" --timeout 100
      stamp "killed-rank tests done"
    fi
  } 2>&1 | tee "$OUT/test.log" | grep -v "^\[.*WARNING"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  BENCH_ARGS=${BENCH_ARGS:-"--world-sizes 2,4 --min-bytes 65536 --max-bytes 268435456 --factor 4 --warmup 3 --iters 10 --tile-sweep-bytes 0 --pingpong 0 --graph-reps 10"}
  for MODE in ${POW2_MODES:-false}; do
    SUFFIX=$([ "$MODE" = false ] && echo "" || echo "_$MODE")
    timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/bench_p2p.py --pow2 "$MODE" --json "$OUT/bench$SUFFIX.json" \
      $BENCH_ARGS 2>&1 | tee "$OUT/bench$SUFFIX.log" | grep -v "WARNING"
    stamp "bench pow2=$MODE done"
  done
fi
stop_mps
echo "=== summary ==="
cat "$ECHO_P2P_LOG"
grep -h -E "passed|failed|error" "$OUT/test.log" 2>/dev/null | tail -4
stamp "end"
