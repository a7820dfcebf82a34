#!/bin/bash
# The "zero_aware_int" format (g = 64 in 4.25 bits per value) on one GPU, in one session: the cold build,
# the kernel tests (every quantizer bit for bit against the reference), the p2p suites (one launch and
# staged, every quantizer; ECHO_P2P_QUICK=1 by default), then the kernel table and the p2p table of the
# default configuration's passes with today's format (zero_aware, g = 128) and the new one side by side.
# Ranks share the GPU under MPS.
#
#   OUT=/some/dir bash benchmarks/gpu_int_format.sh      # FULL_SUITE=1: the full p2p suites
# Writes $OUT/run.tgz (every log and JSON) and prints the summary.
set -u
OUT=${OUT:-/tmp/int_format_out}
W=$OUT/run
source benchmarks/gpu_env.sh
session_start "$W"

build_ops "$W/ops_build.log"; tail -2 "$W/ops_build.log"
stamp "built"

PYTEST="python3 -m pytest -q -rfE -p no:cacheprovider"
timeout 400 $PYTEST tests/test_kernels_gpu.py --timeout 300 > "$W/kernels_test.log" 2>&1
stamp "kernel tests: $(tail -1 "$W/kernels_test.log")"

source benchmarks/gpu_mps.sh
start_mps
stamp "MPS: $MPS"
QUICK=$([ -n "${FULL_SUITE:-}" ] && echo "" || echo 1)
ECHO_P2P_QUICK=$QUICK ECHO_P2P_STAGES=auto timeout 360 $PYTEST -s tests/test_p2p_gpu.py -k "suite or staged" \
  --timeout 300 > "$W/p2p_test.log" 2>&1
stamp "p2p suites: $(tail -1 "$W/p2p_test.log")"

ROWS="copy,entry+comp+rot+local,owner_reduce+comp+rot+local,dequantize+rot"
ROWS="$ROWS,entry+comp+rot+local/int64,owner_reduce+comp+rot+local/int64,dequantize+rot/int64"
timeout 200 python3 benchmarks/bench_kernels.py --only "$ROWS" --min-bytes 64M --max-bytes 1G --factor 4 \
  --json "$W/bench_kernels.json" > "$W/bench_kernels.log" 2>&1
stamp "kernel table done"

for FMT in "zero_aware 128" "zero_aware_int 64"; do
  set -- $FMT
  timeout 200 python3 benchmarks/bench_p2p.py --stages fused --quantizer "$1" --group-size "$2" --pow2 auto \
    --world-sizes 2,4 --min-bytes 65536 --max-bytes 67108864 --factor 4 --warmup 3 --iters 10 \
    --tile-sweep-bytes 0 --pingpong 0 --graph-reps 10 --json "$W/bench_p2p_$1.json" > "$W/bench_p2p_$1.log" 2>&1
  stamp "p2p table $1 g=$2 done"
done
stop_mps

echo "=== summary ==="
cat "$ECHO_P2P_LOG" | tail -20
grep -hE "passed|failed" "$W/kernels_test.log" "$W/p2p_test.log" | tail -6
grep -h "^| " "$W/bench_kernels.log"
for f in "$W"/bench_p2p_*.log; do echo "--- $f"; grep -h "^|" "$f"; done
(cd "$OUT" && tar czf run.tgz run && rm -rf run)
stamp "end"
