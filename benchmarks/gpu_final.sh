#!/bin/bash
# One GPU call (issues 31, 32, 35): the JIT build; the p2p suites at P = 2 and 4 in their quick form (the
# buffer as its group's backend of the custom op, every state format, chunks, the 16-bit call);
# the dependency check where torch is a CUDA build; the DeepSpeed mode over p2p with messages above 16 MiB
# (the staged pipeline and its on-device site check; a 4-layer model 1024 wide, sequences of 1024); then
# the soak at P = 2 and 4 (ECHO_SOAK_CALLS per world size, default 20000). SKIP_SUITES=1 leaves out the
# suites and the dependency check; SOAK_K=" and 4" runs the soak at P = 4 only.
#
#   OUT=/some/dir bash benchmarks/gpu_final.sh
#
# Writes to $OUT: test.log, deepspeed.log, deepspeed.json, soak.log, misc.tgz.
set -u
OUT=${OUT:-/tmp/final_out}
source benchmarks/gpu_env.sh
session_begin "$OUT"
{ [ -n "${SKIP_SUITES:-}" ] || ECHO_P2P_QUICK=1 timeout 150 $PYTEST tests/test_p2p_gpu.py -k "test_gpu_suite and not 8" --timeout 140
  [ -n "${SKIP_SUITES:-}" ] || timeout 60 $PYTEST tests/test_dependencies.py --timeout 50
} 2>&1 | grep -v "^\[.*WARNING" > "$OUT/test.log"; grep -E "passed|failed|registered|format|Error" "$OUT/test.log" | tail -8
stamp "tests done"
timeout 150 python3 benchmarks/deepspeed_gpu.py --tp-sizes 2 --variants p2p --infer-variants '' --steps 15 \
  --warmup-steps 3 --torch-adam --timeout 140 --json "$OUT/deepspeed.json" \
  --workdir /tmp/ds_weights --model-args "--n_embd 1024 --n_head 8 --n_kv_head 4 --intermediate 2752 --seq_len 1024 --eval_batches 1" \
  2>&1 | grep -v "WARNING" > "$OUT/deepspeed.log"; grep -E "^\[driver\]|^\| 2 " "$OUT/deepspeed.log" | tail -8
stamp "deepspeed done"
ECHO_SOAK_CALLS=${ECHO_SOAK_CALLS:-20000} timeout 280 $PYTEST tests/test_soak_gpu.py -k "zero_mismatches${SOAK_K:-}" --timeout 270 \
  2>&1 | grep -v "^\[.*WARNING" > "$OUT/soak.log"; grep -E "soak|passed|failed|Error" "$OUT/soak.log" | tail -6
stamp "soak done"
stop_mps
(cd "$OUT" && tar czf misc.tgz env.txt build.log p2p_log.txt 2>/dev/null; rm -f env.txt build.log p2p_log.txt)
stamp "end"
