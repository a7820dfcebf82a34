"""The CUDA path of echo_ds: the op builder and the kernel wrappers.

Importing this package needs no GPU. ``load()`` returns the compiled extension: the prebuilt module
``echo_ds.ops.echo_ds_ops`` when the package was installed with ``DS_BUILD_ECHO=1`` (see setup.py; no
JIT, no nvcc needed), else a JIT build (once; ``ECHO_DS_FORCE_JIT=1`` JIT-builds even with a prebuilt
module). On a machine that cannot get or run it (no CUDA build of torch, no nvcc and no prebuilt module,
no device) it raises :class:`EchoKernelsUnavailable` with what is missing, and ``available()`` says so
without raising. ``load_kind()`` says which way the module came ("prebuilt" or "jit").
"""

from __future__ import annotations

import time
from typing import Optional

from echo_ds.ops.kernels import (  # noqa: F401
    KERNEL_WORLD_SIZES,
    QUANTIZER_CODES,
    SUPPORTED_DTYPES,
    SUPPORTED_GROUP_SIZES,
    SUPPORTED_STATE_DTYPES,
    CompensatorCoefficients,
    UnsupportedStateDtype,
    SegmentTable,
    alloc_packets,
    dequantize,
    hadamard_sign_words,
    kernel_state,
    owner_reduce,
    packet_bytes,
    packet_stride,
    packet_table,
    packet_views,
    pow2_amax,
    push_quantize,
    unsupported_reason,
)


class EchoKernelsUnavailable(RuntimeError):
    """The CUDA kernels were asked for on a machine that cannot build or run them."""


_module = None
_load_seconds: Optional[float] = None
_load_kind: Optional[str] = None  # "prebuilt" | "jit"


def _builder():
    from echo_ds.ops.builder import EchoBuilder

    return EchoBuilder()


def unavailable_reason() -> Optional[str]:
    """Why the kernels cannot be built and run here (None: they can). Builds nothing."""
    import torch

    try:
        builder = _builder()
    except Exception as e:  # noqa: BLE001 - deepspeed missing or broken
        return f"the DeepSpeed op builder could not be imported ({type(e).__name__}: {e})"
    if builder.prebuilt_spec() is not None:  # an ahead-of-time build: no nvcc or sources needed
        missing = [] if torch.version.cuda else [f"a CUDA build of torch (this is torch {torch.__version__}, "
                                                 "built without CUDA)"]
    else:
        missing = builder.missing_requirements()
    if not missing and not torch.cuda.is_available():
        missing.append("a visible CUDA device (torch.cuda.is_available() is False)")
    return ("echo_ds CUDA kernels unavailable: missing " + "; ".join(missing)) if missing else None


def available() -> bool:
    return unavailable_reason() is None


def load(verbose: bool = False):
    """The compiled extension: the prebuilt module if installed (DS_BUILD_ECHO=1), else JIT-built on first
    use (then cached on disk); either way cached in this process."""
    global _module, _load_seconds, _load_kind
    if _module is not None:
        return _module
    reason = unavailable_reason()
    if reason is not None:
        raise EchoKernelsUnavailable(reason)
    builder = _builder()
    start = time.perf_counter()
    module = builder.load(verbose=verbose)  # the prebuilt module first, then DeepSpeed's JIT load
    _load_seconds = time.perf_counter() - start
    # The prebuilt module has the package's name; torch's JIT build has the bare NAME.
    _load_kind = "prebuilt" if module.__name__ == builder.absolute_name() else "jit"
    _module = module
    return _module


def load_seconds() -> Optional[float]:
    """Seconds the first load() took in this process (importing the prebuilt module, or a cold or a cached
    JIT build), None before it."""
    return _load_seconds


def load_kind() -> Optional[str]:
    """How this process's load() got the extension: "prebuilt" (installed with DS_BUILD_ECHO=1) or "jit";
    None before load()."""
    return _load_kind


def build_directory() -> str:
    """Where the JIT build lives; after load() took the prebuilt module, "prebuilt: <its file>"."""
    if _load_kind == "prebuilt":
        return f"prebuilt: {getattr(_module, '__file__', '?')}"
    from echo_ds.ops.builder import build_directory as _dir

    return _dir()
