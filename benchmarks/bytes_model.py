"""The bytes an Echo all-reduce call moves, per rank, pass by pass: the model behind the floor columns of
benchmarks/bench_p2p.py and the projection of benchmarks/projection.py (docs/p2p.md, "Bytes and memory").

Written once from the kernels' passes: the one-launch kernel (``csrc/p2p_all_reduce.cuh``) and the staged
kernels (``csrc/pow2_amax.cu``, ``csrc/push_quantize.cu``, ``csrc/owner_reduce.cuh``,
``csrc/dequantize.cu``) read and write the same bytes, pass for pass, so one model covers both. (The
staged pipeline "through torch" keeps fp32 intermediates and is not modelled.)

Symbols: P ranks, n = numel, s = bytes of an element of x and y (2 for bf16 / fp16, 4 for fp32), g the
group size, b the bits of a code, G = ceil(n / (P g)) groups per segment (``echo_ds.algorithm.Layout``),
w = g b / 8 + p bytes of one group's packet (codes, then its parameters: p = 2 for the packed word of
"zero_aware_int", 4 for the fp16 scale and zero-point of the other quantizers;
``echo_ds.quant.group_wire_bytes``), N = P G g the padded length. The compensator's state is m1 and m2
in bf16 over the padded length (``echo_ds.compensator.kStateDtype``): 4 bytes per padded element to read
it, 4 to write it.

Per rank and call (x and y bytes stop at n: the kernels neither load nor store past it):

=========================  ==========================================  ======================================
pass                       reads                                       writes (sent: to peers)
=========================  ==========================================  ======================================
pow2 max (pow2 on)         x: n s; state (compensated): 4 N            -
A. entry (push)            x of the P - 1 sent segments; their state   P - 1 packets, (P - 1) G w, all sent;
                           (compensated): 4 (P - 1) G g                state (residual "local"): 4 (P - 1) G g
B. owner reduce            x of the owned segment; its state           P packets of the reduced segment,
                           (compensated): 4 G g; the P - 1 received    P G w, (P - 1) G w sent (one into the
                           packets: (P - 1) G w                        own gather slot); state ("local"):
                                                                       4 G g
C. tail (dequantize)       the gathered packets: w per group whose     y: n s; state (residual "output"):
                           first element is < n (all P G groups with   4 N
                           residual "output"); with "output" also x
                           (n s) and the state (4 N)
=========================  ==========================================  ======================================

So, for large n (n = N), per element: reads s + c (2P - 1) / P and writes s + c (2P - 1) / P with
c = w / g, plus 8 bytes (4 read, 4 written) with the compensator's residual "local", 14 (10 read, 4
written, x read twice) with residual "output", and s + 4 read (compensated) or s read (uncompensated)
for the pow2 max pass (pow2 "auto" or true: the pass runs whenever rescaling may apply). bf16, 4-bit,
g = 64, "zero_aware_int" (c = 34 / 64) at P = 2: 2.797 + 2.797 = 5.59 bytes per element uncompensated,
13.59 compensated ("local"), 19.59 with pow2 on as well.

Bytes sent per rank: 2 (P - 1) G w (``echo_ds.p2p.layout.wire_bytes_per_rank``). Writes count the bytes
this rank's kernel stores, its peers' memory included; by symmetry every rank receives as many as it
sends, so they are also the bytes written into its own memory. Not counted: the flags (8 bytes per block
and peer and phase), the pow2 max exchange (4 bytes per peer), the Hadamard signs (registers), and a
group's re-read of data that L2 still holds.

The floor of a call is the bytes the GPU's HBM must move at the device's copy bandwidth (bytes read +
written per second by a large device-to-device copy): all ranks sharing one GPU count together
(``floor_seconds``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

RESIDUALS = ("none", "local", "output")  # "none": no compensator (uncompensated call)
kStateBytesPerElement = 4  # m1 and m2, bf16 each (echo_ds.compensator.kStateDtype)

_ELEMENT_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def element_bytes(dtype) -> int:
    """Bytes of one element of x: a torch dtype, its name ("bfloat16", "torch.float16") or a size in bytes."""
    if isinstance(dtype, int):
        if dtype not in (2, 4):
            raise ValueError(f"element size {dtype} must be 2 or 4 bytes")
        return dtype
    name = str(dtype).replace("torch.", "")
    if name not in _ELEMENT_BYTES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(_ELEMENT_BYTES)}")
    return _ELEMENT_BYTES[name]


def packet_bytes(bits: int, group_size: int, quantizer: str) -> int:
    """w: bytes of one group's packet (codes, then the parameters), echo_ds.quant.group_wire_bytes."""
    from echo_ds import quant as Q

    return Q.group_wire_bytes(bits, group_size, quantizer)


