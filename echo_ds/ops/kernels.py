"""Torch-facing wrappers of the Echo CUDA kernels (csrc/echo_api.cuh describes the stages).

Every function writes into tensors the caller passes (they may be views of a peer's memory, opened over
CUDA IPC); none allocates an output. They run on the current stream of the tensors' device (use
``torch.cuda.stream(s)`` for a side stream) and return nothing.

Shapes, for n = x.numel() elements on P ranks with group size g (echo_ds.algorithm.Layout):
    G = groups_per_segment, S = G * g (segment), padded = P * S.
A *segment table* is a :class:`SegmentTable` of P entries (codes uint8 [>= G * g * bits / 8],
scales float16 [>= G], zeros float16 [>= G]), any entry may be None where the stage neither reads nor
writes it. ``packet_views`` cuts one reference-layout packet (codes, then scales, then zeros, as
echo_ds.reference._packet) into such an entry.

Numerics: bit for bit those of echo_ds.reference / echo_ds.emulate, whether these run on a CUDA device or
on the CPU (the reference writes divisions by constants as products by the fp32 reciprocal, which CUDA's
and the CPU's PyTorch round alike; docs/kernels.md, "Divisions by constants").
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, NamedTuple, Optional, Sequence

import torch

from echo_ds import quant as Q
from echo_ds.compensator import kStateTensorDtypes
from echo_ds.algorithm import Layout
from echo_ds.quant import QuantSpec

# What the kernels are built for, declared here once (tests/test_facts.py holds csrc/ to it); everything else
# in the package derives from these and from echo_ds.quant.
#
# The kernels' quantizer argument: the quantizer's index in quant.QUANTIZERS (csrc/echo_api.cuh, Quantizer).
QUANTIZER_CODES = {name: code for code, name in enumerate(Q.QUANTIZERS)}
# World sizes the kernels are built for: the instantiations of the owner reduce (ECHO_DISPATCH_WORLD_SIZE in
# csrc/echo_device.cuh, which push_quantize asks too, so that it refuses the others; dequantize and pow2_amax
# take P as an argument) and of the one launch (csrc/p2p_all_reduce.cuh, P2PRuntime in
# csrc/echo_binding.cpp), and so the sizes the p2p transport serves (echo_ds.p2p.policy.group_decision).
# The reference path takes any P.
KERNEL_WORLD_SIZES = (2, 4, 8)
# Group sizes the kernels are built for (ECHO_DISPATCH_GROUP_SIZE); the p2p transport sends calls of the other
# powers of two to the reference path. Bit widths: all of quant.SUPPORTED_BITS.
SUPPORTED_GROUP_SIZES = (64, 128, 256)
# Element types of every kernel, staged and one-launch, in the order of the kernels' DType codes
# (csrc/echo_api.cuh), which the one-launch call's descriptor uses too; the p2p transport takes the same.
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Stored formats of the compensator's state (echo.<direction>.state_dtype, echo_ds.compensator, "Storage";
# csrc/echo_api.cuh, StateFormat) that every kernel holds, staged and one-launch.
SUPPORTED_STATE_DTYPES = ("bf16", "int8", "int4")
# Every code buffer must start on a 16-byte boundary (the kernels store codes as 8/16-byte vectors).
kCodeAlignmentBytes = 16


def unsupported_reason(world_size: int, spec: QuantSpec, dtype: torch.dtype = torch.float16) -> Optional[str]:
    """Why the kernels cannot run this configuration (None: they can). Pure; needs no GPU."""
    if world_size not in KERNEL_WORLD_SIZES:
        return f"unsupported world size {world_size} (the kernels are built for {KERNEL_WORLD_SIZES})"
    if spec.group_size not in SUPPORTED_GROUP_SIZES:
        return f"group_size={spec.group_size} (the kernels are built for {SUPPORTED_GROUP_SIZES})"
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        return f"dtype {dtype} (the kernels take {names})"
    return None


def extension_mismatches(ext) -> List[str]:
    """Where the loaded extension (``ext``) was built for other sizes than the ones declared above: the
    bounds it exports (csrc/echo_api.cuh; its whole dispatch is pinned by tests/test_facts.py). The p2p
    transport checks them before it allocates (echo_ds.p2p.transport.CudaTransport). Pure."""
    declared = {"kMaxWorldSize": max(KERNEL_WORLD_SIZES), "kMinGroupSize": min(SUPPORTED_GROUP_SIZES),
                "kMaxGroupSize": max(SUPPORTED_GROUP_SIZES)}
    return [f"{name} {int(getattr(ext, name))} (echo_ds/ops/kernels.py declares {value})"
            for name, value in declared.items() if int(getattr(ext, name)) != value]


# ----------------------------------------------------------------------------------------------------
# Constants handed to the kernels
# ----------------------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def hadamard_sign_words(group_size: int) -> tuple:
    """quant.hadamard_signs(g) as g/32 32-bit words: bit i set <=> the sign of element i is -1."""
    signs = Q.hadamard_signs(group_size)
    words = [0] * (group_size // 32)
    for i, s in enumerate(signs.tolist()):
        if s < 0:
            words[i // 32] |= 1 << (i % 32)
    return tuple(words)


def _hadamard_args(spec: QuantSpec):
    if not spec.rotation:
        return [], 0.0
    return list(hadamard_sign_words(spec.group_size)), Q.hadamard_norm(spec.group_size)


class CompensatorCoefficients(NamedTuple):
    """The fp32-rounded coefficients of a Compensator, in the kernels' order."""

    gain: float
    blend: float
    one_minus_blend: float
    slow_decay: float
    one_minus_slow: float
    fast_decay: float
    one_minus_fast: float

    @classmethod
    def of(cls, compensator) -> "CompensatorCoefficients":
        c = compensator
        return cls(c.gain, c.blend, c.one_minus_blend, c.slow_decay, c.one_minus_slow, c.fast_decay,
                   c.one_minus_fast)


