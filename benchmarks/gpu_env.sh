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
