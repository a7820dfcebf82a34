"""DeepSpeed op builder of the Echo CUDA kernels (csrc/; in an installed package echo_ds/_csrc/).

``EchoBuilder().load()`` JIT-compiles the extension once per build directory (torch's extension cache,
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``) and once per process (DeepSpeed's loaded-op
cache); ``DS_BUILD_ECHO=1`` at install time selects it for an ahead-of-time build like DeepSpeed's own ops.

Numerics: the kernels reproduce the reference bit for bit, so this builder does NOT take DeepSpeed's
default nvcc flags, which include ``--use_fast_math`` (approximate division, flush-to-zero, contraction
into FMA). It passes ``-fmad=false --ftz=false --prec-div=true --prec-sqrt=true`` instead.

Kernel experiments: ``ECHO_DS_NVCC_EXTRA`` appends flags to nvcc (e.g. ``-DECHO_CHUNK_ELEMS=4``, see
csrc/echo_common.cuh); give each variant its own ``TORCH_EXTENSIONS_DIR``.

Targets: sm_90 by default (the H100/H200 this project runs on); ``TORCH_CUDA_ARCH_LIST`` adds others,
e.g. ``TORCH_CUDA_ARCH_LIST="8.0;9.0"``. Architectures before sm_80 are dropped (bf16 conversions).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from deepspeed.ops.op_builder.builder import CUDAOpBuilder

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # echo_ds/


def kernel_sources_dir() -> Path:
    """Where the CUDA sources are (the root: this builder's files, and p2p/ for the transport's).

    An installed package (wheel, ``pip install .``) carries them as ``echo_ds/_csrc/`` (setup.py's build_py
    copies the repository's csrc/ there, as DeepSpeed ships its csrc); an editable install or a checkout on
    sys.path has no copy and uses the checkout's top-level ``csrc/``. Both builders take their paths from
    here. When neither exists the checkout path is returned, and ``missing_requirements`` names the files.
    """
    shipped = _PACKAGE_DIR / "_csrc"
    if shipped.is_dir():
        return shipped
    return _PACKAGE_DIR.parent / "csrc"


CSRC_DIR = kernel_sources_dir()

# One translation unit per stage, plus the torch binding.
SOURCES = (
    "push_quantize.cu",
    "owner_reduce.cu",
    "owner_reduce_plain.cu",
    "dequantize.cu",
    "pow2_amax.cu",
    "echo_binding.cpp",
)
HEADERS = ("echo_api.cuh", "echo_check.cuh", "echo_common.cuh", "owner_reduce.cuh")

DEFAULT_ARCH_LIST = "9.0"
MIN_COMPUTE_CAPABILITY = (8, 0)

# Numerics flags; see the module docstring.
EXACT_FP_NVCC_FLAGS = ["-fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true"]


def cxx_std() -> str:
    import torch

    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return "-std=c++20" if (major, minor) >= (2, 12) else "-std=c++17"


def find_nvcc():
    """Path of nvcc (CUDA_HOME/bin/nvcc, else the PATH), or None."""
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:  # noqa: BLE001 - a broken torch install: no CUDA toolchain either
        CUDA_HOME = None
    if CUDA_HOME:
        candidate = os.path.join(CUDA_HOME, "bin", "nvcc")
        if os.path.exists(candidate):
            return candidate
    return shutil.which("nvcc")


class EchoBuilder(CUDAOpBuilder):
    BUILD_VAR = "DS_BUILD_ECHO"
    NAME = "echo_ds_ops"

    def __init__(self, name=None):
        super().__init__(name=self.NAME if name is None else name)

    def absolute_name(self):
        return f"echo_ds.ops.{self.NAME}"

    def sources(self):
        return [str(CSRC_DIR / s) for s in SOURCES]

    def include_paths(self):
        return [str(CSRC_DIR)]

    def missing_requirements(self) -> list:
        """What this machine lacks to build the kernels (empty: nothing)."""
        import torch

        missing = []
        if torch.version.cuda is None:
            missing.append(f"a CUDA build of torch (this is torch {torch.__version__}, built without CUDA)")
        if find_nvcc() is None:
            missing.append("nvcc (set CUDA_HOME or put the CUDA toolkit's bin/ on PATH)")
        for name in SOURCES + HEADERS:
            if not (CSRC_DIR / name).exists():
                missing.append(f"the kernel source {CSRC_DIR / name}")
        return missing

    def is_compatible(self, verbose=False):
        missing = self.missing_requirements()
        if missing:
            self.error_log = f"{self.NAME} cannot be built: missing " + "; ".join(missing)
            if verbose:
                self.warning(self.error_log)
            return False
        return super().is_compatible(verbose)

    def filter_ccs(self, ccs):
        """["8.0", "9.0+PTX", ...] -> [["9", "0+PTX"], ...], dropping those below sm_80."""
        kept, pruned = [], []
        for cc in ccs:
            major, minor = cc.split(".")
            ok = (int(major), int(minor.split("+")[0])) >= MIN_COMPUTE_CAPABILITY
            (kept if ok else pruned).append([major, minor])
        if pruned:
            self.warning(f"{self.NAME}: dropping compute capabilities {['.'.join(c) for c in pruned]} "
                         f"(needs >= {'.'.join(map(str, MIN_COMPUTE_CAPABILITY))})")
        return kept

    def compute_capability_args(self, cross_compile_archs=None):
        # Ahead-of-time builds without TORCH_CUDA_ARCH_LIST target sm_90, not DeepSpeed's default list
        # (which stops at 7.0 for CUDA 13 and would leave nothing after filter_ccs).
        if cross_compile_archs is None and not self.jit_mode:
            cross_compile_archs = DEFAULT_ARCH_LIST
        # DeepSpeed's parser takes X.Y[+PTX] only; an arch-specific form such as "9.0a" becomes "9.0".
        for attr in ("_jit_arch_list",):
            if getattr(self, attr, None):
                setattr(self, attr, re.sub(r"(\d+\.\d+)[af]", r"\1", getattr(self, attr)))
        env = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if env:
            os.environ["TORCH_CUDA_ARCH_LIST"] = re.sub(r"(\d+\.\d+)[af]", r"\1", env)
        return super().compute_capability_args(cross_compile_archs)

    def cxx_args(self):
        return ["-O3", cxx_std(), "-Wno-reorder"]

    def nvcc_args(self):
        if self.build_for_cpu:
            return []
        threads = os.environ.get("DS_NVCC_THREADS", str(min(os.cpu_count() or 1, 8)))
        return ["-O3", cxx_std(), *EXACT_FP_NVCC_FLAGS, "-U__CUDA_NO_HALF_OPERATORS__",
                "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", f"--threads={threads}",
                *self.compute_capability_args(), *os.environ.get("ECHO_DS_NVCC_EXTRA", "").split()]


def build_directory() -> str:
    """Where torch's JIT build of the extension lives (reused by later processes)."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(EchoBuilder.NAME, verbose=False)
