"""The p2p transport's tensors over memory torch does not own (echo_ds.p2p.transport.device_bytes): the CUDA
array interface it hands to torch.as_tensor (CPU), and on a GPU that the result is a view, not a copy, on
the device named, whichever device the memory lives on."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from echo_ds.p2p.transport import DeviceBytes, device_bytes

kNumBytes = 4096 + 17  # not a multiple of any vector width


def test_interface_describes_bytes_at_the_pointer():
    ptr = 0x7F00_0000_1000
    cai = DeviceBytes(ptr, kNumBytes).__cuda_array_interface__
    assert cai["version"] == 3
    assert cai["shape"] == (kNumBytes,) and cai["strides"] is None  # C-contiguous
    assert cai["data"] == (ptr, False)  # writable: the kernels write through these views
    assert cai["stream"] is None  # nothing to wait for: the memory is ready when viewed
    # torch reads typestr through numpy's parser: one unsigned byte per element
    assert np.dtype(cai["typestr"]) == np.uint8


@pytest.mark.parametrize("device", [torch.device("cpu"), torch.device("cuda")])
def test_a_view_needs_a_cuda_device_with_its_index(device):
    # Without an index torch would ask the driver where the pointer lives (a peer's GPU for its mapping).
    with pytest.raises(ValueError, match="CUDA device with its index"):
        device_bytes(0x1000, kNumBytes, device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_view_of_driver_memory_is_the_memory():
    """cuMemAlloc memory, as CudaTransport allocates its workspace: the view has its address and device,
    a torch write through it is what the driver reads back, a driver write is what the view reads."""
    from echo_ds.p2p import driver as D

    device = torch.device("cuda", torch.cuda.current_device())
    torch.zeros(1, device=device)  # the primary context is current from here on (as EchoBuffer makes it)
    D.init()
    ptr = D.mem_alloc(kNumBytes)
    try:
        view = device_bytes(ptr, kNumBytes, device)
        assert (view.data_ptr(), view.device, view.dtype, view.shape) == (ptr, device, torch.uint8, (kNumBytes,))
        pattern = torch.randint(0, 256, (kNumBytes,), dtype=torch.uint8, device=device)
        view.copy_(pattern)
        torch.cuda.synchronize(device)
        host = (ctypes.c_uint8 * kNumBytes)()
        D.memcpy_dtoh(ctypes.addressof(host), ptr, kNumBytes)
        assert bytes(host) == bytes(pattern.cpu().numpy())
        D.memset_u8(ptr + 100, 0xA5, 33)
        D.ctx_synchronize()
        assert view[100:133].eq(0xA5).all() and view[99].item() == pattern[99].item()
        del view
    finally:
        D.mem_free(ptr)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_view_of_another_devices_memory_stays_on_the_named_device():
    """A peer's mapping lives on the peer's GPU; its view must be on this rank's device, without a copy (a
    copy would take the kernels' writes away from the peer)."""
    other = torch.zeros(kNumBytes, dtype=torch.uint8, device="cuda:1")
    view = device_bytes(other.data_ptr(), kNumBytes, torch.device("cuda", 0))
    assert (view.data_ptr(), view.device) == (other.data_ptr(), torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torch_takes_the_named_device_without_asking_the_driver():
    """What makes a peer GPU's mapping safe, checked on one GPU: torch must take the explicit device index
    instead of asking the driver where the pointer lives. Pageable host memory has no device to give, so a
    torch that asks raises here; one that takes the index wraps it (the view is never read on the device)."""
    host = (ctypes.c_uint8 * kNumBytes)()
    device = torch.device("cuda", torch.cuda.current_device())
    view = device_bytes(ctypes.addressof(host), kNumBytes, device)
    assert (view.data_ptr(), view.device) == (ctypes.addressof(host), device)
