"""DeepSpeed op builder of the Echo CUDA kernels (csrc/; in an installed package echo_ds/_csrc/).

Two ways to get the extension, as for DeepSpeed's own ops:

* Ahead of time: ``DS_BUILD_ECHO=1 pip install --no-build-isolation .`` (a CUDA build of torch, nvcc and
  deepspeed installed first; pip's isolated build environment has none of them) makes setup.py add
  ``EchoBuilder().builder()``, a ``CUDAExtension`` named ``absolute_name()`` = ``echo_ds.ops.echo_ds_ops``,
  built by torch's ``BuildExtension`` into the package (``echo_ds/ops/echo_ds_ops.*.so``). setup.py fails
  with the missing requirement rather than install without it. Without the variable (or with any value but
  ``1``) the package has no compiled module and installs without torch, as before.
* Just in time: ``EchoBuilder().load()`` first imports that prebuilt module (``ECHO_DS_FORCE_JIT=1`` skips
  it; one that is installed but fails to import, e.g. built against another torch, gives one warning with
  the reason); without one it JIT-compiles the extension once per build directory (torch's extension cache,
  ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``). Either way once per process (DeepSpeed's
  loaded-op cache). Both builds take the same flags (``builder()`` adds what DeepSpeed's ``jit_load`` adds).

Numerics: the kernels reproduce the reference bit for bit, so this builder does NOT take DeepSpeed's
default nvcc flags, which include ``--use_fast_math`` (approximate division, flush-to-zero, contraction
into FMA). It passes ``-fmad=false --ftz=false --prec-div=true --prec-sqrt=true`` instead.

Kernel experiments: ``ECHO_DS_NVCC_EXTRA`` appends flags to nvcc (e.g. ``-DECHO_CHUNK_ELEMS=4``, see
csrc/echo_device.cuh); give each variant its own ``TORCH_EXTENSIONS_DIR``.

Targets: sm_90 by default (the H100/H200 this project runs on); ``TORCH_CUDA_ARCH_LIST`` adds others,
e.g. ``TORCH_CUDA_ARCH_LIST="8.0;9.0"``. Architectures before sm_80 are dropped (bf16 conversions).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shutil
import warnings
from pathlib import Path

from deepspeed.ops.op_builder.builder import CUDAOpBuilder

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # echo_ds/


def kernel_sources_dir() -> Path:
    """Where the CUDA sources are.

    An installed package (wheel, ``pip install .``) carries them as ``echo_ds/_csrc/`` (setup.py's build_py
    copies the repository's csrc/ there, as DeepSpeed ships its csrc); an editable install or a checkout on
    sys.path has no copy and uses the checkout's top-level ``csrc/``. When neither exists the checkout path
    is returned, and ``missing_requirements`` names the files.
    """
    shipped = _PACKAGE_DIR / "_csrc"
    if shipped.is_dir():
        return shipped
    return _PACKAGE_DIR.parent / "csrc"


CSRC_DIR = kernel_sources_dir()

# One translation unit per stage, the p2p transport's (its one-launch kernels: one per dtype and world size),
# plus the torch binding.
SOURCES = (
    "push_quantize.cu",
    "owner_reduce.cu",
    *(f"owner_reduce_{dtype}.cu" for dtype in ("f32", "f16", "bf16")),
    "owner_reduce_uncompensated.cu",
    "dequantize.cu",
    "pow2_amax.cu",
    "p2p_all_reduce.cu",
    *(f"p2p_all_reduce_{dtype}_p{world}.cu" for dtype in ("f32", "f16", "bf16") for world in (2, 4, 8)),
    *(f"p2p_one_shot_{dtype}_p{world}.cu" for dtype in ("f16", "bf16") for world in (2, 4)),
    "p2p_transport.cu",
    "echo_binding.cpp",
)
HEADERS = ("echo_api.cuh", "echo_check.cuh", "echo_device.cuh", "echo_quantizer.cuh", "echo_rotation.cuh",
           "echo_compensator.cuh", "echo_contribution.cuh", "echo_rescale.cuh", "owner_reduce.cuh",
           "p2p_all_reduce.cuh", "echo_sync.cuh", "echo_p2p.h")

DEFAULT_ARCH_LIST = "9.0"
MIN_COMPUTE_CAPABILITY = (8, 0)

# ECHO_DS_FORCE_JIT=1: load() ignores a prebuilt module (development: JIT-build the checkout's sources).
FORCE_JIT_VAR = "ECHO_DS_FORCE_JIT"

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
        """The prebuilt (ahead-of-time) module's full name: echo_ds/ops/echo_ds_ops.*.so of the package."""
        return f"echo_ds.ops.{self.NAME}"

    def prebuilt_spec(self):
        """The import spec of the prebuilt module, None when none is installed or ``ECHO_DS_FORCE_JIT=1``.

        Finds the file without loading it (its package echo_ds.ops is imported, not the extension)."""
        if os.environ.get(FORCE_JIT_VAR) == "1":
            return None
        try:
            return importlib.util.find_spec(self.absolute_name())
        except (ImportError, ValueError):
            return None

    def load_prebuilt(self):
        """The prebuilt module, or None: none installed, ``ECHO_DS_FORCE_JIT=1``, or it failed to import
        (then one warning names the reason and the file, and the caller JIT-builds instead)."""
        if os.environ.get(FORCE_JIT_VAR) == "1":
            return None
        name = self.absolute_name()
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                return None  # no ahead-of-time build installed: JIT, as without DS_BUILD_ECHO
            reason = e
        except Exception as e:  # noqa: BLE001 - ABI or torch mismatch, missing CUDA library, ...
            reason = e
        spec = self.prebuilt_spec()
        where = spec.origin if spec is not None else name
        warnings.warn(f"{self.NAME}: the prebuilt extension {where} failed to import "
                      f"({type(reason).__name__}: {reason}); JIT-building it instead", RuntimeWarning, stacklevel=2)
        return None

    def load(self, verbose=False):
        """The extension: this process's, else the prebuilt module, else a JIT build (DeepSpeed's load)."""
        if self.name in self._loaded_ops:
            return self._loaded_ops[self.name]
        module = self.load_prebuilt()
        if module is None:
            return super().load(verbose=verbose)  # not in deepspeed's installed_ops: jit_load
        self._loaded_ops[self.name] = module
        return module

    def builder(self):
        """The ahead-of-time CUDAExtension (setup.py with DS_BUILD_ECHO=1): DeepSpeed's, with the flags that
        DeepSpeed's jit_load adds to a JIT build, so that both builds compile the same code; and ``-g0`` for
        the binding, as in a JIT build (setuptools adds Python's CFLAGS, ``-g -O2 ...``; on the H200 machine
        debug info made the binding's compile 40 s instead of 32 s and the library 22 MB instead of 12 MB)."""
        ext = super().builder()
        if not self.build_for_cpu:
            ext.extra_compile_args["cxx"] += ["-UC10_USE_GLOG", "-g0"]
            ext.extra_compile_args["nvcc"].append("-UC10_USE_GLOG")
            if self.enable_bf16:
                ext.extra_compile_args["nvcc"] += ["-U__CUDA_NO_BFLOAT16_OPERATORS__",
                                                   "-U__CUDA_NO_BFLOAT162_OPERATORS__",
                                                   "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"]
        return ext

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
