# The environment every GPU script of benchmarks/ starts from; source it from the repository root.
# Where .whl/ holds wheels (deepspeed, pydantic: the GPU image lacks them) they go to /tmp/site first.
# Then the repository on PYTHONPATH, one extension cache, sm_90 builds, NVLink multicast off.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_ext}
export TORCH_CUDA_ARCH_LIST=9.0  # DeepSpeed's parser rejects forms such as 9.0a
export MAX_JOBS=${MAX_JOBS:-16}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# For the session scripts: stamp MSG (seconds since gpu_env.sh was sourced); session_start DIR (DIR made,
# the p2p log there emptied, the machine in DIR/env.txt); build_ops LOG [LIMIT_S] (the timed build and
# load of echo_ds.ops, cold on a fresh machine; LOG ends with the exit status).
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
session_start() {
  mkdir -p "$1"
  export ECHO_P2P_LOG=$1/p2p_log.txt
  : > "$ECHO_P2P_LOG"
  { date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvcc --version | tail -1; } > "$1/env.txt" 2>&1
}
build_ops() {
  timeout "${2:-400}" python3 -c "
import time; t = time.perf_counter()
import echo_ds.ops as E
E.load()
print(f'echo_ds.ops cold JIT build + load: {time.perf_counter() - t:.1f} s')" > "$1" 2>&1
  echo "rc=$?" >> "$1"
}

# The usual start of a session script: session_start DIR, the machine printed, MPS started (gpu_mps.sh;
# ECHO_DS_MPS records whether it runs), the extension built (DIR/build.log, its tail printed). PYTEST: the
# scripts' pytest command line.
session_begin() {
  session_start "$1"
  cat "$1/env.txt"
  source benchmarks/gpu_mps.sh
  start_mps
  export ECHO_DS_MPS=$MPS
  stamp "MPS: $MPS"
  build_ops "$1/build.log" 300; tail -2 "$1/build.log"
  stamp "built"
}
PYTEST="python3 -m pytest -q -rfE -p no:cacheprovider -s"
