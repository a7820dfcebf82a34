"""Memory layout of the p2p transport: the signal words' offsets (csrc/echo_p2p.h), the workspace sizes
of a group, and the tiling of one call. Pure Python (no device): the schedule is testable on a CPU.

Workspace of one rank (three allocations exported to its peers, appendix C)::

    code buffer    push half   [0, H):   P slots of code_stride bytes (slot s: the codes rank s sent me)
                   gather half [H, 2H):  P slots (slot o: owner o's reduced codes)
    param buffer   the same two halves; a slot holds the G fp16 scales, then the G fp16 zero-points of
                   one segment
    signal array   EchoP2PSignals (flags written by the peers)

The halves start at fixed offsets whatever the call's size, and only the slot stride depends on it.
NOTE: this is what makes back-to-back calls of different sizes safe. A rank that has finished call n
may push call n + 1 while a slower peer still decodes the gathered codes of call n; its push lands in
the push half, which that peer has finished reading (it has reduced every tile before the fast rank
could finish), and never in the gather half it is still reading. (Slots laid out end to end by the
call's own stride would let a push of a larger call overwrite them: the 40-call mixed-size stress test
of tests/test_p2p_host.py caught exactly that.)

Slot ``s`` of a rank's own index is never written (a rank sends nothing to itself); keeping it makes an
address a plain product, identical on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

from echo_ds import quant as Q
from echo_ds.algorithm import Layout
from echo_ds.ops.kernels import SUPPORTED_GROUP_SIZES
from echo_ds.quant import MAX_GROUP_SIZE, MIN_GROUP_SIZE

# The offsets of EchoP2PSignals (csrc/echo_p2p.h) that address the flags, on both transports. The header
# pins them with static_asserts and the extension exports them with the rest of its layout
# (p2p_transport_layout()): EchoBuffer checks these against it before it uses the CUDA transport
# (check_layout), and tests/test_kernels_compile.py against the header compiled on the host.
SIGNALS_LAYOUT = {
    "signals_bytes": 4416,
    "signals.push": 0,  # uint32 [kMaxWorld][kMaxTiles]
    "signals.gather": 2048,  # uint32 [kMaxWorld][kMaxTiles]
    "signals.amax_flag": 4096,  # uint32 [kMaxWorld]
    "signals.amax": 4128,  # float [kMaxWorld]
    "signals.probe": 4160,  # uint32 [kMaxWorld][4]
    "signals.progress": 4288,  # uint32
    "signals.reserved": 4292,  # uint32 [31], written by no stage (benchmarks/bench_p2p.py's ping-pong)
    "max_world": 8,
    "max_tiles": 64,
}
kMaxWorld = SIGNALS_LAYOUT["max_world"]
kMaxTiles = SIGNALS_LAYOUT["max_tiles"]
kSlotAlignBytes = 256  # slot starts on a 256-byte boundary: 16-byte vector copies, whole L2 sectors
# Tiles hold a multiple of 8 groups, so that a tile's fp16 parameters (2 bytes x 8) and codes fill whole
# 16-byte vectors; only a segment's last tile can be shorter.
kTileGroupQuantum = 8

# The one-launch kernel's flag area (csrc/echo_api.cuh, P2PFlags) sits in the same exported signal memory,
# after EchoP2PSignals: 64-bit push and gather flags per (rank, block) for up to kFusedMaxBlocks blocks,
# and the pow2 max exchange. echo_ds.ops exports sizeof(P2PFlags); check_layout compares it with this.
kFusedMaxBlocks = 256
kFusedFlagsOffset = 8192
kFusedFlagsBytes = 2 * 8 * kMaxWorld * kFusedMaxBlocks + 8 * kMaxWorld + 4 * kMaxWorld + 32

# Put launches: one arrival counter per stream that launches puts (EchoP2PControl::arrivals).
kLanePush = 0
kLaneGather = 1
kLaneAmax = 2
kLaneProbe = 3


def signal_bytes() -> int:
    """Bytes of one rank's exported signal memory: EchoP2PSignals, then the one-launch flag area."""
    return kFusedFlagsOffset + kFusedFlagsBytes


