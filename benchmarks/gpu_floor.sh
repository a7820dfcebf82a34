#!/bin/bash
# One GPU call (issues 31 and 36): the JIT build, the transport's one-process tests, the p2p suite at P = 2
# and 4 in its quick form (chunked calls in a small workspace included), then bench_p2p with the floor
# columns: the one-launch call ("fused") beside the default choice ("auto": the staged pipeline above
# 16 MiB) from 64 KiB to 1 GiB, eager and graph replay, 4 and 8 bits, with the copy bandwidth, the latency
# table (empty launch, flag round trip) and the memory table of the same run.
#
#   OUT=/some/dir bash benchmarks/gpu_floor.sh        # BENCH_ARGS overrides the benchmark's arguments
#
# Writes to $OUT: env.txt, build.log, test.log, p2p_log.txt, bench.log, bench.json.
set -u
OUT=${OUT:-/tmp/floor_out}
source benchmarks/gpu_env.sh
session_start "$OUT"
cat "$OUT/env.txt"
source benchmarks/gpu_mps.sh
start_mps
stamp "MPS: $MPS"

build_ops "$OUT/build.log" 300; tail -2 "$OUT/build.log"
stamp "built"

PYTEST="python3 -m pytest -q -rfE -p no:cacheprovider -s"
{ timeout 100 $PYTEST tests/test_p2p_transport_gpu.py --timeout 90
  ECHO_P2P_QUICK=1 timeout "${TEST_TIMEOUT:-240}" $PYTEST tests/test_p2p_gpu.py -k "${TESTS:-test_gpu_suite and not 8}" \
    --timeout 230
  stamp "tests done"
} 2>&1 | tee "$OUT/test.log" | grep -v "^\[.*WARNING" | tail -8

BENCH_ARGS=${BENCH_ARGS:-"--world-sizes 2,4 --min-bytes 65536 --max-bytes 1073741824 --factor 4 --warmup 2 --iters 5 \
  --graph-reps 5 --stages fused,auto --bits 4,8 --pingpong 200 --tile-sweep-bytes 0 --check-max-bytes 16777216"}
timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/bench_p2p.py --json "$OUT/bench.json" $BENCH_ARGS > "$OUT/bench.log" 2>&1
stamp "bench rc=$?"
stop_mps
grep -v "WARNING" "$OUT/bench.log" | tail -120
tail -12 "$ECHO_P2P_LOG"
stamp "end"
