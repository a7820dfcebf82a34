"""A torch uint8 tensor over raw memory that torch does not own (this rank's cuMemAlloc buffers, a
peer's memory mapped over CUDA IPC), without a copy.

Built from a DLPack capsule that names the device explicitly. The CUDA array interface would not do:
torch asks the driver which device a pointer belongs to, which for a peer GPU's IPC mapping is that
peer's device, and then copies the memory to the requested one, so the kernels would write into a
copy. The memory's lifetime is the caller's (EchoBuffer frees it in close()); the capsule's deleter
does nothing.
"""

from __future__ import annotations

import ctypes

import torch

kDLCPU = 1
kDLCUDA = 2
kDLUInt = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


@_Deleter
def _no_delete(_managed):  # the memory belongs to EchoBuffer
    return None


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# The DLManagedTensor structs must outlive the tensors made from them; they are a few dozen bytes each
# and a buffer makes a fixed number of views, so they are kept for the process's life.
_keep = []


def raw_uint8_tensor(ptr: int, num_bytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of ``num_bytes`` at address ``ptr`` on ``device`` (cuda:i or cpu), sharing it."""
    shape = (ctypes.c_int64 * 1)(num_bytes)
    m = _DLManagedTensor()
    m.dl_tensor.data = ptr
    if device.type == "cuda":
        m.dl_tensor.device = _DLDevice(kDLCUDA, device.index if device.index is not None else torch.cuda.current_device())
    else:
        m.dl_tensor.device = _DLDevice(kDLCPU, 0)
    m.dl_tensor.ndim = 1
    m.dl_tensor.dtype = _DLDataType(kDLUInt, 8, 1)
    m.dl_tensor.shape = shape
    m.dl_tensor.strides = None
    m.dl_tensor.byte_offset = 0
    m.manager_ctx = None
    m.deleter = _no_delete
    _keep.append((m, shape))
    capsule = _PyCapsule_New(ctypes.addressof(m), b"dltensor", None)
    t = torch.utils.dlpack.from_dlpack(capsule)
    if t.data_ptr() != ptr or t.numel() != num_bytes or t.device != device:
        raise RuntimeError(f"DLPack view of {ptr:#x} came back as {t.data_ptr():#x} on {t.device}")
    return t
