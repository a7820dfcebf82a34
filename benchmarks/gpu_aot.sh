#!/bin/bash
# The ahead-of-time build (DS_BUILD_ECHO=1) on a GPU machine: install with the variable, then load and run
# the GPU kernel tests from the installed copy with an empty extension cache (no JIT may happen).
#
#   From the repository root of a GPU machine (deepspeed/pydantic wheels in .whl/ as for gpu_kernels.sh):
#   OUT=/some/dir bash benchmarks/gpu_aot.sh        (AOT_TARGET=/tmp/aot: where the package is installed)
#
# 1. Copies the packaging inputs to a scratch directory (the in-tree build's build/ stays out of the
#    repository) and times `DS_BUILD_ECHO=1 pip install --no-deps --no-build-isolation --target $AOT_TARGET`
#    (a cold build: nothing is reused): prints AOT INSTALL SECONDS, checks the .so is in the package.
# 2. From a directory without echo_ds, with $AOT_TARGET first on PYTHONPATH (gpu_env.sh puts the repository
#    there, which would shadow it) and TORCH_EXTENSIONS_DIR a new empty directory: times the first
#    `import echo_ds.ops as E; E.load()` (AOT FIRST LOAD SECONDS; the import of torch/deepspeed included,
#    load() alone beside it), asserts it came from $AOT_TARGET, load_kind() == "prebuilt", the cache is empty.
# 3. Runs tests/test_kernels_gpu.py -x in one process from there, then asserts the same again.
# Writes $OUT/aot_install.log, $OUT/aot_load.log, $OUT/aot_test.log. About 1-2 minutes on 16 cores.
set -u
OUT=${OUT:-/tmp/echo_aot}
mkdir -p "$OUT"
REPO=$PWD
source benchmarks/gpu_env.sh
export DS_NVCC_THREADS=${DS_NVCC_THREADS:-4}
export AOT=${AOT_TARGET:-/tmp/aot}
rm -rf "$AOT"
SRC=$(mktemp -d /tmp/echo_aot_src.XXXXXX)
EXT=$(mktemp -d /tmp/echo_aot_ext.XXXXXX)   # the extension cache: must stay empty
RUN=$(mktemp -d /tmp/echo_aot_run.XXXXXX)   # working directory without echo_ds in it
tar -C "$REPO" --exclude=__pycache__ --exclude='*.so' --exclude=_csrc --exclude='*.egg-info' -cf - \
  pyproject.toml setup.py MANIFEST.in README.md echo_ds csrc | tar -C "$SRC" -xf - || { echo "copy failed"; exit 1; }

python3 -c "import torch, deepspeed, setuptools; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'deepspeed', deepspeed.__version__, 'setuptools', setuptools.__version__)" 2>&1 | grep -v WARNING
echo "MAX_JOBS=$MAX_JOBS DS_NVCC_THREADS=$DS_NVCC_THREADS TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"

# 1. The install.
t0=$(date +%s.%N)
( cd "$SRC" && DS_BUILD_ECHO=1 python3 -m pip install -v --no-deps --no-build-isolation --no-index --no-cache-dir \
    --disable-pip-version-check --target "$AOT" . ) > "$OUT/aot_install.log" 2>&1
rc=$?
t1=$(date +%s.%N)
install_line="AOT INSTALL SECONDS: $(python3 -c "print(f'{$t1 - $t0:.1f}')")"
echo "$install_line (rc=$rc)"
if [ $rc -ne 0 ]; then grep -v "^\s*$" "$OUT/aot_install.log" | tail -40; exit 1; fi
ls -la "$AOT"/echo_ds/ops/echo_ds_ops*.so || { echo "FAIL: no prebuilt module in $AOT/echo_ds/ops"; exit 1; }
command -v cuobjdump >/dev/null && echo "kernels in the .so: $(cuobjdump --dump-sass "$AOT"/echo_ds/ops/echo_ds_ops*.so \
  2>/dev/null | grep -c 'Function :')"

export PYTHONPATH=$AOT:${PYTHONPATH:-}
export TORCH_EXTENSIONS_DIR=$EXT
unset ECHO_DS_FORCE_JIT
cd "$RUN" || exit 1

# 2. The first load, in a fresh process.
python3 - <<'EOF' 2>&1 | tee "$OUT/aot_load.log"
import os, time
t = time.perf_counter()
import echo_ds.ops as E
E.load()
total = time.perf_counter() - t
print(f"AOT FIRST LOAD SECONDS: {total:.2f} (import echo_ds.ops + load(); load() alone: {E.load_seconds():.3f})")
print("echo_ds.ops from:", E.__file__, "| load kind:", E.load_kind(), "| build directory:", E.build_directory())
assert E.__file__.startswith(os.environ["AOT"] + "/"), f"echo_ds imported from {E.__file__}, not the AOT install"
assert E.load_kind() == "prebuilt", E.load_kind()
left = os.listdir(os.environ["TORCH_EXTENSIONS_DIR"])
assert not left, f"the extension cache is not empty: {left}"
print("AOT LOAD CHECK: OK (prebuilt, no JIT)")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "FAIL: first load"; exit 1; }

# 3. The GPU kernel tests, in one process, then the same checks.
timeout 300 python3 - "$REPO/tests/test_kernels_gpu.py" <<'EOF' 2>&1 | tee "$OUT/aot_test.log" | tail -15
import os, sys
import pytest
rc = pytest.main(["-q", "-x", "-rfE", "-p", "no:cacheprovider", "--timeout", "240", sys.argv[1]])
import echo_ds.ops as E
print("echo_ds.ops from:", E.__file__, "| load kind:", E.load_kind())
assert E.__file__.startswith(os.environ["AOT"] + "/"), E.__file__
assert E.load_kind() == "prebuilt", E.load_kind()
left = os.listdir(os.environ["TORCH_EXTENSIONS_DIR"])
assert not left, f"the extension cache is not empty: {left}"
print("AOT TEST CHECK: OK (prebuilt, no JIT)" if rc == 0 else f"AOT TEST CHECK: pytest rc={int(rc)}")
sys.exit(int(rc))
EOF
rc=${PIPESTATUS[0]}
echo "$install_line"; grep -h "AOT FIRST LOAD SECONDS" "$OUT/aot_load.log"; grep -hE "passed|failed" "$OUT/aot_test.log" | tail -1
exit $rc