def signal_offset(field: str, *index: int) -> int:
    """Byte offset of one word of EchoP2PSignals, e.g. ``signal_offset("push", src, tile)``."""
    off = SIGNALS_LAYOUT.get("signals." + field)
    if off is None:
        raise KeyError(field)
    if field in ("push", "gather"):
        src, tile = index
        return off + 4 * (src * kMaxTiles + tile)
    if field in ("amax_flag", "amax"):
        (src,) = index
        return off + 4 * src
    if field == "probe":
        src, word = index
        return off + 4 * (src * 4 + word)
    return off  # progress, reserved


def check_layout(ext) -> None:
    """Raise RuntimeError where echo_ds.ops' compiled layout (``ext``: the loaded extension) and this module
    differ: csrc/echo_p2p.h or csrc/echo_api.cuh and echo_ds/p2p/layout.py drifted apart."""
    compiled = ext.p2p_transport_layout()
    diff = [f"{k}: {v} here, {compiled.get(k)} compiled" for k, v in SIGNALS_LAYOUT.items() if compiled.get(k) != v]
    fused = (int(ext.kP2PFlagsBytes), int(ext.kP2PMaxBlocks))
    if fused != (kFusedFlagsBytes, kFusedMaxBlocks):
        diff.append(f"one-launch flag area: {kFusedFlagsBytes} B / {kFusedMaxBlocks} blocks here, "
                    f"{fused[0]} B / {fused[1]} compiled")
    if diff:
        raise RuntimeError("the p2p layout of echo_ds/p2p/layout.py differs from the compiled extension's: "
                           + "; ".join(diff))


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


