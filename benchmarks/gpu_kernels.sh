#!/bin/bash
# Build + test + benchmark of the Echo kernels in one GPU session (the JIT build must not be paid twice).
#
#   From the repository root of a GPU machine. Where that machine lacks deepspeed or pydantic, put
#   their wheels (for its Python) in .whl/ first: the script installs them into /tmp/site.
#   OUT=/some/dir bash benchmarks/gpu_kernels.sh        (BENCH_ARGS="..." adds bench_kernels.py options)
#
# Writes to $OUT: env.txt, build.log (cold JIT build, timed), ds_build.log (DeepSpeed's quantizer, built
# in the background meanwhile), test.log (tests/test_kernels_gpu.py), bench.log + bench.json
# (benchmarks/bench_kernels.py), sass.txt (FFMA count of the built kernels).
set -u
OUT=${OUT:-/tmp/echo_out}
mkdir -p "$OUT"
echo "TORCH_CUDA_ARCH_LIST from the image: ${TORCH_CUDA_ARCH_LIST:-unset}"
source benchmarks/gpu_env.sh
export DS_NVCC_THREADS=${DS_NVCC_THREADS:-4}

{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv;
  nvcc --version | tail -2; python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'deepspeed', deepspeed.__version__)"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# DeepSpeed's quantizer in the background (its own extension directory entry), timed.
( python3 -c "
import time; t = time.perf_counter()
from deepspeed.ops.op_builder import QuantizerBuilder
QuantizerBuilder().load(verbose=False)
print(f'DS QUANTIZER BUILD SECONDS: {time.perf_counter() - t:.1f}')" > "$OUT/ds_build.log" 2>&1; echo "rc=$?" >> "$OUT/ds_build.log" ) &
ds_pid=$!

# Cold JIT build of ours.
python3 - <<'EOF' 2>&1 | tee "$OUT/build.log"
import time, echo_ds.ops as E
t = time.perf_counter()
E.load(verbose=True)
print(f"ECHO COLD JIT BUILD SECONDS: {time.perf_counter() - t:.1f}")
print("build directory:", E.build_directory())
EOF

timeout 300 python3 -m pytest tests/test_kernels_gpu.py -q -rfE --timeout 240 -p no:cacheprovider 2>&1 | tee "$OUT/test.log" | tail -40

wait $ds_pid
tail -3 "$OUT/ds_build.log"

timeout 240 python3 benchmarks/bench_kernels.py --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v "^|"

so=$(ls "$TORCH_EXTENSIONS_DIR"/echo_ds_ops/*.so 2>/dev/null | head -1)
if [ -n "$so" ] && command -v cuobjdump >/dev/null; then
  cuobjdump --dump-sass "$so" > /tmp/sass.txt 2>&1
  { echo "FFMA instructions in $so: $(grep -c FFMA /tmp/sass.txt)"; echo "HFMA2: $(grep -c HFMA /tmp/sass.txt)";
    echo "kernels: $(grep -c 'Function :' /tmp/sass.txt)"; } | tee "$OUT/sass.txt"
fi
grep -h "passed\|failed" "$OUT/test.log" | tail -2