# ----------------------------------------------------------------------------------------------------
# Segment tables and packets
# ----------------------------------------------------------------------------------------------------

class SegmentTable(NamedTuple):
    codes: List[Optional[torch.Tensor]]
    scales: List[Optional[torch.Tensor]]
    zeros: List[Optional[torch.Tensor]]

    @classmethod
    def of(cls, entries: Sequence[Optional[tuple]]) -> "SegmentTable":
        """From P entries (codes, scales, zeros) or None."""
        codes, scales, zeros = [], [], []
        for e in entries:
            c, s, z = e if e is not None else (None, None, None)
            codes.append(c)
            scales.append(s)
            zeros.append(z)
        return cls(codes, scales, zeros)


def code_bytes(spec: QuantSpec) -> int:
    return Q.group_code_bytes(spec.bits, spec.group_size)


def packet_bytes(layout: Layout, spec: QuantSpec) -> int:
    """Bytes of one segment's packet: G * quant.group_wire_bytes with room for the fp16 scales and zero-points
    (a packed quantizer's words take the scales' place and leave the zeros unused)."""
    return layout.groups_per_segment * Q.group_wire_bytes(spec.bits, spec.group_size, "zero_aware")


def packet_stride(layout: Layout, spec: QuantSpec) -> int:
    """packet_bytes rounded up to kCodeAlignmentBytes: the row stride of stacked packets."""
    b = packet_bytes(layout, spec)
    return -(-b // kCodeAlignmentBytes) * kCodeAlignmentBytes


def packet_views(buf: torch.Tensor, layout: Layout, spec: QuantSpec):
    """(codes [G, g b/8] uint8, scales [G] fp16, zeros [G] fp16) views of one packet ``buf`` (uint8). A packed
    quantizer's kernels write its 16-bit words (quant.pack_params) into the scales and leave the zeros."""
    G = layout.groups_per_segment
    cb = code_bytes(spec)
    n = G * cb
    codes = buf[:n].view(G, cb)
    scales = buf[n:n + 2 * G].view(torch.float16)
    zeros = buf[n + 2 * G:n + 4 * G].view(torch.float16)
    return codes, scales, zeros


def alloc_packets(num: int, layout: Layout, spec: QuantSpec, device) -> torch.Tensor:
    """[num, packet_stride] uint8 rows, each holding one packet at its start (helper for callers/tests)."""
    return torch.empty((num, packet_stride(layout, spec)), dtype=torch.uint8, device=device)


def packet_table(rows: Sequence[Optional[torch.Tensor]], layout: Layout, spec: QuantSpec) -> SegmentTable:
    """SegmentTable of packet rows (None entries stay None)."""
    return SegmentTable.of([None if r is None else packet_views(r, layout, spec) for r in rows])


# ----------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------

def _ops():
    from echo_ds.ops import load

    return load()


def _empty_like_table(device):
    return (torch.empty(0, dtype=torch.uint8, device=device), torch.empty(0, dtype=torch.float16, device=device),
            torch.empty(0, dtype=torch.float16, device=device))


def _table_args(table: SegmentTable, world_size: int, device):
    if len(table.codes) != world_size:
        raise ValueError(f"a segment table needs world_size = {world_size} entries, got {len(table.codes)}")
    empty = _empty_like_table(device)
    codes = [empty[0] if c is None else c for c in table.codes]
    scales = [empty[1] if s is None else s for s in table.scales]
    zeros = [empty[2] if z is None else z for z in table.zeros]
    return codes, scales, zeros


_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def raw_stream(device: torch.device) -> int:
    """The current stream's handle on ``device`` (torch's raw accessor where the build has it: no Stream
    object), as every launcher of this module and the one-launch call (echo_ds.p2p.call) pass it."""
    if _current_raw_stream is not None:
        return _current_raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _coeffs(coeffs) -> list:
    if coeffs is None:
        return []
    if not isinstance(coeffs, CompensatorCoefficients):
        coeffs = CompensatorCoefficients.of(coeffs)
    return list(coeffs)


# ----------------------------------------------------------------------------------------------------
# Stages
# ----------------------------------------------------------------------------------------------------

class UnsupportedStateDtype(TypeError):
    """The kernels were handed a compensator state in a format they do not hold (SUPPORTED_STATE_DTYPES)."""


def kernel_state(compensator) -> dict:
    """The compensator's state as every kernel takes it, {m1, m2, exponent} in its stored format
    (echo_ds/compensator.py, "Storage"; csrc/echo_binding.cpp, state_format): "bf16" (m1, m2, None),
    "int8" (m1, m2, exponent), "int4" (its packed bytes q as m1, None, exponent). Empty without one."""
    if compensator is None:
        return {}
    return {arg: None if name is None else getattr(compensator, name)
            for arg, name in zip(("m1", "m2", "exponent"), kernel_state_names(compensator.state_dtype))}


def kernel_state_names(state_dtype: str) -> tuple:
    """The compensator's tensor names behind the kernels' (m1, m2, exponent) (None: not passed)."""
    names = kStateTensorDtypes[state_dtype]
    if "q" in names:  # int4: the packed bytes of both averages stand in m1's place
        return "q", None, "exponent"
    return "m1", "m2", "exponent" if "exponent" in names else None


# The dtypes of (m1, m2, exponent) of each stored format, as kernel_state gives them (from the compensator's
# declaration of its tensors, echo_ds.compensator.kStateTensorDtypes).
_STATE_ARG_DTYPES = {fmt: tuple(None if n is None else kStateTensorDtypes[fmt][n] for n in kernel_state_names(fmt))
                     for fmt in kStateTensorDtypes}


def _state_args(m1, m2, exponent, coeffs):
    """(m1, m2, exponent, coefficients) checked against the stored format ``coeffs.state_dtype`` names."""
    if m1 is None:
        if m2 is not None or exponent is not None or coeffs is not None:
            # e.g. an "int4" compensator's own m1, m2 (None: its state is q), which would read as "none"
            raise ValueError("m2, exponent and coeffs come with the state's m1 (pass kernel_state(compensator))")
        return None, None, None, []
    if coeffs is None:
        raise ValueError("compensating from the state (m1, m2) needs coeffs")
    state_dtype = getattr(coeffs, "state_dtype", "bf16")
    want = _STATE_ARG_DTYPES.get(state_dtype)
    got = tuple(None if t is None else t.dtype for t in (m1, m2, exponent))
    if want != got:
        raise UnsupportedStateDtype(
            f"state_dtype {state_dtype!r} takes (m1, m2, exponent) of dtypes {want} (echo_ds.ops.kernels."
            f"kernel_state), got {got}; the kernels hold {SUPPORTED_STATE_DTYPES}")
    return m1, m2, exponent, _coeffs(coeffs)


def push_quantize(x: torch.Tensor, *, rank: int, world_size: int, spec: QuantSpec, out: SegmentTable,
                  m1: Optional[torch.Tensor] = None, m2: Optional[torch.Tensor] = None,
                  exponent: Optional[torch.Tensor] = None, coeffs=None, update_state: bool = False,
                  pow2_amax: Optional[torch.Tensor] = None, group_begin: int = 0,
                  num_groups: Optional[int] = None) -> None:
    """Stage 1 (entry / push) for groups [group_begin, group_begin + num_groups) of every sent segment.

    x: this rank's contribution, any shape, contiguous, float32 / float16 / bfloat16 (n elements).
    out: segment table; entry j != rank receives segment j's codes and fp16 (scale, zero). The owned
        segment is not touched: owner_reduce forms it from the same x (and state).
    m1, m2, exponent: the compensator state [>= padded] in its stored format (kernel_state gives them from a
        Compensator); coeffs: the Compensator or its coefficients (which name the format: bf16 without one).
    update_state: residual "local": fold the sent groups' rounding error into m1, m2 in place
        (Compensator.update of those elements).
    pow2_amax: float32 [1] on the device, max |r'| over all ranks (None: no rescaling).
    """
    ops = _ops()
    hs, hn = _hadamard_args(spec)
    m1, m2, e, k = _state_args(m1, m2, exponent, coeffs)
    with torch.cuda.device(x.device):
        ops.push_quantize(x, m1, m2, e, *_table_args(out, world_size, x.device), bool(update_state), pow2_amax,
                          rank, world_size, spec.group_size, spec.bits, QUANTIZER_CODES[spec.quantizer], hs, hn,
                          k, group_begin, -1 if num_groups is None else num_groups, raw_stream(x.device))


def owner_reduce(x: torch.Tensor, *, rank: int, world_size: int, spec: QuantSpec, copies: SegmentTable,
                 out: SegmentTable, m1: Optional[torch.Tensor] = None, m2: Optional[torch.Tensor] = None,
                 exponent: Optional[torch.Tensor] = None, coeffs=None, update_state: bool = False,
                 pow2_amax: Optional[torch.Tensor] = None, group_begin: int = 0,
                 num_groups: Optional[int] = None) -> None:
    """Stage 2 (owner reduce) for groups [group_begin, group_begin + num_groups) of the owned segment.

    x, m1, m2, coeffs, pow2_amax: exactly what this rank's push_quantize got; the own copy,
        rs = (rotate(x) + c) 2^k of segment ``rank``, is formed here from them.
    copies: segment table; entry r != rank holds the copy rank r sent (entry rank is ignored).
    out: segment table; every non-None entry d receives the reduced segment's codes and parameters.
    update_state: residual "local": fold the requantization error of the owned groups into m1, m2.
    """
    ops = _ops()
    hs, hn = _hadamard_args(spec)
    m1, m2, e, k = _state_args(m1, m2, exponent, coeffs)
    with torch.cuda.device(x.device):
        ops.owner_reduce(x, m1, m2, e, *_table_args(copies, world_size, x.device),
                         *_table_args(out, world_size, x.device), bool(update_state), pow2_amax, rank, world_size,
                         spec.group_size, spec.bits, QUANTIZER_CODES[spec.quantizer], hs, hn, k, group_begin,
                         -1 if num_groups is None else num_groups, raw_stream(x.device))


def dequantize(out: torch.Tensor, *, world_size: int, spec: QuantSpec, gathered: SegmentTable,
               pow2_amax: Optional[torch.Tensor] = None, segment_begin: int = 0,
               num_segments: Optional[int] = None, group_begin: int = 0,
               num_groups: Optional[int] = None, x: Optional[torch.Tensor] = None,
               m1: Optional[torch.Tensor] = None, m2: Optional[torch.Tensor] = None,
               exponent: Optional[torch.Tensor] = None, coeffs=None) -> None:
    """Stage 3 (gather / tail): y of segments [segment_begin, +num_segments), groups [group_begin, +num_groups).

    out: the result y, any shape, contiguous, float32 / float16 / bfloat16 (n elements; its numel fixes
        the layout); elements of other segments/groups are left as they are.
    gathered: segment table; entry j holds the reduced codes of segment j.
    x, m1, m2, coeffs: residual "output": this rank's contribution as push_quantize got it (x of out's
        dtype and numel) and its state; m1, m2 of the decoded groups are updated in place from
        u = (rotate(x) + c) - s_hat / P (Compensator.update of those elements).
    """
    ops = _ops()
    hs, hn = _hadamard_args(spec)
    if (x is None) != (m1 is None):
        raise ValueError("dequantize: the state update needs x and the state (m1, m2) together")
    m1, m2, e, k = _state_args(m1, m2, exponent, coeffs)
    with torch.cuda.device(out.device):
        ops.dequantize(out, *_table_args(gathered, world_size, out.device), pow2_amax, world_size, spec.group_size,
                       spec.bits, QUANTIZER_CODES[spec.quantizer], hs, hn, segment_begin, -1 if num_segments is None else num_segments, group_begin,
                       -1 if num_groups is None else num_groups, x, m1, m2, e, k, raw_stream(out.device))


def pow2_amax(x: torch.Tensor, amax_out: torch.Tensor, *, world_size: int, spec: QuantSpec,
              m1: Optional[torch.Tensor] = None, m2: Optional[torch.Tensor] = None,
              exponent: Optional[torch.Tensor] = None, coeffs=None) -> None:
    """amax_out (float32 [1]) = max |rotate(x) + c| over this rank's padded tensor (NaN propagates).

    Reduce it over the ranks (all_reduce MAX) before handing it to the stages as ``pow2_amax``.
    """
    ops = _ops()
    hs, hn = _hadamard_args(spec)
    m1, m2, e, k = _state_args(m1, m2, exponent, coeffs)
    with torch.cuda.device(x.device):
        ops.pow2_amax(x, amax_out, m1, m2, e, world_size, spec.group_size, hs, hn, k, raw_stream(x.device))