@dataclass(frozen=True)
class Pass:
    """One pass of the call: the group's bytes (all ranks together), read, written, sent to peers."""

    name: str
    read_bytes: float  # integers with the bf16 state
    write_bytes: float
    sent_bytes: float = 0


@dataclass(frozen=True)
class CallBytes:
    """The bytes of one call. ``passes`` hold the group's totals (exact integers, every rank summed);
    the per-rank figures are their mean over the ranks (ranks differ only in where the padding falls)."""

    world_size: int
    numel: int
    passes: Tuple[Pass, ...] = field(default_factory=tuple)

    @property
    def group_read_bytes(self) -> int:
        return sum(p.read_bytes for p in self.passes)

    @property
    def group_write_bytes(self) -> int:
        return sum(p.write_bytes for p in self.passes)

    @property
    def group_sent_bytes(self) -> int:
        return sum(p.sent_bytes for p in self.passes)

    @property
    def read_bytes(self) -> float:
        """HBM bytes one rank reads."""
        return self.group_read_bytes / self.world_size

    @property
    def write_bytes(self) -> float:
        """HBM bytes one rank writes (its peers' memory included)."""
        return self.group_write_bytes / self.world_size

    @property
    def hbm_bytes(self) -> float:
        """read_bytes + write_bytes: what the floor counts."""
        return self.read_bytes + self.write_bytes

    @property
    def sent_bytes(self) -> float:
        """Bytes one rank stores into its peers' memory (over NVLink on separate GPUs)."""
        return self.group_sent_bytes / self.world_size

    def per_element(self) -> Dict[str, float]:
        """read, write, hbm and sent bytes per element of the message."""
        n = max(self.numel, 1)
        return {"read": self.read_bytes / n, "write": self.write_bytes / n, "hbm": self.hbm_bytes / n,
                "sent": self.sent_bytes / n}

    def as_dict(self) -> dict:
        return {"read_bytes": self.read_bytes, "write_bytes": self.write_bytes, "sent_bytes": self.sent_bytes,
                "passes": {p.name: [p.read_bytes, p.write_bytes, p.sent_bytes] for p in self.passes}}


def call_bytes(world_size: int, numel: int, dtype="bfloat16", bits: int = 4, group_size: int = 64,
               quantizer: str = "zero_aware_int", residual: str = "none", pow2=False,
               state_bytes_per_element=kStateBytesPerElement) -> CallBytes:
    """The bytes of one Echo all-reduce call of ``numel`` elements over ``world_size`` ranks (see the module
    docstring for each pass).

    dtype: of x and y (torch dtype, name, or element size in bytes). residual: "none" (no compensator),
    "local" or "output" (the compensator's residual; both read the state, "local" updates it in the entry
    and the owner reduce, "output" in the tail). pow2: the call's pow2_rescale (False, True or "auto"; the
    max pass runs unless it is False). state_bytes_per_element: of m1 and m2 together (4: bf16 each; a
    narrower stored format gives its own, e.g. echo_ds.compensator.state_bytes_per_element where it exists).
    """
    P = int(world_size)
    if P < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if residual not in RESIDUALS:
        raise ValueError(f"residual={residual!r}: expected one of {RESIDUALS}")
    if pow2 not in (False, True, "auto"):
        raise ValueError(f"pow2={pow2!r}: expected False, True or 'auto'")
    n = int(numel)
    s = element_bytes(dtype)
    g = int(group_size)
    w = packet_bytes(bits, g, quantizer)
    G = max(1, math.ceil(n / (P * g)))  # echo_ds.algorithm.Layout.groups_per_segment
    N = P * G * g
    seg = G * g
    compensated = residual != "none"

    # x below n, per segment: the sent segments' share and the owned segment's, summed over the ranks.
    x_owned = n * s  # every segment is owned once over the group
    x_sent = (P - 1) * n * s  # and sent by the P - 1 other ranks
    state_read = state_bytes_per_element  # m1 + m2, bytes per padded element (the same to write them)
    if P == 1:  # EchoBuffer.all_reduce returns a copy of x
        return CallBytes(P, n, (Pass("copy", n * s, n * s),))
    passes = []
    if pow2 is not False:
        passes.append(Pass("pow2_max", P * (n * s + (state_read * N if compensated else 0)), 0))
    local = residual == "local"
    # A. entry: (P - 1) segments of G groups per rank.
    sent_packets = P * (P - 1) * G * w
    state_sent = P * (P - 1) * seg * state_read
    passes.append(Pass("entry", x_sent + (state_sent if compensated else 0),
                       sent_packets + (state_sent if local else 0), sent_packets))
    # B. owner reduce: reads the P - 1 received packets of its segment and its own x (and state), writes the
    # reduced packet into every rank's gather slot (its own included).
    state_owned = P * seg * state_read
    passes.append(Pass("owner_reduce", x_owned + (state_owned if compensated else 0) + P * (P - 1) * G * w,
                       P * P * G * w + (state_owned if local else 0), P * (P - 1) * G * w))
    # C. tail: decode every segment's gathered groups into y; a group that is all padding is skipped unless
    # residual "output" updates its state (which re-reads x and the state).
    output = residual == "output"
    groups_decoded = P * G if output else math.ceil(n / g)
    passes.append(Pass("tail", P * (groups_decoded * w + ((n * s + state_read * N) if output else 0)),
                       P * (n * s + (state_read * N if output else 0))))
    return CallBytes(P, n, tuple(passes))


