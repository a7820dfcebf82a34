#!/bin/bash
# One GPU call for the kernels: build + GPU tests + the full table (gpu_kernels.sh), then an Nsight
# Compute profile of the stages (gpu_profile.sh), everything packed into $OUT/session.tgz (the device
# returns at most 8 files) and the summary lines printed.
#
#   OUT=/some/dir bash benchmarks/gpu_session.sh          # BENCH_ARGS, PROFILE_BYTES, PROFILE_ARGS pass through
#
# About 4 minutes on a started H200 (build 23 s, DeepSpeed's quantizer 61 s beside it, tests 9 s, table
# ~90 s, profile ~60 s).
set -u
OUT=${OUT:-/tmp/echo_session}
mkdir -p "$OUT/kernels" "$OUT/profile"
OUT=$OUT/kernels bash benchmarks/gpu_kernels.sh > "$OUT/kernels/run.log" 2>&1
grep -hE "BUILD SECONDS|passed|failed|copy bandwidth|fused compensator" "$OUT/kernels/run.log"
grep -h "^| 1024 MB" "$OUT/kernels/bench.log" 2>/dev/null
PROFILE_ARGS=${PROFILE_ARGS:---ops entry,entry_rot,dequantize,dequantize_rot,owner_reduce} OUT=$OUT/profile \
  timeout "${PROFILE_TIMEOUT:-240}" bash benchmarks/gpu_profile.sh > "$OUT/profile/run.log" 2>&1
echo "profile rc=$?"; tail -5 "$OUT/profile/profile.log" 2>/dev/null
(cd "$OUT" && tar czf session.tgz kernels profile && rm -rf kernels profile)
ls -la "$OUT"
