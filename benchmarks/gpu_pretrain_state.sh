#!/bin/bash
# The pretraining comparison of docs/training.md at the shipped defaults (rotation hadamard, residual local),
# with the compensator's state stored as bf16 (the library) and as fp32 (the state format before issue 17),
# in one session and on the same data order and step count: does the narrow state move the loss gap?
# Two processes share the GPU: the 16-bit baselines and the bf16-state run (3 workers), and the fp32-state
# run alone (one worker, in-process, so that kStateDtype = fp32 reaches its compensators).
#
#   OUT=/some/dir bash benchmarks/gpu_pretrain_state.sh      (needs the corpus in .data/shakespeare)
# Writes to $OUT: pretrain_bf16.{json,png,log}, pretrain_fp32.{json,log}, env.txt.
set -u
OUT=${OUT:-/tmp/pretrain_state_out}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  git rev-parse HEAD 2>/dev/null; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
STEPS=${STEPS:-920}
COMMON="--device cuda --dtype bfloat16 --layers 4 --hidden 768 --heads 12 --kv-heads 4 --intermediate 2048
  --seq-len 256 --batch-size 8 --lr 1e-3 --warmup 100 --val-tokens 16384 --num-evals 16 --steps $STEPS
  --no-progress --no-bench"
T0=$(date +%s)
python3 -m echo_ds.eval pretrain $COMMON --runs 16bit,16bit-seed1,echo4-hadamard-local --workers 3 \
  --json "$OUT/pretrain_bf16.json" --plot "$OUT/pretrain_bf16.png" > "$OUT/pretrain_bf16.log" 2>&1 &
BF16=$!
python3 - $COMMON --runs echo4-hadamard-local --workers 1 --grad-check '' --json "$OUT/pretrain_fp32.json" \
  > "$OUT/pretrain_fp32.log" 2>&1 <<'PY' &
import sys, torch
import echo_ds.compensator as comp
comp.kStateDtype = torch.float32   # store_state and the allocation read it at call time
from echo_ds.eval.pretrain import main
sys.exit(main(sys.argv[1:]))
PY
FP32=$!
wait $BF16; echo "bf16 rc=$? after $(( $(date +%s) - T0 )) s"
wait $FP32; echo "fp32 rc=$? after $(( $(date +%s) - T0 )) s"
tail -25 "$OUT/pretrain_bf16.log"; tail -12 "$OUT/pretrain_fp32.log"