def plain_call_bytes(world_size: int, numel: int, dtype="bfloat16", group_size: int = 256) -> CallBytes:
    """The bytes of one unquantized call of the same family (EchoBuffer.plain_all_reduce; csrc
    p2p_plain_all_reduce_kernel, groups of 256 elements): the entry copies the P - 1 sent segments' x into
    the owners' slots, the owner reads them and its own x and writes the rounded sum into every rank's slot,
    the tail copies every segment's slot into y (groups that are all padding skipped)."""
    P = int(world_size)
    if P < 2:
        raise ValueError(f"world_size={world_size} must be >= 2")
    n, s, g = int(numel), element_bytes(dtype), int(group_size)
    G = max(1, math.ceil(n / (P * g)))
    slot = G * g * s  # one segment's slot: whole groups, padding included
    x_sent = (P - 1) * n * s
    return CallBytes(P, n, (
        Pass("entry", x_sent, P * (P - 1) * slot, P * (P - 1) * slot),
        Pass("owner_reduce", n * s + P * (P - 1) * slot, P * P * slot, P * (P - 1) * slot),
        Pass("tail", P * math.ceil(n / g) * g * s, P * n * s),
    ))


def floor_seconds(calls_bytes: float, copy_bytes_per_second: float) -> float:
    """The floor of a call: ``calls_bytes`` (HBM bytes read + written by everything that shares the GPU,
    e.g. ranks_per_gpu * CallBytes.hbm_bytes) at the copy bandwidth (bytes read + written per second)."""
    if copy_bytes_per_second <= 0:
        raise ValueError("the copy bandwidth must be positive")
    return calls_bytes / copy_bytes_per_second


# ----------------------------------------------------------------------------------------------------
# Device memory of one rank
# ----------------------------------------------------------------------------------------------------

def workspace_bytes(max_numel: int, world_size: int, min_group_size: int = 16,
                    one_shot_max_bytes: Optional[int] = None) -> Dict[str, int]:
    """The IPC workspace one rank allocates (driver allocations, outside torch's allocator) for messages
    of up to ``max_numel`` elements: EchoBuffer's code and parameter buffers (echo_ds.p2p.layout.Capacity:
    push and gather halves of P slots each, sized for 8-bit codes and fp16 parameters at the smallest group
    size), the one-shot regions after the codes (two parities of P senders' regions for messages of up to
    ``one_shot_max_bytes``, EchoBuffer's default where None) and the signal words (EchoP2PSignals and the
    one-launch flag area). Not included: the transport's control block and the one-launch call's P2PControl
    (a few hundred bytes), the mapped error record (pinned host memory)."""
    from echo_ds.p2p import layout as L
    from echo_ds.p2p import policy

    if one_shot_max_bytes is None:
        one_shot_max_bytes = policy.one_shot_max_bytes(world_size)
    cap = L.Capacity(world_size, max_numel, min_group_size, shot_numel=min(max_numel, one_shot_max_bytes // 2))
    out = {"code_bytes": cap.code_bytes, "shot_bytes": cap.shot_bytes, "param_bytes": cap.param_bytes,
           "signal_bytes": L.signal_bytes()}
    out["total_bytes"] = sum(out.values())
    return out


def state_bytes(numel: int, world_size: int, group_size: int, state_bytes_per_element=kStateBytesPerElement):
    """One compensator's state for calls of ``numel`` elements: m1 and m2 (bf16 by default) over the padded
    length (one per call site and direction)."""
    G = max(1, math.ceil(numel / (world_size * group_size)))
    return state_bytes_per_element * world_size * G * group_size


def staged_schedule_bytes(numel: int, world_size: int, bits: int, group_size: int) -> int:
    """The staged kernels' buffers held per message shape (echo_ds.p2p.stages.KernelSchedule: the owner's
    own reduced packet, codes and fp16 parameters, and two fp32 maxima), before the caching allocator
    rounds each up; EchoBuffer keeps up to 32 shapes. The one-launch call holds none."""
    G = max(1, math.ceil(numel / (world_size * group_size)))
    return G * group_size * bits // 8 + 4 * G + 8
