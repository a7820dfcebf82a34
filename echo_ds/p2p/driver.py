"""The few CUDA driver calls of the p2p transport, through cuda-python (``cuda.bindings.driver``): device
queries, memory, IPC handles and the mapped error record (its kernels are launched through echo_ds.ops).

Every call's status is checked; a failure raises :class:`CudaDriverError` naming the call and the
driver's error name. The functions use the calling thread's current context, which is the primary
context of torch's current device once torch has touched it (EchoBuffer makes sure of that).
"""

from __future__ import annotations

import ctypes
from typing import Tuple

try:  # cuda-python >= 12.6
    from cuda.bindings import driver as cu
except ImportError:  # pragma: no cover - older cuda-python
    from cuda import cuda as cu  # type: ignore

kIpcHandleBytes = 64


class CudaDriverError(RuntimeError):
    pass


def _name(err) -> str:
    try:
        e, s = cu.cuGetErrorName(err)
        return s.decode() if isinstance(s, bytes) else str(s)
    except Exception:  # noqa: BLE001
        return str(err)


def check(result, what: str):
    """Unpack a cuda-python result tuple ``(err, *values)``; raise on an error."""
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaDriverError(f"{what} failed: {_name(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def init() -> None:
    check(cu.cuInit(0), "cuInit")


# ----------------------------------------------------------------------------------------------------
# Devices
# ----------------------------------------------------------------------------------------------------

def device_uuid(ordinal: int) -> str:
    dev = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
    uuid = check(cu.cuDeviceGetUuid(dev), "cuDeviceGetUuid")
    return ctypes.string_at(uuid.getPtr(), 16).hex()


def can_access_peer(ordinal: int, peer_ordinal: int) -> bool:
    if ordinal == peer_ordinal:
        return True
    dev = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
    peer = check(cu.cuDeviceGet(peer_ordinal), "cuDeviceGet")
    return bool(check(cu.cuDeviceCanAccessPeer(dev, peer), "cuDeviceCanAccessPeer"))


# ----------------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------------

def mem_alloc(num_bytes: int) -> int:
    return int(check(cu.cuMemAlloc(num_bytes), f"cuMemAlloc({num_bytes})"))


def mem_free(ptr: int) -> None:
    check(cu.cuMemFree(ptr), "cuMemFree")


def memset_u8(ptr: int, value: int, num_bytes: int) -> None:
    check(cu.cuMemsetD8(ptr, value, num_bytes), "cuMemsetD8")


def memcpy_dtoh(dst_host: int, src: int, num_bytes: int) -> None:
    check(cu.cuMemcpyDtoH(dst_host, src, num_bytes), "cuMemcpyDtoH")


def ctx_synchronize() -> None:
    check(cu.cuCtxSynchronize(), "cuCtxSynchronize")


def host_alloc_mapped(num_bytes: int) -> Tuple[int, int]:
    """Pinned host memory mapped into the device: (host pointer, device pointer)."""
    flags = int(cu.CU_MEMHOSTALLOC_DEVICEMAP) | int(cu.CU_MEMHOSTALLOC_PORTABLE)
    host = int(check(cu.cuMemHostAlloc(num_bytes, flags), "cuMemHostAlloc"))
    ctypes.memset(host, 0, num_bytes)
    dev = int(check(cu.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer"))
    return host, dev


def host_free(host_ptr: int) -> None:
    check(cu.cuMemFreeHost(host_ptr), "cuMemFreeHost")


def export_ipc(ptr: int) -> Tuple[bytes, int]:
    """IPC handle of the allocation that holds ``ptr`` and ``ptr``'s offset in it.

    cuIpcGetMemHandle wants the allocation's base address, which cuMemGetAddressRange gives (a tensor
    of a caching allocator, or a slice, can start inside its allocation).
    """
    base, _size = check(cu.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
    base = int(base)
    handle = check(cu.cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
    return ctypes.string_at(handle.getPtr(), kIpcHandleBytes), ptr - base


def open_ipc(handle: bytes) -> int:
    """Map a peer's allocation into this context; returns its base address here."""
    if len(handle) != kIpcHandleBytes:
        raise ValueError(f"an IPC handle has {kIpcHandleBytes} bytes, got {len(handle)}")
    h = cu.CUipcMemHandle()
    ctypes.memmove(h.getPtr(), handle, kIpcHandleBytes)
    flags = int(cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    return int(check(cu.cuIpcOpenMemHandle(h, flags), "cuIpcOpenMemHandle"))


def close_ipc(ptr: int) -> None:
    check(cu.cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")


# ----------------------------------------------------------------------------------------------------
# Stream memory operations (benchmarks/bench_p2p.py compares them with the transport's wait kernel)
# ----------------------------------------------------------------------------------------------------

def stream_wait_value32(stream: int, addr: int, value: int, geq: bool = False) -> None:
    """The stream waits until the word at ``addr`` equals ``value`` (CU_STREAM_WAIT_VALUE_EQ), or is
    cyclically >= it (CU_STREAM_WAIT_VALUE_GEQ). There is no timeout: only a write releases it."""
    flags = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ if geq else cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
    check(cu.cuStreamWaitValue32(stream, addr, value, int(flags)), "cuStreamWaitValue32")


def memset_u32_async(ptr: int, value: int, count: int, stream: int) -> None:
    check(cu.cuMemsetD32Async(ptr, value, count, stream), "cuMemsetD32Async")


def stream_write_value32(stream: int, addr: int, value: int) -> None:
    """Write ``value`` at ``addr`` after the stream's earlier work, with the default memory barrier."""
    check(cu.cuStreamWriteValue32(stream, addr, value, int(cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)),
          "cuStreamWriteValue32")
