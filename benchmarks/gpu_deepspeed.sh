#!/bin/bash
# The DeepSpeed path on one GPU, in one session: examples/train.py's model trained with AutoTP at P = 2 and 4
# (16-bit, Echo 4-bit over "reference", Echo 4-bit over "p2p"), then AutoTP inference of the trained weights
# against 16-bit (benchmarks/deepspeed_gpu.py says what is measured). All ranks share the GPU under MPS,
# over gloo. Builds first, in parallel: echo_ds.ops (JIT, ~40 s cold), DeepSpeed's FusedAdam.
#
#   OUT=/some/dir bash benchmarks/gpu_deepspeed.sh
#   DRIVER_ARGS="..." adds driver arguments (e.g. "--steps 100 --tp-sizes 2"); BUDGET=450 is the whole
#   script's limit in seconds (the driver gets what the builds left, and stops a set of ranks in time).
# Writes to $OUT: env.txt, ops_build.log, fused_adam_build.log, p2p_log.txt, deepspeed.log (everything the
# ranks print), deepspeed.json (the report, rewritten after every run), tables.md.
set -u
OUT=${OUT:-/tmp/deepspeed_out}
BUDGET=${BUDGET:-450}
source benchmarks/gpu_env.sh
session_start "$OUT"
python3 -c "import torch, deepspeed, transformers; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, \
'transformers', transformers.__version__)" >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

source benchmarks/gpu_mps.sh
start_mps
export ECHO_DS_MPS=$MPS  # recorded in the report
stamp "MPS: $MPS"

# The three builds side by side; each log ends with its exit status.
build_ops "$OUT/ops_build.log" 240 &
( timeout 240 python3 -c "
import time; t = time.perf_counter()
from deepspeed.ops.op_builder import FusedAdamBuilder
FusedAdamBuilder().load()
print(f'FusedAdam JIT build + load: {time.perf_counter() - t:.1f} s')" > "$OUT/fused_adam_build.log" 2>&1
  echo "rc=$?" >> "$OUT/fused_adam_build.log" ) &
wait
tail -n 2 "$OUT/ops_build.log" "$OUT/fused_adam_build.log"
ADAM=""
grep -q "^rc=0" "$OUT/fused_adam_build.log" || { ADAM="--torch-adam"; echo "FusedAdam did not build: torch's AdamW instead"; }
stamp "built"

# The driver gets what the builds left; it stops a set of ranks 20 s before the hard limit to report.
LEFT=$(( BUDGET - ($(date +%s) - T0) ))
: > "$OUT/deepspeed.log"
timeout "$LEFT" python3 benchmarks/deepspeed_gpu.py --json "$OUT/deepspeed.json" --workdir "$OUT/weights" \
  --time-budget $(( LEFT - 20 )) $ADAM ${DRIVER_ARGS:-} >> "$OUT/deepspeed.log" 2>&1 &
DRIVER=$!
# Progress: the driver's own lines (its ranks' output stays in deepspeed.log).
tail -n +1 -f --pid=$DRIVER "$OUT/deepspeed.log" | grep --line-buffered "^\[driver\]"
wait $DRIVER
RC=$?
echo "driver rc=$RC$([ "$RC" = 124 ] && echo ': killed at the time limit')"
stamp "driver done"

stop_mps
echo "=== summary ==="
python3 benchmarks/deepspeed_gpu.py --tables-from "$OUT/deepspeed.json" | tee "$OUT/tables.md"
cat "$ECHO_P2P_LOG"
stamp "end"
