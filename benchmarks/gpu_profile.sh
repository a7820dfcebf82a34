#!/bin/bash
# Nsight Compute profile of the Echo stages and DeepSpeed's quantizer kernels, in one GPU session.
#
#   From the repository root of a GPU machine (deepspeed/pydantic wheels in .whl/ where missing).
#   OUT=/some/dir PROFILE_BYTES=256M bash benchmarks/gpu_profile.sh
#
# Writes to $OUT: build.log, details.txt (every profiled kernel, --set full, in the launch order that
# profile.log prints), source_<kernel>.csv (SASS with per-instruction stall samples of the first
# launch of each named kernel), profile.log. ncu runs with --clock-control none (clocks left alone).
set -u
OUT=${OUT:-/tmp/echo_prof}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh

# Build both extensions outside the profiler (ncu would otherwise wait on nvcc under its own hooks).
python3 -c "
import time; t = time.perf_counter()
import echo_ds.ops as E; E.load()
print(f'echo build {time.perf_counter() - t:.1f} s')
from deepspeed.ops.op_builder import QuantizerBuilder; QuantizerBuilder().load(verbose=False)
print(f'both built {time.perf_counter() - t:.1f} s')" 2>&1 | tee "$OUT/build.log" | tail -3

ncu --clock-control none --nvtx --nvtx-include "echo_profile/" --set full --import-source no \
    -f -o /tmp/prof python3 benchmarks/profile_kernels.py --bytes "${PROFILE_BYTES:-256M}" ${PROFILE_ARGS:-} \
    > "$OUT/profile.log" 2>&1
echo "ncu rc=$?"; grep -v "^==PROF==" "$OUT/profile.log" | tail -5
ncu -i /tmp/prof.ncu-rep --page details > "$OUT/details.txt" 2>&1
for k in ${PROFILE_SOURCE_KERNELS:-push_quantize_kernel dequantize_kernel}; do
  ncu -i /tmp/prof.ncu-rep --page source --print-source sass --csv -k "regex:$k" --launch-count 1 \
    > "$OUT/source_$k.csv" 2>&1 || echo "source page of $k failed"
done
ls -la "$OUT"
