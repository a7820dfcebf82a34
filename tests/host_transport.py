"""The p2p transport's interface (echo_ds/p2p/transport.py) over shared memory files between processes of one
host, the CPU doing the copies and the polling: the staged pipeline above it (tiling, offsets, flag values,
the waits' failures) runs bit for bit against the reference on a machine without a GPU, with the stages this
transport brings, the torch stages (tests/torch_stages.py). A test fixture, not a production path:
``EchoBuffer(transport=HostTransport)`` (``transport_arg`` maps the tests' configuration name "host" to it).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import List, Optional

import torch
import torch.distributed as dist

from echo_ds.p2p import layout as L
from echo_ds.p2p import protocol as proto
from torch_stages import TorchSchedule


def transport_arg(name: str):
    """EchoBuffer's ``transport`` for a test configuration's name: "host" is this module's HostTransport."""
    return HostTransport if name == "host" else name


class _HostControl:
    def __init__(self):
        self.base = 0
        self.call_index = 0
        self.poisoned = False


class HostTransport:
    """The p2p protocol between processes of one host through shared memory files (CPU tensors)."""

    kind = "host"
    schedule = TorchSchedule  # the stages the staged pipeline runs over this transport (StagedPipeline)

    def __init__(self, group, rank: int, world_size: int, capacity: L.Capacity, timeout_s: float):
        self.error = ""
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.control = _HostControl()
        self._failure: Optional[proto.WaitFailure] = None
        self._aborted = False
        self.closed = False
        sizes = {"codes": capacity.code_bytes, "params": capacity.param_bytes, "signals": L.signal_bytes()}
        token = [uuid.uuid4().hex if rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
        self._paths = {region: os.path.join(shm, f"echo_p2p_{token[0]}_{rank}_{region}") for region in sizes}
        for region, n in sizes.items():
            with open(self._paths[region], "wb") as f:
                f.truncate(n)
        dist.barrier(group=group)
        self.peer = []
        for j in range(world_size):
            views = {}
            for region, n in sizes.items():
                path = os.path.join(shm, f"echo_p2p_{token[0]}_{j}_{region}")
                views[region] = torch.from_file(path, shared=True, size=n, dtype=torch.uint8)
            self.peer.append(views)
        dist.barrier(group=group)
        for path in self._paths.values():  # the mappings stay; the names go
            os.unlink(path)
        self.codes = self.peer[rank]["codes"]
        self.params = self.peer[rank]["params"]
        self.signals = self.peer[rank]["signals"]
        self._words = [v["signals"].view(torch.int32) for v in self.peer]

    def table_entries(self) -> List[int]:
        P = self.world_size
        return ([self.peer[j]["codes"].data_ptr() for j in range(P)]
                + [self.peer[j]["params"].data_ptr() for j in range(P)]
                + [self.peer[j]["signals"].data_ptr() for j in range(P)] + [id(self.control)])

    @staticmethod
    def _u32(v: int) -> int:
        v &= proto.kFlagMask
        return v - (1 << 32) if v >= (1 << 31) else v  # stored in an int32 word

    def prepare_put(self, copies, flags, stage_offset, lane):
        return (list(copies), list(flags), stage_offset)

    def put(self, handle, stream=None) -> None:
        copies, flags, stage_offset = handle
        for src, src_off, n, peer, region, dst_off in copies:
            src_bytes = src.reshape(-1).view(torch.uint8)
            self.peer[peer][region][dst_off:dst_off + n].copy_(src_bytes[src_off:src_off + n])
        if self.control.poisoned:  # a rank whose wait failed publishes no flag (as the CUDA kernels)
            return
        value = self._u32(self.control.base + stage_offset)
        for peer, off in flags:
            self._words[peer][off // 4] = value

    def prepare_wait(self, flags, stage_offset, stage, tile, value=None):
        return (list(flags), stage_offset, stage, tile, value)

    def wait(self, handle, stream=None) -> None:
        flags, stage_offset, stage, tile, value = handle
        expected = (self.control.base + stage_offset) if value is None else value
        expected &= proto.kFlagMask
        mine = self._words[self.rank]
        start = time.monotonic()
        for peer, off in flags:
            polls = 0
            while True:
                seen = int(mine[off // 4]) & proto.kFlagMask
                if proto.released(seen, expected):
                    break
                polls += 1
                if self.control.poisoned or self._aborted or time.monotonic() - start > self.timeout_s:
                    if not self.control.poisoned:
                        self.control.poisoned = True
                        code = proto.kErrorAborted if self._aborted else proto.kErrorTimeout
                        self._failure = proto.WaitFailure(code, self.rank, peer, stage, tile,
                                                          self.control.call_index, expected, seen,
                                                          int((time.monotonic() - start) * 1e9))
                    return
                time.sleep(0 if polls < 100 else 1e-4)

    def prepare_signal(self, flags, stage_offset, value=None):
        return (list(flags), stage_offset, value)

    def signal(self, handle, stream=None) -> None:
        flags, stage_offset, value = handle
        if self.control.poisoned:  # as put()
            return
        v = self._u32(self.control.base + stage_offset if value is None else value)
        for peer, off in flags:
            self._words[peer][off // 4] = v

    def begin_call(self, stream=None) -> None:
        self.control.call_index = (self.control.call_index + 1) & proto.kFlagMask
        self.control.base = proto.flag_base(self.control.call_index)

    def call_index(self) -> int:
        return self.control.call_index

    def failure(self):
        return self._failure

    def clear_failure(self) -> None:
        self._failure = None
        self.control.poisoned = False

    def abort(self) -> None:
        self._aborted = True

    def close_peers(self) -> None:
        self.peer = [p if j == self.rank else {} for j, p in enumerate(self.peer)]

    def close(self) -> None:
        self.closed = True
        self.peer = []
        self._words = []
        self.codes = self.params = self.signals = None
