"""The mechanism under EchoBuffer: peer memory, puts that publish a flag, waits that time out.

``CudaTransport`` implements this small interface; tests/host_transport.py implements it again over shared
memory between CPU processes (``HostTransport``), so that the staged pipeline above it is tested on a machine
without a GPU (it is not part of the package):

``CudaTransport``
    Allocates this rank's code buffer, parameter buffer and signal array with cuMemAlloc,
    exports them (cuMemGetAddressRange + cuIpcGetMemHandle), exchanges the handles over the process
    group (``all_gather_object``), opens the peers' (cuIpcOpenMemHandle), and prepares the transport
    kernels' launches (csrc/p2p_transport.cu) as objects of the echo_ds.ops extension, each launched on a
    stage's stream by one binding call.

Interface (``copies`` are ``(src, src_byte_offset, num_bytes, peer, region, dst_byte_offset)`` with
``src`` a contiguous tensor this rank keeps alive, ``region`` one of "codes", "params", "signals";
``flags`` are ``(peer, byte offset in the peer's EchoP2PSignals)``)::

    prepare_put(copies, flags, stage_offset, lane) -> handle;   put(handle, stream)
    prepare_signal(flags, stage_offset, value=None) -> handle;  signal(handle, stream)
    prepare_wait(flags, stage_offset, stage, tile) -> handle;   wait(handle, stream)
    begin_call(stream);  call_index();  failure() -> WaitFailure | None;  abort();  close()
    codes, params, signals: this rank's own buffers as uint8 tensors
    peer[j][region]: every rank's buffers as uint8 tensors on this device (peers' through the mapping)
"""

from __future__ import annotations

import ctypes
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from echo_ds.ops.kernels import extension_mismatches
from echo_ds.p2p import layout as L
from echo_ds.p2p import protocol as proto

Copy = Tuple[torch.Tensor, int, int, int, str, int]
Flag = Tuple[int, int]

# The words of EchoP2PErrorRecord in WaitFailure's order (its offsets come from the extension).
_RECORD_WORDS = ("code", "rank", "peer", "stage", "tile", "call_index", "expected", "seen", "waited_ns")
# The record's other words: the host's abort request, the one-launch kernel's mark and its range counters.
_RECORD_EXTRA = ("abort_request", "one_launch", "clipped_calls", "underflow_calls")


# ----------------------------------------------------------------------------------------------------
# CUDA
# ----------------------------------------------------------------------------------------------------

class DeviceBytes:
    """``num_bytes`` of device memory at ``ptr`` that torch does not own (this rank's cuMemAlloc buffers, a
    peer's memory mapped over CUDA IPC), described by the CUDA array interface (version 3) for
    ``torch.as_tensor``. The memory is EchoBuffer's, freed in close(); this object only describes it."""

    def __init__(self, ptr: int, num_bytes: int):
        # stream None: nothing to synchronise with, the memory is ready (written and synchronised before).
        self.__cuda_array_interface__ = {"version": 3, "typestr": "|u1", "shape": (num_bytes,), "strides": None,
                                         "data": (ptr, False), "stream": None}


