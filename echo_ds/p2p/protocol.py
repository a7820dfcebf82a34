"""The flag protocol of the p2p transport, as pure functions (the kernels of csrc/p2p_transport.cu do the same).

Call c (1-based, counted on the device, graph replays included) has the flag base
``B(c) = 3 c mod 2^32`` (appendix C: the base rises by 3 per call). The staged pipeline publishes two
values per call::

    push    B + 0    the sender's codes of a tile have reached the owner (and the pow2 max exchange);
                     the owner's reduce polls for it
    gather  B + 2    the owner's reduced codes of a tile have reached a rank; tail polls for it

B + 1 (``kStageReduce``) is reserved: no stage publishes it. Every put and signal also writes the value it
published into the rank's own ``progress`` word (EchoP2PSignals, for diagnostics). The one-launch call
(csrc/p2p_all_reduce.cuh) has 64-bit flags of its own, ``(epoch << 32) | call_descriptor(...)``.

Flags are 32-bit words that are never cleared. A waiter is released when its flag *equals* the value
it expects: while a waiter looks, its slot holds either a value of an older call or exactly that value
(the writer's next write to the slot depends, through the pipeline, on the waiter having finished), so
equality is the ``>=`` of the paper, and it stays sound when the 32-bit values wrap, where a
serial-number ``>=`` would release a waiter on a slot left untouched for more than 2^31 calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from echo_ds.algorithm import POW2_MODES
from echo_ds.ops.kernels import SUPPORTED_DTYPES, SUPPORTED_GROUP_SIZES, SUPPORTED_STATE_DTYPES
from echo_ds.quant import QUANTIZERS, SUPPORTED_BITS

kFlagMask = 0xFFFFFFFF
kStagesPerCall = 3
kStagePush = 0
kStageReduce = 1
kStageGather = 2

# What a waiter waits for (EchoP2PErrorRecord::stage).
kWaitAmax = 0
kWaitReduce = 1
kWaitTail = 2
kWaitProbe = 3
WAIT_STAGE_NAMES = {kWaitAmax: "pow2-max exchange (entry)", kWaitReduce: "reduce (waiting for push)",
                    kWaitTail: "tail (waiting for gather)", kWaitProbe: "probe"}
PUBLISH_STAGE_NAMES = {kStagePush: "push", kStageReduce: "reduce", kStageGather: "gather"}

kErrorNone = 0
kErrorTimeout = 1
kErrorAborted = 2
kErrorMismatch = 3  # the one-launch call: a peer's flag of this call carries a different call descriptor

# The one-launch call's descriptor: 32 bits in the low half of every flag it writes (the high half is the
# call's epoch), so that ranks calling with different arguments are caught by the flags they exchange
# anyway. DESCRIPTOR_LAYOUT declares its fields, lowest bits first: each field's bit position is the sum
# of the widths before it, and a value's code is its index in the field's values, which come from the
# declarations of what the kernels take (echo_ds.ops.kernels, echo_ds.quant, echo_ds.algorithm).
DESCRIPTOR_DTYPES = tuple(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
# The kernels' group sizes, and one code for any other (the stages a transport brings, the tests' torch stages,
# take every size the quantizer does, their descriptor gate included): such a size is mixed into the hash.
kOtherGroupSize = "another (in the hash)"
DESCRIPTOR_GROUP_SIZES = SUPPORTED_GROUP_SIZES + (kOtherGroupSize,)
DESCRIPTOR_QUANTIZERS = QUANTIZERS
# Also the residual argument of the one-launch call (P2PRuntime.plan: 0 none, 1 "local", 2 "output").
DESCRIPTOR_RESIDUALS = ("none", "local", "output")
DESCRIPTOR_POW2 = POW2_MODES
# The compensator's stored state format (echo_ds.compensator, "Storage"; "bf16" also for a call without one).
DESCRIPTOR_STATE_DTYPES = SUPPORTED_STATE_DTYPES
kNumelHashBits = 18
kDescriptorBits = 32
kHashField = "numel/site/direction (hash)"


@dataclass(frozen=True)
class DescriptorField:
    """One field of the descriptor: ``name`` in decode_descriptor's answer, ``arg`` call_descriptor's
    keyword, ``width`` bits, ``values`` coded by their index (None: the field holds a number)."""

    name: str
    arg: str
    width: int
    values: Optional[tuple]

    @property
    def mask(self) -> int:
        return (1 << self.width) - 1


DESCRIPTOR_LAYOUT = (
    DescriptorField("dtype", "dtype", 2, DESCRIPTOR_DTYPES),
    DescriptorField("bits", "bits", 1, SUPPORTED_BITS),
    DescriptorField("group_size", "group_size", 2, DESCRIPTOR_GROUP_SIZES),
    DescriptorField("quantizer", "quantizer", 2, DESCRIPTOR_QUANTIZERS),
    DescriptorField("rotation", "rotation", 1, (False, True)),
    DescriptorField("pow2_rescale", "pow2", 2, DESCRIPTOR_POW2),
    DescriptorField("compensator", "residual", 2, DESCRIPTOR_RESIDUALS),
    DescriptorField("state_dtype", "state_dtype", 2, DESCRIPTOR_STATE_DTYPES),
    DescriptorField(kHashField, "hash", kNumelHashBits, None),
)
# A 16-bit (unquantized) call of the same kernel family (EchoBuffer.plain_all_reduce): its dtype, in the
# residual field the first code that no quantized call has, and the hash; the other fields 0.
kPlainResidualCode = len(DESCRIPTOR_RESIDUALS)
kPlainResidualName = "none: a 16-bit call, unquantized"


def descriptor_shifts(layout=DESCRIPTOR_LAYOUT) -> dict:
    """{field arg: its lowest bit}."""
    shifts, bit = {}, 0
    for f in layout:
        shifts[f.arg] = bit
        bit += f.width
    return shifts


def check_descriptor_layout(layout=DESCRIPTOR_LAYOUT) -> None:
    """Raise ValueError where the fields do not fill the descriptor's 32 bits or a field's values (one more
    for the residual field: the plain call's code) do not fit its width: a new group size, quantizer or
    dtype must widen its field here."""
    total = sum(f.width for f in layout)
    if total != kDescriptorBits:
        raise ValueError(f"the descriptor's fields take {total} bits, not {kDescriptorBits}")
    for f in layout:
        needed = 0 if f.values is None else len(f.values) + (f.arg == "residual")
        if needed > 1 << f.width:
            raise ValueError(f"descriptor field {f.name!r}: {needed} codes do not fit its {f.width} bits; widen it "
                             f"in echo_ds/p2p/protocol.py (DESCRIPTOR_LAYOUT)")


check_descriptor_layout()
_FIELDS = {f.arg: f for f in DESCRIPTOR_LAYOUT}
_SHIFT = descriptor_shifts()


def numel_hash(numel: int, site: Optional[int] = None, direction: Optional[str] = None,
               group_size: Optional[int] = None) -> int:
    """kNumelHashBits bits of (element count, site, direction[, a group size the descriptor has no code
    for]) (Fibonacci hashing of each, mixed): equal calls give equal hashes, and two calls that differ in any
    of them collide with probability about 2^-kNumelHashBits."""
    h = 0
    mixed = (numel, -1 if site is None else site, {None: 0, "forward": 1, "backward": 2, "eval": 3}[direction])
    for v in mixed + (() if group_size is None else (group_size,)):
        h = ((h ^ (v & 0xFFFFFFFF)) * 0x9E3779B1) & 0xFFFFFFFF
    return h >> (32 - kNumelHashBits)


def _encode(**codes) -> int:
    """The descriptor of {field arg: code} (absent fields 0)."""
    return sum(code << _SHIFT[arg] for arg, code in codes.items())


def _code(field: DescriptorField, value) -> int:
    if value not in field.values:
        raise ValueError(f"the call descriptor has no code for {field.arg}={value!r} (one of {field.values})")
    return field.values.index(value)


def call_descriptor(*, numel: int, dtype: str, bits: int, group_size: int, quantizer: str, rotation: bool,
                    pow2, residual: str, site: Optional[int] = None, direction: Optional[str] = None,
                    state_dtype: str = "bf16") -> int:
    """The 32-bit descriptor of a one-launch call (see decode_descriptor); site and direction: the
    caller's (None: not compared); state_dtype: the compensator's stored format ("bf16" without one)."""
    other = group_size not in SUPPORTED_GROUP_SIZES  # a size only a transport's own stages take: in the hash
    args = dict(dtype=dtype, bits=bits, group_size=kOtherGroupSize if other else group_size, quantizer=quantizer,
                rotation=rotation, pow2=pow2, residual=residual, state_dtype=state_dtype)
    codes = {f.arg: _code(f, args[f.arg]) for f in DESCRIPTOR_LAYOUT if f.values is not None}
    return _encode(**codes, hash=numel_hash(numel, site, direction, group_size if other else None))


def plain_call_descriptor(*, numel: int, dtype: str, site: Optional[int] = None,
                          direction: Optional[str] = None) -> int:
    """The 32-bit descriptor of a plain (unquantized) one-launch call."""
    return _encode(dtype=_code(_FIELDS["dtype"], dtype), residual=kPlainResidualCode,
                   hash=numel_hash(numel, site, direction))


def _value(field: DescriptorField, code: int):
    if field.values is None:
        return code
    return field.values[code] if code < len(field.values) else f"?{code}"


def decode_descriptor(d: int) -> dict:
    """{field name: value} of a descriptor ("?i" for a code no value has); a plain call's has its dtype,
    its compensator and its hash only."""
    codes = {f.arg: (d >> _SHIFT[f.arg]) & f.mask for f in DESCRIPTOR_LAYOUT}
    if codes["residual"] == kPlainResidualCode:
        return {"dtype": _value(_FIELDS["dtype"], codes["dtype"]), _FIELDS["residual"].name: kPlainResidualName,
                kHashField: codes["hash"]}
    return {f.name: _value(f, codes[f.arg]) for f in DESCRIPTOR_LAYOUT}


kDefaultTimeoutS = 5.0


def flag_base(call_index: int) -> int:
    """B(c) = 3 c mod 2^32 for call c >= 1 (0 is the value every flag starts with)."""
    return (kStagesPerCall * call_index) & kFlagMask


def flag_value(call_index: int, stage: int) -> int:
    """The value that ``stage`` (kStage*) publishes in call ``call_index``."""
    if stage not in PUBLISH_STAGE_NAMES:
        raise ValueError(f"stage={stage!r} is not one of {sorted(PUBLISH_STAGE_NAMES)}")
    return (flag_base(call_index) + stage) & kFlagMask


def released(seen: int, expected: int) -> bool:
    """Whether a waiter expecting ``expected`` may go on after reading ``seen``."""
    return (seen & kFlagMask) == (expected & kFlagMask)


def decode_flag(value: int):
    """(call index mod 2^32 / 3 ..., stage) a value was published as; (0, None) for a fresh flag.

    Exact until the values wrap (after 1.43e9 calls); used only to word error messages.
    """
    value &= kFlagMask
    if value == 0:
        return 0, None
    return value // kStagesPerCall, value % kStagesPerCall


@dataclass(frozen=True)
class WaitFailure:
    """A decoded EchoP2PErrorRecord: the first wait of a rank that gave up."""

    code: int
    rank: int
    peer: int
    stage: int
    tile: int
    call_index: int
    expected: int
    seen: int
    waited_ns: int
    one_launch: bool = False  # written by the one-launch kernel: flags hold call numbers, tile is a block


class EchoP2PError(RuntimeError):
    """The p2p transport of a group failed (a peer stopped answering, or the buffer was closed)."""


class EchoP2PTimeout(EchoP2PError):
    """A cross-GPU wait passed its timeout: the message names rank, peer, stage and call number."""


class EchoP2PMismatch(EchoP2PError):
    """Ranks of a group made the same call with different arguments (one-launch call): the message names
    every field that differs, with this rank's and the peer's value."""


def describe_failure(f: WaitFailure, timeout_s: float, world_size: int) -> str:
    """The error message of a failed wait (one line)."""
    stage = WAIT_STAGE_NAMES.get(f.stage, f"stage {f.stage}")
    if f.code == kErrorMismatch:
        mine, theirs = decode_descriptor(f.expected), decode_descriptor(f.seen)
        diff = [f"{k}: rank {f.rank} {mine[k]!r}, rank {f.peer} {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]
        return (f"echo p2p: rank {f.rank} of {world_size} and rank {f.peer} made call {f.call_index} with different "
                f"arguments ({'; '.join(diff) or 'descriptor ' + hex(f.expected) + ' vs ' + hex(f.seen)}); every rank "
                f"of a group must call all_reduce in the same order with the same size, dtype and settings. The "
                f"call's result is undefined and the buffer is unusable.")
    if f.one_launch:
        last = "it has never written this flag" if f.seen == 0 else f"the flag holds call {f.seen}"
        where = f"block {f.tile} of " if f.stage in (kWaitReduce, kWaitTail) else ""
    else:
        seen_call, seen_stage = decode_flag(f.seen)
        if seen_stage is None:
            last = "it has never written this flag"
        else:
            last = f"the flag holds {PUBLISH_STAGE_NAMES[seen_stage]} of call {seen_call}"
        where = f"tile {f.tile} of " if f.stage in (kWaitReduce, kWaitTail) else ""
    if f.code == kErrorAborted:
        return (f"echo p2p: rank {f.rank} of {world_size} abandoned its wait for rank {f.peer} at stage "
                f"{stage}, {where}call {f.call_index}, because the buffer was closed or the process "
                f"is exiting (expected flag {f.expected}, read {f.seen}: {last})")
    return (f"echo p2p: rank {f.rank} of {world_size} timed out after {f.waited_ns / 1e9:.2f} s "
            f"(timeout {timeout_s:g} s) waiting for rank {f.peer} at stage {stage}, {where}call "
            f"{f.call_index} (expected flag {f.expected}, read {f.seen}: {last}). Rank {f.peer} is dead, "
            f"hung, or more than {timeout_s:g} s behind; raise EchoBuffer(timeout_s=...) or "
            f"ECHO_P2P_TIMEOUT_S if ranks legitimately drift apart that far.")
