"""The flag protocol of the p2p transport, as pure functions (the kernels in csrc/p2p do the same).

Call c (1-based, counted on the device, graph replays included) has the flag base
``B(c) = 3 c mod 2^32`` (appendix C: the base rises by 3 per call). Each stage publishes one value::

    push    B + 0    the sender's codes of a tile have reached the owner (and the pow2 max exchange)
    reduce  B + 1    the owner has reduced a tile (its progress word, for diagnostics)
    gather  B + 2    the owner's reduced codes of a tile have reached a rank; tail polls for it

Flags are 32-bit words that are never cleared. A waiter is released when its flag *equals* the value
it expects: while a waiter looks, its slot holds either a value of an older call or exactly that value
(the writer's next write to the slot depends, through the pipeline, on the waiter having finished), so
equality is the ``>=`` of the paper, and it stays sound when the 32-bit values wrap, where a
serial-number ``>=`` would release a waiter on a slot left untouched for more than 2^31 calls.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def describe_failure(f: WaitFailure, timeout_s: float, world_size: int) -> str:
    """The error message of a failed wait (one line)."""
    stage = WAIT_STAGE_NAMES.get(f.stage, f"stage {f.stage}")
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
