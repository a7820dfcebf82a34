"""The CUDA path of echo_ds: the op builder and the kernel wrappers.

Importing this package needs no GPU. ``load()`` builds (once) and returns the compiled extension; on a
machine without a CUDA build of torch or without nvcc it raises :class:`EchoKernelsUnavailable` with
what is missing, and ``available()`` says so without raising.
"""

from __future__ import annotations

import time
from typing import Optional

from echo_ds.ops.kernels import (  # noqa: F401
    POLICY_CODES,
    SUPPORTED_DTYPES,
    SUPPORTED_GROUP_SIZES,
    SUPPORTED_WORLD_SIZES,
    CompensatorCoefficients,
    SegmentTable,
    alloc_packets,
    dequantize,
    hadamard_sign_words,
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
    missing = builder.missing_requirements()
    if not missing and not torch.cuda.is_available():
        missing.append("a visible CUDA device (torch.cuda.is_available() is False)")
    return ("echo_ds CUDA kernels unavailable: missing " + "; ".join(missing)) if missing else None


def available() -> bool:
    return unavailable_reason() is None


def load(verbose: bool = False):
    """The compiled extension (JIT-built on first use, then cached in this process and on disk)."""
    global _module, _load_seconds
    if _module is not None:
        return _module
    reason = unavailable_reason()
    if reason is not None:
        raise EchoKernelsUnavailable(reason)
    start = time.perf_counter()
    _module = _builder().load(verbose=verbose)
    _load_seconds = time.perf_counter() - start
    return _module


def load_seconds() -> Optional[float]:
    """Seconds the first load() took in this process (a cold or a cached build), None before it."""
    return _load_seconds


def build_directory() -> str:
    from echo_ds.ops.builder import build_directory as _dir

    return _dir()
