#!/bin/bash
# Build + test + benchmark of the p2p transport in one GPU session (benchmarks/RESULTS.md, "P2P transport").
#
#   From the repository root of a GPU machine. Where that machine lacks deepspeed or pydantic, put
#   their wheels (for its Python) in .whl/ first: the script installs them into /tmp/site.
#   OUT=/some/dir bash benchmarks/p2p_gpu.sh
#
# Several ranks share the one GPU: MPS is started (and stopped at the end) so that their kernels, the
# spinning flag waits among them, run side by side; without it the script goes on with time-slicing.
# ECHO_P2P_QUICK=1 makes it a smoke run (see below).
# Writes to $OUT: env.txt, ops_build.log, test.log, p2p_log.txt (the suite's findings), bench.log,
# bench.json.
set -u
OUT=${OUT:-/tmp/p2p_out}
source benchmarks/gpu_env.sh
session_start "$OUT"
python3 -c "import torch, deepspeed; from cuda import bindings; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'cuda-bindings', bindings.__version__)" >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# MPS, with its own pipe directory; checked with one CUDA context before it is relied on.
source benchmarks/gpu_mps.sh
start_mps
stamp "MPS: $MPS"

# echo_ds.ops, the one extension (the transport's kernels, the Echo stages, the one-launch call).
build_ops "$OUT/ops_build.log"; tail -3 "$OUT/ops_build.log"
stamp "echo_ds.ops built"

PYTEST="python3 -m pytest -q -rfE -p no:cacheprovider -s"
# ECHO_P2P_QUICK=1: a smoke run of about a minute and a half (smaller sizes, 1,000 stress calls, one kill).
if [ -n "${ECHO_P2P_QUICK:-}" ]; then
  KILLED="killed and 2"
  BENCH_ARGS=${BENCH_ARGS:-"--world-sizes 2 --max-bytes 16777216 --factor 16 --iters 5 --tile-sweep-bytes 0 --pingpong 500"}
else
  KILLED="killed"
fi
{
  stamp "the transport's launches in one process, and the staged kernels"
  timeout 100 $PYTEST tests/test_p2p_transport_gpu.py --timeout 90
  timeout 100 $PYTEST tests/test_p2p_gpu.py -k "staged_kernels" --timeout 90
  stamp "suites P = 2, 4"
  timeout 180 $PYTEST tests/test_p2p_gpu.py -k "suite" --timeout 120
  stamp "suites done"
} 2>&1 | tee "$OUT/test.log" | grep -v "^\[.*WARNING"

BENCH_ARGS=${BENCH_ARGS:-"--warmup 2 --iters 5"}
timeout "${P2P_BENCH_TIMEOUT:-100}" python3 benchmarks/bench_p2p.py --json "$OUT/bench.json" $BENCH_ARGS 2>&1 | tee "$OUT/bench.log" | grep -v "WARNING"
stamp "bench done"

# Last: a killed rank (its teardown under MPS must not disturb the runs above).
{ timeout 60 $PYTEST tests/test_p2p_gpu.py -k "$KILLED" --timeout 50; stamp "killed-rank tests done"; } 2>&1 \
  | tee -a "$OUT/test.log" | grep -v "^\[.*WARNING"

stop_mps
echo "=== summary ==="
cat "$ECHO_P2P_LOG"
grep -h -E "passed|failed|error" "$OUT/test.log" | tail -4
stamp "end"