def device_bytes(ptr: int, num_bytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor [num_bytes] over the memory at ``ptr``, on ``device`` (cuda:i, this rank's device, through
    which a peer's mapping is addressed), sharing the memory.

    NOTE: the device index must be explicit. torch.as_tensor then takes it as the tensor's device; without one
    it asks the driver where the pointer lives, which for a peer GPU's mapping is the peer, and a tensor of
    another device would be copied to this one, so the kernels would write into the copy. A torch that
    copies anyway is refused here rather than trusted.
    """
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"device_bytes needs a CUDA device with its index, got {device}")
    t = torch.as_tensor(DeviceBytes(ptr, num_bytes), device=device)
    if t.data_ptr() != ptr or t.device != device or t.numel() != num_bytes:
        raise proto.EchoP2PError(
            f"torch {torch.__version__} made a copy of the memory at {ptr:#x} ({t.data_ptr():#x} on {t.device}) "
            f"instead of a view on {device}: the p2p transport needs a torch whose as_tensor keeps an explicit "
            f"CUDA device for __cuda_array_interface__ memory; use the reference path (\"backend\": \"reference\")")
    return t


class CudaTransport:
    """Peer memory over CUDA IPC and the transport kernels of echo_ds.ops (``ext``: the loaded extension).
    Built by EchoBuffer; see its docstring."""

    kind = "cuda"

    def __init__(self, group, rank: int, world_size: int, device: torch.device, capacity: L.Capacity,
                 timeout_s: float, ext):
        from echo_ds.p2p import driver as D

        self.D = D
        self.ext = ext
        self.layout = ext.p2p_transport_layout()  # sizes and offsets of csrc/echo_p2p.h, as compiled
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout_ns = int(timeout_s * 1e9)
        self._own: List[int] = []  # device allocations to free
        self._opened: List[int] = []  # peers' mappings to close
        self._host_record: Optional[int] = None
        self._record = {}  # word name -> ctypes view of the mapped error record
        self.closed = False
        self.error = ""  # why this rank cannot take part (the handshake's verdict carries it)
        self.peer = []

        # Phase 1 (local): allocate and export. A failure is carried into the exchange instead of raised,
        # so that every rank still makes the same collective calls and all fall back together.
        # the codes buffer: the two halves of the slots, then the one-launch call's one-shot regions (if any)
        sizes = {"codes": capacity.code_bytes + capacity.shot_bytes, "params": capacity.param_bytes,
                 "signals": L.signal_bytes()}
        self.local_ptr = {}
        mine = None
        try:
            mismatches = extension_mismatches(ext)
            if mismatches:  # a prebuilt module of another version of the package, or csrc/ edited alone
                raise proto.EchoP2PError(f"echo_ds.ops was built for other sizes than this package declares: "
                                         f"{'; '.join(mismatches)}; rebuild it (reinstall with DS_BUILD_ECHO=1, "
                                         f"or ECHO_DS_FORCE_JIT=1 for the JIT build)")
            for region, n in sizes.items():
                ptr = D.mem_alloc(n)
                self._own.append(ptr)
                self.local_ptr[region] = ptr
            D.memset_u8(self.local_ptr["signals"], 0, sizes["signals"])
            self.control_ptr = D.mem_alloc(self.layout["control_bytes"])
            self._own.append(self.control_ptr)
            D.memset_u8(self.control_ptr, 0, self.layout["control_bytes"])
            self._host_record, self.error_dev_ptr = D.host_alloc_mapped(self.layout["error_bytes"])
            self.error_host_ptr = self._host_record  # the one-launch runtime reads its words (P2PRuntime.call)
            for name in _RECORD_WORDS + _RECORD_EXTRA:
                word = ctypes.c_uint64 if name == "waited_ns" else ctypes.c_uint32
                self._record[name] = word.from_address(self._host_record + self.layout["error." + name])
            self.progress_ptr = self.local_ptr["signals"] + L.signal_offset("progress")
            D.ctx_synchronize()
            mine = {region: D.export_ipc(ptr) for region, ptr in self.local_ptr.items()}
        except Exception as e:  # noqa: BLE001
            self.error = f"rank {rank}: setting up the workspace failed: {type(e).__name__}: {e}"

        # Phase 2 (collective): exchange (region -> (handle, offset)) of every rank.
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine, group=group)
        if any(e is None for e in everyone):
            self.error = self.error or f"rank {everyone.index(None)} could not export its workspace"
            return

        # Phase 3 (local): map the peers' memory.
        self.peer_ptr = [dict() for _ in range(world_size)]
        try:
            for j in range(world_size):
                for region in sizes:
                    if j == rank:
                        self.peer_ptr[j][region] = self.local_ptr[region]
                        continue
                    handle, offset = everyone[j][region]
                    base = D.open_ipc(handle)
                    self._opened.append(base)
                    self.peer_ptr[j][region] = base + offset
        except Exception as e:  # noqa: BLE001
            self.error = f"rank {rank}: opening rank {j}'s {region} buffer failed: {type(e).__name__}: {e}"
            return

        # Every rank's three regions as uint8 tensors on this device (peers' through their IPC mappings),
        # for kernels that take tensors (echo_ds.ops writes its codes straight into a peer's slot).
        try:
            self.peer = [{region: device_bytes(self.peer_ptr[j][region], n, device) for region, n in sizes.items()}
                         for j in range(world_size)]
        except Exception as e:  # noqa: BLE001
            self.error = f"rank {rank}: viewing the workspace as tensors failed: {type(e).__name__}: {e}"
            return

        # The fixed table of 3P + 1 addresses (appendix C): the P code buffers, the P parameter buffers,
        # the P signal arrays, as this process maps them, and this rank's flag base.
        self.table = [self.peer_ptr[j][region] for region in sizes for j in range(world_size)] + [self.control_ptr]
        self.codes = self.peer[rank]["codes"]
        self.params = self.peer[rank]["params"]
        self.signals = self.peer[rank]["signals"]

    def table_entries(self) -> List[int]:
        return list(self.table)

    # -- launches: prepared once per schedule, then one binding call each --------------------------

    def prepare_put(self, copies: Sequence[Copy], flags: Sequence[Flag], stage_offset: int, lane: int):
        return self.ext.P2PPut(
            [(self.peer_ptr[peer][region] + dst_off, src.data_ptr() + src_off, n)
             for src, src_off, n, peer, region, dst_off in copies],
            [self.peer_ptr[peer]["signals"] + off for peer, off in flags], self.control_ptr, self.progress_ptr,
            stage_offset, lane)

    def put(self, handle, stream) -> None:
        handle.launch(stream.cuda_stream)

    def prepare_wait(self, flags: Sequence[Flag], stage_offset: int, stage: int, tile: int, value=None):
        return self.ext.P2PWait([self.local_ptr["signals"] + off for _, off in flags], [peer for peer, _ in flags],
                                self.control_ptr, self.error_dev_ptr, self.timeout_ns, stage_offset, value, self.rank,
                                stage, tile)

    def wait(self, handle, stream) -> None:
        handle.launch(stream.cuda_stream)

    def prepare_signal(self, flags: Sequence[Flag], stage_offset: int, value=None):
        """Flags written with no data (the data went to the peers in an earlier kernel of the stream):
        value = control->base + stage_offset, or ``value`` itself."""
        return self.ext.P2PSignal([self.peer_ptr[peer]["signals"] + off for peer, off in flags], self.control_ptr,
                                  self.progress_ptr, stage_offset, value)

    def signal(self, handle, stream) -> None:
        handle.launch(stream.cuda_stream)

    def begin_call(self, stream) -> None:
        self.ext.p2p_begin_call(self.control_ptr, stream.cuda_stream)

    # -- state --------------------------------------------------------------------------------------

    def failure(self) -> Optional[proto.WaitFailure]:
        if self.closed or self._host_record is None:
            return None
        r = self._record
        if r["code"].value == proto.kErrorNone:
            return None
        return proto.WaitFailure(*(r[name].value for name in _RECORD_WORDS), one_launch=bool(r["one_launch"].value))

    def range_counts(self) -> Tuple[int, int]:
        """(clipped, underflow): this rank's one-launch calls without rescaling that the format could not
        express, as the kernels counted them so far (mapped memory, no synchronisation: calls still in
        flight are not in yet)."""
        if self.closed or self._host_record is None:
            return 0, 0
        return self._record["clipped_calls"].value, self._record["underflow_calls"].value

    def clear_failure(self) -> None:
        """Forget a failure (the constructor's probe only): record and poison back to zero."""
        ctypes.memset(self._host_record, 0, self.layout["error_bytes"])
        self.D.memset_u8(self.control_ptr + self.layout["control.poisoned"], 0, 4)
        self.D.ctx_synchronize()

    def call_index(self) -> int:
        """Calls begun on this rank, graph replays included (EchoP2PControl::call_index; a synchronous copy)."""
        word = ctypes.c_uint32()
        self.D.memcpy_dtoh(ctypes.addressof(word), self.control_ptr + self.layout["control.call_index"], 4)
        return word.value

    def abort(self) -> None:
        """Every wait, running or to come, gives up at once (the host writes the mapped abort word)."""
        if self._host_record is not None and not self.closed:
            self._record["abort_request"].value = 1

    def close_peers(self) -> None:
        """Unmap the peers' memory (before they free it: see EchoBuffer.close)."""
        errors = []
        for ptr in self._opened:
            try:
                self.D.close_ipc(ptr)
            except Exception as e:  # noqa: BLE001 - unmap the rest regardless
                errors.append(str(e))
        self._opened = []
        self.peer_ptr = [dict() for _ in range(self.world_size)]
        self.peer = []
        if errors:
            raise proto.EchoP2PError("echo p2p: unmapping peers: " + "; ".join(errors))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        D = self.D
        self.codes = self.params = self.signals = None
        errors = []
        try:
            self.close_peers()
        except proto.EchoP2PError as e:
            errors.append(str(e))
        for ptr in self._own:
            try:
                D.mem_free(ptr)
            except Exception as e:  # noqa: BLE001
                errors.append(str(e))
        if self._host_record is not None:
            self._record = {}
            try:
                D.host_free(self._host_record)
            except Exception as e:  # noqa: BLE001
                errors.append(str(e))
            self._host_record = None
        self._opened, self._own = [], []
        if errors:
            raise proto.EchoP2PError("echo p2p: close: " + "; ".join(errors))
