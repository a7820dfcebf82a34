#!/bin/bash
# One GPU call for the kernels: build + GPU tests + the full table (gpu_kernels.sh), then an Nsight
# Compute profile of the stages (gpu_profile.sh), then (P2P_QUICK=1) the p2p smoke suite
# (ECHO_P2P_QUICK=1 p2p_gpu.sh), everything packed into $OUT/session.tgz (the device returns at most 8
# files) and the summary lines printed.
#
#   OUT=/some/dir [P2P_QUICK=1] bash benchmarks/gpu_session.sh   # BENCH_ARGS, PROFILE_BYTES, PROFILE_ARGS pass through
#
# About 5 minutes on a started H200 (build 30-50 s, DeepSpeed's quantizer 60-80 s beside it, tests 10 s,
# table ~90 s, profile ~60 s), 7-8 with the p2p smoke suite (~140 s, MPS start and stop included).
set -u
OUT=${OUT:-/tmp/echo_session}
mkdir -p "$OUT/kernels" "$OUT/profile"
OUT=$OUT/kernels bash benchmarks/gpu_kernels.sh > "$OUT/kernels/run.log" 2>&1
grep -hE "BUILD SECONDS|passed|failed|copy bandwidth|fused compensator" "$OUT/kernels/run.log"
grep -h "^| 1024 MB" "$OUT/kernels/bench.log" 2>/dev/null
PROFILE_ARGS=${PROFILE_ARGS:---ops entry,entry_rot,dequantize,dequantize_rot,owner_reduce} OUT=$OUT/profile \
  timeout "${PROFILE_TIMEOUT:-240}" bash benchmarks/gpu_profile.sh > "$OUT/profile/run.log" 2>&1
echo "profile rc=$?"; tail -5 "$OUT/profile/profile.log" 2>/dev/null
parts="kernels profile"
if [ "${P2P_QUICK:-0}" = 1 ]; then
  mkdir -p "$OUT/p2p"
  ECHO_P2P_QUICK=1 OUT=$OUT/p2p timeout "${P2P_TIMEOUT:-220}" bash benchmarks/p2p_gpu.sh > "$OUT/p2p/run.log" 2>&1
  echo "p2p smoke rc=$?"; grep -hE "passed|failed|differ" "$OUT/p2p/run.log" | grep -v " 0 differ" | tail -4
  parts="$parts p2p"
fi
(cd "$OUT" && tar czf session.tgz $parts && rm -rf $parts)
ls -la "$OUT"