# ----------------------------------------------------------------------------------------------------
# Capacity of a group's workspace
# ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Capacity:
    """Bytes of the two exported data buffers of one rank, sized for messages of up to ``max_numel``
    elements at any bit width (8-bit codes are the largest) and group sizes >= ``min_group_size``."""

    world_size: int
    max_numel: int
    min_group_size: int = MIN_GROUP_SIZE
    shot_numel: int = 0  # the largest one-shot message (elements of 16-bit x); 0: no one-shot regions

    @property
    def max_segment_groups(self) -> int:
        # A segment holds ceil(n / (P g)) groups; at the smallest g that is the most groups, and the
        # padding of a larger g adds at most one group of that g's size (covered by the + 1).
        return -(-self.max_numel // (self.world_size * self.min_group_size)) + 1

    @property
    def code_bytes(self) -> int:
        # 8-bit codes, one byte an element: a segment holds ceil(n / P) elements plus at most one group
        # of padding, of at most MAX_GROUP_SIZE elements.
        max_segment_bytes = -(-self.max_numel // self.world_size) + MAX_GROUP_SIZE
        return 2 * self.world_size * _round_up(max_segment_bytes, kSlotAlignBytes)

    @property
    def param_bytes(self) -> int:
        return 2 * self.world_size * _round_up(Q.kParamBytesPerGroup * self.max_segment_groups, kSlotAlignBytes)

    @property
    def shot_sender_bytes(self) -> int:
        """One sender's one-shot region (csrc/p2p_all_reduce.cuh, ShotRegion; P2PRuntime checks every call
        against it): P code slots of a segment at 8 bits, the parameters of P segments at the kernels' smallest
        group size, the own segment in fp32; a segment's padding at most one group of the kernels' largest size."""
        if self.shot_numel <= 0:
            return 0
        seg = -(-self.shot_numel // self.world_size) + max(SUPPORTED_GROUP_SIZES)
        groups = -(-seg // min(SUPPORTED_GROUP_SIZES))
        return (self.world_size * _round_up(seg, kSlotAlignBytes)
                + _round_up(Q.kParamBytesPerGroup * self.world_size * groups, kSlotAlignBytes)
                + _round_up(4 * seg, kSlotAlignBytes))

    @property
    def shot_bytes(self) -> int:
        """The one-shot regions after the two code halves: two parities of P senders' regions."""
        return 2 * self.world_size * self.shot_sender_bytes


# ----------------------------------------------------------------------------------------------------
# The tiling of one call
# ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tiling:
    """Slots and tiles of a call whose segments hold ``groups_per_segment`` groups.

    code_bytes_per_group: g * b / 8 (quant.group_code_bytes). A tile carries ``tile_groups`` groups of every
    segment (the last one fewer), so one put moves tile_groups * quant.group_wire_bytes bytes (codes and
    fp16 parameters) to each peer.
    code_half_bytes, param_half_bytes: where the gather halves of the two buffers start (fixed by the
    workspace's capacity, not by this call).
    """

    world_size: int
    groups_per_segment: int
    code_bytes_per_group: int
    tile_groups: int
    code_half_bytes: int
    param_half_bytes: int

    @property
    def num_tiles(self) -> int:
        return -(-self.groups_per_segment // self.tile_groups)

    def tile(self, t: int) -> Tuple[int, int]:
        """[first group, end group) of tile ``t`` inside a segment."""
        if not 0 <= t < self.num_tiles:
            raise IndexError(f"tile {t} of {self.num_tiles}")
        g0 = t * self.tile_groups
        return g0, min(g0 + self.tile_groups, self.groups_per_segment)

    @property
    def code_stride(self) -> int:
        return _round_up(self.groups_per_segment * self.code_bytes_per_group, kSlotAlignBytes)

    @property
    def param_stride(self) -> int:
        return _round_up(Q.kParamBytesPerGroup * self.groups_per_segment, kSlotAlignBytes)

    # Slots are numbered 0 .. P-1 (push half) and P .. 2P-1 (gather half).
    def push_slot(self, src: int) -> int:
        return src

    def gather_slot(self, owner: int) -> int:
        return self.world_size + owner

    def _split(self, slot: int):
        P = self.world_size
        if not 0 <= slot < 2 * P:
            raise IndexError(f"slot {slot} of {2 * P}")
        return (slot, 0) if slot < P else (slot - P, 1)

    def code_offset(self, slot: int, group: int = 0) -> int:
        i, half = self._split(slot)
        return half * self.code_half_bytes + i * self.code_stride + group * self.code_bytes_per_group

    def scale_offset(self, slot: int, group: int = 0) -> int:
        i, half = self._split(slot)
        return half * self.param_half_bytes + i * self.param_stride + 2 * group

    def zero_offset(self, slot: int, group: int = 0) -> int:
        i, half = self._split(slot)
        return half * self.param_half_bytes + i * self.param_stride + 2 * self.groups_per_segment + 2 * group

    @property
    def code_bytes_needed(self) -> int:
        """Bytes of one half of the code buffer this call uses."""
        return self.world_size * self.code_stride

    @property
    def param_bytes_needed(self) -> int:
        return self.world_size * self.param_stride

    def fits(self) -> bool:
        return self.code_bytes_needed <= self.code_half_bytes and self.param_bytes_needed <= self.param_half_bytes


def choose_tile_groups(groups_per_segment: int, code_bytes_per_group: int, tile_bytes: int) -> int:
    """Groups per tile: about ``tile_bytes`` of wire bytes (codes + fp16 parameters) per peer, a multiple
    of kTileGroupQuantum, and no more than kMaxTiles tiles per segment."""
    if tile_bytes <= 0:
        return max(groups_per_segment, 1)
    wire_per_group = code_bytes_per_group + Q.kParamBytesPerGroup
    groups = max(kTileGroupQuantum, (tile_bytes // wire_per_group) // kTileGroupQuantum * kTileGroupQuantum)
    fewest = _round_up(-(-groups_per_segment // kMaxTiles), kTileGroupQuantum)
    return max(1, min(max(groups, fewest), max(groups_per_segment, 1)))


def make_tiling(numel: int, world_size: int, bits: int, group_size: int, tile_bytes: int,
                capacity: Capacity) -> Tiling:
    """The tiling of a call of ``numel`` elements (the segmentation of echo_ds.algorithm.Layout) in a
    workspace of ``capacity``."""
    layout = Layout(numel, world_size, group_size)
    G = layout.groups_per_segment
    cb = Q.group_code_bytes(bits, group_size)
    return Tiling(world_size, G, cb, choose_tile_groups(G, cb, tile_bytes), capacity.code_bytes // 2,
                  capacity.param_bytes // 2)


def wire_bytes_per_rank(numel: int, world_size: int, bits: int, group_size: int,
                        quantizer: str = "zero_aware") -> int:
    """Bytes one rank sends in a call: (P - 1) segments on push and P - 1 copies of its reduced segment
    on gather (the busbw of the benchmark counts these)."""
    layout = Layout(numel, world_size, group_size)
    seg = layout.groups_per_segment * Q.group_wire_bytes(bits, group_size, quantizer)
    return 2 * (world_size - 1) * seg


def _check():
    assert math.log2(kTileGroupQuantum).is_integer()
    assert SIGNALS_LAYOUT["signals_bytes"] <= kFusedFlagsOffset and kFusedFlagsOffset % 256 == 0


_check()
