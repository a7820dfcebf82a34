#!/bin/bash
# One GPU call (issues 34, 35, 31): the JIT build; the narrow compensator state's device functions against the
# reference (tests/test_state_narrow_kernels.py); a short soak of mixed p2p calls (ECHO_SOAK_CALLS, default
# 2000 per world size; the 100,000 take longer than one call may run); the DeepSpeed AutoTP mode on
# the GPU at P = 2 (16-bit against Echo over p2p: training, then inference), which runs the custom ops and
# the divergence check on the device; then bench_p2p at P = 4 to 256 MiB (the floor table's missing rows).
#
#   OUT=/some/dir bash benchmarks/gpu_verify.sh
#
# Writes to $OUT: test.log, soak.log, deepspeed.log, deepspeed.json, bench_p4.log, bench_p4.json, misc.tgz.
set -u
OUT=${OUT:-/tmp/verify_out}
source benchmarks/gpu_env.sh
session_begin "$OUT"
timeout 120 $PYTEST tests/test_state_narrow_kernels.py --timeout 110 2>&1 | tee "$OUT/test.log" | tail -4
stamp "narrow state tests done"
ECHO_SOAK_CALLS=${ECHO_SOAK_CALLS:-2000} timeout 150 $PYTEST tests/test_soak_gpu.py --timeout 140 2>&1 \
  | grep -v "^\[.*WARNING" > "$OUT/soak.log"; tail -6 "$OUT/soak.log"
stamp "soak done"
timeout 150 python3 benchmarks/deepspeed_gpu.py --tp-sizes 2 --variants 16bit,p2p --infer-variants 16bit,p2p \
  --steps 40 --warmup-steps 5 --torch-adam --timeout 140 --json "$OUT/deepspeed.json" --workdir /tmp/ds_weights \
  2>&1 | grep -v "WARNING" > "$OUT/deepspeed.log"; tail -25 "$OUT/deepspeed.log"
stamp "deepspeed done"
timeout 110 python3 benchmarks/bench_p2p.py --json "$OUT/bench_p4.json" --world-sizes 4 --min-bytes 65536 \
  --max-bytes 268435456 --factor 4 --warmup 2 --iters 5 --graph-reps 5 --stages fused,auto --bits 4 --pingpong 0 \
  --tile-sweep-bytes 0 --check-max-bytes 16777216 > "$OUT/bench_p4.log" 2>&1
stamp "bench P = 4 rc=$?"
stop_mps
grep -h "^|" "$OUT/bench_p4.log" | head -40
(cd "$OUT" && tar czf misc.tgz env.txt build.log p2p_log.txt 2>/dev/null; rm -f env.txt build.log p2p_log.txt)
stamp "end"
