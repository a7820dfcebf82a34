#!/bin/bash
# Kernel variants side by side in one GPU session: each variant is the same csrc/ built with extra nvcc
# flags (ECHO_DS_NVCC_EXTRA) into its own extension directory, then timed by bench_kernels.py --only.
#
#   OUT=/some/dir VARIANTS="chunk8:-DECHO_CHUNK_ELEMS=8 minblocks5:-DECHO_MIN_BLOCKS_PER_SM=5" \
#       bash benchmarks/gpu_kernel_variants.sh
#
# Runs benchmarks/gpu_kernels.sh first (the shipped build: tests + full table), building the variants in
# the background meanwhile. Writes $OUT/variants.log besides gpu_kernels.sh's files. VARIANT_TESTS=1 also
# runs tests/test_kernels_gpu.py against each variant's build (a variant that is not bit-exact is no
# candidate). VARIANT_ONLY=1 skips gpu_kernels.sh (and DeepSpeed's build and the full table, about two
# minutes) and builds the variants side by side; name the shipped build as a variant with no flags to
# compare against it in the same call:
#
#   OUT=/some/dir VARIANT_ONLY=1 VARIANTS="base: items1:-DECHO_ENTRY_ITEMS=1" bash benchmarks/gpu_kernel_variants.sh
set -u
OUT=${OUT:-/tmp/echo_out}
mkdir -p "$OUT"
ROWS=${VARIANT_ROWS:-copy,entry,entry+comp,entry+rot,owner_reduce,dequantize,dequantize+rot}
source benchmarks/gpu_env.sh

build_one() {  # name, flags
  ( export TORCH_EXTENSIONS_DIR=/tmp/ext_$1 ECHO_DS_NVCC_EXTRA="$2" MAX_JOBS=6 DS_NVCC_THREADS=2
    python3 -c "import echo_ds.ops as E; E.load()" > /tmp/build_$1.log 2>&1; echo "rc=$?" >> /tmp/build_$1.log )
}
build_variants() {  # one after the other, beside gpu_kernels.sh; side by side with VARIANT_ONLY=1
  for v in ${VARIANTS:-}; do
    name=${v%%:*}; flags=${v#*:}; flags=${flags//,/ }
    if [ "${VARIANT_ONLY:-0}" = 1 ]; then build_one "$name" "$flags" & else build_one "$name" "$flags"; fi
  done
  wait
}
if [ "${VARIANT_ONLY:-0}" = 1 ]; then
  build_variants
else
  # The shipped build first (its own cold build is timed undisturbed), then the variants in the background.
  ( sleep 45; build_variants ) &
  vb=$!
  OUT=$OUT bash benchmarks/gpu_kernels.sh
  wait $vb
fi
for v in ${VARIANTS:-}; do
  name=${v%%:*}; flags=${v#*:}; flags=${flags//,/ }
  echo "=== variant $name ($flags): $(tail -1 /tmp/build_$name.log)" | tee -a "$OUT/variants.log"
  if [ "${VARIANT_TESTS:-0}" = 1 ]; then
    TORCH_EXTENSIONS_DIR=/tmp/ext_$name ECHO_DS_NVCC_EXTRA="$flags" timeout 200 python3 -m pytest \
      tests/test_kernels_gpu.py -q -rfE -p no:cacheprovider 2>&1 | tail -3 | tee -a "$OUT/variants.log"
  fi
  TORCH_EXTENSIONS_DIR=/tmp/ext_$name ECHO_DS_NVCC_EXTRA="$flags" timeout 200 python3 benchmarks/bench_kernels.py \
    --only "$ROWS" --min-bytes "${VARIANT_MIN:-256M}" --max-bytes 1G --factor 4 2>&1 | grep -E "MB |copy bandwidth" \
    | tee -a "$OUT/variants.log"
done
