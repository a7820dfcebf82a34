#!/bin/bash
# One GPU call (2026-12-05): the constructor-check probe, the transport's one-process tests, the p2p suite
# at P = 8 (quick; TESTS="suite" adds P = 2 and 4), then the one-launch call with and without the system fence
# before each signal's release store (-DECHO_P2P_SIGNAL_FENCE=0, its own extension directory, built
# while the tests run), side by side in one bench_p2p table each, graph replay included.
#
#   OUT=/some/dir bash benchmarks/gpu_fence_p8.sh     # BENCH_ARGS overrides the benchmark's arguments
#
# Writes to $OUT: env.txt, build.log, probe.txt, test.log, p2p_log.txt, bench_{fence,nofence}.log (two rounds each,
# appended), bench_{1..4}_{fence,nofence}.json
# (the JSON and build_nofence.log packed into misc.tgz: the device returns at most 8 files).
set -u
OUT=${OUT:-/tmp/fence_p8_out}
source benchmarks/gpu_env.sh
session_start "$OUT"
cat "$OUT/env.txt"
source benchmarks/gpu_mps.sh
start_mps
stamp "MPS: $MPS"

build_ops "$OUT/build.log" 300; tail -2 "$OUT/build.log"
stamp "built"
# The variant, built beside the tests (MAX_JOBS halved so the tests keep CPUs).
NOFENCE_DIR=/tmp/torch_ext_nofence
(TORCH_EXTENSIONS_DIR=$NOFENCE_DIR ECHO_DS_NVCC_EXTRA=-DECHO_P2P_SIGNAL_FENCE=0 MAX_JOBS=8 \
  build_ops "$OUT/build_nofence.log" 300) &
VARIANT=$!

timeout 240 python3 benchmarks/ctor_check_probe.py --out "$OUT/probe.txt" > /dev/null 2>&1
echo "probe rc=$?"; head -8 "$OUT/probe.txt"
stamp "probe done"

PYTEST="python3 -m pytest -q -rfE -p no:cacheprovider -s"
{ timeout 100 $PYTEST tests/test_p2p_transport_gpu.py --timeout 90
  ECHO_P2P_QUICK=1 timeout 240 $PYTEST tests/test_p2p_gpu.py -k "${TESTS:-suite and 8}" --timeout 220
  stamp "tests done"
} 2>&1 | tee "$OUT/test.log" | grep -v "^\[.*WARNING" | tail -12

wait $VARIANT; tail -1 "$OUT/build_nofence.log"
BENCH_ARGS=${BENCH_ARGS:-"--world-sizes 2,4 --min-bytes 65536 --max-bytes 16777216 --factor 16 --warmup 3 --iters 10 --tile-sweep-bytes 0 --pingpong 0 --graph-reps 10 --stages fused"}
R=0
for V in fence nofence fence nofence; do
  R=$((R + 1))
  DIR=$([ $V = fence ] && echo "$TORCH_EXTENSIONS_DIR" || echo $NOFENCE_DIR)
  TORCH_EXTENSIONS_DIR=$DIR timeout 100 python3 benchmarks/bench_p2p.py --json "$OUT/bench_${R}_$V.json" $BENCH_ARGS \
    >> "$OUT/bench_$V.log" 2>&1
  stamp "bench $V rc=$?"
done
stop_mps
grep -h "^|" "$OUT/bench_fence.log" "$OUT/bench_nofence.log" | head -60
tail -12 "$ECHO_P2P_LOG"
(cd "$OUT" && tar czf misc.tgz env.txt build.log build_nofence.log bench_*.json && rm -f build_nofence.log bench_*.json)
stamp "end"
