#!/bin/bash
# One GPU call (issues 31 and 36): the JIT build, the transport's one-process tests, the p2p suite at P = 2,
# 4 and 8 in its quick form (chunked calls in a small workspace included), then bench_p2p with the floor
# columns: the one-launch call ("fused") beside the default choice ("auto": the staged pipeline above
# 16 MiB) from 64 KiB to 1 GiB at P = 2 and 4 (P = 8: to 256 MiB), eager and graph replay, 4 and 8 bits,
# with the copy bandwidth, the latency table (empty launch, flag round trip) and the memory table of the
# same run; last, P = 2 without the rotation (the rotation's share of the kernel's time).
#
#   OUT=/some/dir bash benchmarks/gpu_floor.sh        # BENCH_ARGS overrides the benchmark's arguments
#
# Writes to $OUT: test.log, bench.log, bench.json, bench_p8.{log,json}, bench_norot.log and misc.tgz (env.txt,
# build.log, p2p_log.txt: the device returns at most 8 files).
set -u
OUT=${OUT:-/tmp/floor_out}
source benchmarks/gpu_env.sh
session_begin "$OUT"
{ timeout 100 $PYTEST tests/test_p2p_transport_gpu.py --timeout 90
  ECHO_P2P_QUICK=1 timeout "${TEST_TIMEOUT:-210}" $PYTEST tests/test_p2p_gpu.py -k "${TESTS:-test_gpu_suite}" \
    --timeout 200
  stamp "tests done"
} 2>&1 | tee "$OUT/test.log" | grep -v "^\[.*WARNING" | tail -8

BENCH_ARGS=${BENCH_ARGS:-"--world-sizes 2,4 --min-bytes 65536 --max-bytes 1073741824 --factor 4 --warmup 2 --iters 5 \
  --graph-reps 5 --stages fused,auto --bits 4,8 --pingpong 200 --tile-sweep-bytes 0 --check-max-bytes 16777216"}
timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/bench_p2p.py --json "$OUT/bench.json" $BENCH_ARGS > "$OUT/bench.log" 2>&1
stamp "bench rc=$?"
timeout 100 python3 benchmarks/bench_p2p.py --json "$OUT/bench_p8.json" --world-sizes 8 --min-bytes 65536 \
  --max-bytes 268435456 --factor 4 --warmup 2 --iters 5 --graph-reps 5 --stages fused,auto --bits 4 --pingpong 0 \
  --tile-sweep-bytes 0 --check-max-bytes 16777216 > "$OUT/bench_p8.log" 2>&1
stamp "bench P = 8 rc=$?"
timeout 60 python3 benchmarks/bench_p2p.py --world-sizes 2 --min-bytes 1048576 --max-bytes 268435456 --factor 16 \
  --warmup 2 --iters 5 --graph-reps 5 --stages fused --bits 4 --pingpong 0 --tile-sweep-bytes 0 --rotation none \
  --check-max-bytes 1048576 > "$OUT/bench_norot.log" 2>&1
stamp "bench without rotation rc=$?"
stop_mps
grep -h "^|" "$OUT/bench.log" "$OUT/bench_p8.log" "$OUT/bench_norot.log" | head -150
tail -12 "$ECHO_P2P_LOG"
(cd "$OUT" && tar czf misc.tgz env.txt build.log p2p_log.txt && rm -f env.txt build.log p2p_log.txt)  # at most 8 files
stamp "end"
