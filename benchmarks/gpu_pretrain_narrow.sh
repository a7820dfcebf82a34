#!/bin/bash
# The pretraining comparison of docs/training.md (the 25.6M-parameter model, 920 steps) for the compensator's
# stored state (issue 34): the package defaults (rotation hadamard, residual local) with the state as bf16
# (echo4-defaults-bf16) and as int4 (echo4-defaults-int4; since 2026-12-06 the defaults' own, echo4-defaults,
# which the run of that day used as its bf16 arm), against no compensation (4bit-nocomp-defaults) and the
# 16-bit baseline, in one process with one worker per run, same data order and steps. The runs use the
# emulator on the GPU (the numerics of the kernels; no extension build).
#
#   OUT=/some/dir bash benchmarks/gpu_pretrain_narrow.sh      (needs the corpus in .data/shakespeare)
# Writes to $OUT: pretrain_narrow.{json,png,log}, env.txt.
set -u
OUT=${OUT:-/tmp/pretrain_narrow_out}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
session_start "$OUT"
cat "$OUT/env.txt"
STEPS=${STEPS:-920}
timeout 540 python3 -m echo_ds.eval pretrain --device cuda --dtype bfloat16 --layers 4 --hidden 768 --heads 12 --kv-heads 4 \
  --intermediate 2048 --seq-len 256 --batch-size 8 --lr 1e-3 --warmup 100 --val-tokens 16384 --num-evals 16 \
  --steps $STEPS --no-progress --no-bench --runs 16bit,echo4-defaults-bf16,echo4-defaults-int4,4bit-nocomp-defaults \
  --workers 4 --json "$OUT/pretrain_narrow.json" --plot "$OUT/pretrain_narrow.png" > "$OUT/pretrain_narrow.log" 2>&1
stamp "pretraining rc=$?"
tail -30 "$OUT/pretrain_narrow.log"
