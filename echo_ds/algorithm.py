"""The arithmetic of one Echo all-reduce, without its communication: the pure-tensor stages shared by
the distributed reference (echo_ds.reference), the emulator (echo_ds.emulate) and the tests' torch stages
of the p2p transport (tests/torch_stages.py).

Every function here works on a leading rank axis R (R = 1 on one rank of the distributed reference,
R = P in the emulator), so every path runs the very same fp32 operations and gives identical bits.

Layout of one call with n elements on P ranks and group size g::

    padded  = ceil(n / (P g)) * P g       zeros appended
    segment j = elements [j * padded/P, (j + 1) * padded/P), owned by rank j
    groups    = [R, P, groups_per_segment, g]

Per call, on rank i (section 4.1):

1. entry: x' = rotate(x) + c (the correction c, when compensating), times 2^k when rescaling;
   quantize every segment j != i (the segments it sends);
2. all-to-all: segment j's codes go to its owner j;
3. owner reduce: acc = sum over ranks r = 0 .. P-1 in that order of (x'_i^i if r == i else
   dequantize(codes from r)), in fp32; quantize acc once;
4. all-gather of the reduced segments' codes; every rank, the owner included, dequantizes the same codes
   (s_hat), so all ranks hold bit-identical results; y = unrotate(s_hat) / 2^k;
5. with a compensator, its residual u (:func:`output_residual`, :func:`local_residual`) updates its state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from echo_ds import quant as Q
from echo_ds.quant import QuantSpec

# Backward rescaling (section 5.4): the group's largest magnitude is brought into [2^14, 2^15), far
# from both ends of fp16's range: the largest 4-bit scale is then < 2^16 / 15 = 4369 (fp16 max 65504),
# and a group 1e-7 times smaller than the tensor's largest value still has a normal fp16 scale.
kPow2Target = 15

# The rescaling modes of a call (``pow2_rescale``): False never rescales, True always does, "auto" only
# when the group's largest magnitude lies outside [kAutoLow, kAutoHigh). Inside that window no scale
# can overflow (the owner's sum over P <= 8 ranks needs at most 2^19 / 15 < 65504, as at the target),
# and a group that holds the largest magnitude and straddles zero (as rotated groups do) has a normal
# fp16 scale at 4 and 8 bits; outside it, "auto" rescales exactly as True does. Forward sites use
# "auto" by default: an fp32 or bf16 activation message beyond 2^15 or below 2^-6 is rescaled by an
# exact power of two instead of being clipped or flushed to zero.
POW2_MODES = (False, True, "auto")
kAutoLow = 2.0**-6
kAutoHigh = 2.0**kPow2Target


def check_pow2_mode(mode, where: str) -> None:
    """Refuse anything but False, True and "auto" (0 and 1 are not modes: a typo should not pass)."""
    if not (isinstance(mode, bool) or (isinstance(mode, str) and mode == "auto")):
        raise ValueError(f"{where}: pow2_rescale={mode!r} must be False, True or 'auto'")


def pow2_code(mode) -> int:
    """0, 1, 2 for False, True, "auto" (the kernels' and the descriptors' encoding)."""
    return 2 if mode == "auto" else int(bool(mode))


@dataclass(frozen=True)
class Layout:
    numel: int
    world_size: int
    group_size: int

    @property
    def padded_numel(self) -> int:
        chunk = self.world_size * self.group_size
        return max(1, math.ceil(self.numel / chunk)) * chunk

    @property
    def segment_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def groups_per_segment(self) -> int:
        return self.segment_numel // self.group_size


def to_segments(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """[R, ...] input -> fp32 [R, P, groups_per_segment, g] (flattened per rank, zero padded)."""
    R = x.shape[0]
    flat = x.reshape(R, -1).float()
    pad = layout.padded_numel - flat.shape[1]
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(R, layout.world_size, layout.groups_per_segment, layout.group_size)


def from_segments(seg: torch.Tensor, layout: Layout, shape, dtype) -> torch.Tensor:
    """Inverse of :func:`to_segments` for one result: [P, G, g] fp32 -> ``shape`` in ``dtype``.

    Finite values beyond ``dtype``'s range saturate to its largest finite value (finite in, finite out:
    two fp16 ranks at 32736 sum to 65472, which the 4-bit codes may carry a little past 65504, and a
    plain cast would make inf); NaN and infinities pass unchanged.
    """
    flat = seg.reshape(-1)[: layout.numel]
    if dtype in (torch.float16, torch.bfloat16):
        big = torch.finfo(dtype).max
        flat = torch.where(torch.isfinite(flat), flat.clamp(-big, big), flat)
    return flat.reshape(shape).to(dtype)


def rotate_if(seg: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    if not spec.rotation:
        return seg
    return Q.rotate(seg.reshape(-1, spec.group_size)).view(seg.shape)


def unrotate_if(seg: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    if not spec.rotation:
        return seg
    return Q.unrotate(seg.reshape(-1, spec.group_size)).view(seg.shape)


def pow2_exponent(amax, mode=True) -> int:
    """k such that amax * 2^k lies in [2^(kPow2Target-1), 2^kPow2Target); 0 for 0 or non-finite, for
    mode False, and for mode "auto" with amax inside [kAutoLow, kAutoHigh)."""
    a = float(amax)
    if mode is False or not math.isfinite(a) or a == 0.0:
        return 0
    if mode == "auto" and kAutoLow <= a < kAutoHigh:
        return 0
    _, e = math.frexp(a)  # a = m 2^e, m in [0.5, 1)
    return max(-126, min(126, kPow2Target - e))


# Range without rescaling (pow2_rescale=False, issue 35). A call whose message the group parameters
# cannot express is never silent: ``range_flags`` finds it from what the call quantized, ``note_range``
# counts it here (this process's calls) and logs one warning naming the setting that avoids it.
#   clipped: a finite group has a value more than half a step beyond its grid's end (its scale hit the
#       format's largest value: fp16 65504, the packed 12-bit 65280), so its error exceeds the stated
#       bound s/2 (quant.step_bound);
#   underflow: the largest group a rank quantized (its sent segments and the one it reduced) is nonzero
#       but its scale is below fp16's smallest normal value, 2^-14 (the packed scale shares fp16's
#       exponents): the scale then rounds up on the subnormal grid, so the whole message is quantized on a
#       coarser grid than its values need (relative error up to 50 % above an in-range message's at 1e-6,
#       4 bits), and below the smallest subnormal scale it is flushed to zero.
# "auto" and True rescale instead (neither can clip; "auto" leaves no message below 2^-6 unscaled).


@dataclass
class RangeEvents:
    """Calls made with pow2_rescale=False whose message the format could not express, in this process
    (the emulator counts a call once for all its ranks; the reference counts what this rank quantized)."""

    clipped_calls: int = 0
    underflow_calls: int = 0


range_events = RangeEvents()


# fp16's smallest normal value: a group scale below it loses relative precision (and the packed
# format's scale, fp16 without its low mantissa bits, has the same exponents).
kFp16MinNormal = 2.0**-14


def range_flags(seg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: QuantSpec):
    """Per rank, (clipped, underflow) bool [R] of fp32 groups ``seg`` [R, ..., g] quantized under (scale,
    zero) [R, ...] fp16 (see RangeEvents). Non-finite groups (NaN scale) count as neither."""
    R = scale.shape[0]
    mn, mx, finite = Q.group_range(seg.reshape(-1, spec.group_size))
    s, z = scale.reshape(-1).float(), zero.reshape(-1).float()
    q_min = 1.0 if spec.quantizer == "symmetric" else 0.0
    half = 0.5 * s
    beyond = finite & ((mx > (float(2**spec.bits - 1) - z) * s + half) | (mn < (q_min - z) * s - half))
    amax = torch.where(finite, torch.maximum(mn.abs(), mx.abs()), torch.zeros_like(mn)).view(R, -1)
    # The largest group's scale; of groups tied at the largest max |v|, the largest scale (the kernels
    # take the maximum of (max |v|, scale) pairs, csrc/p2p_all_reduce.cuh watch_range).
    top = amax.amax(dim=1, keepdim=True)
    top_scale = torch.where(amax == top, s.view(R, -1), torch.zeros_like(amax)).amax(dim=1)
    underflow = (top.view(R) > 0) & (top_scale < kFp16MinNormal)
    return beyond.view(R, -1).any(dim=1), underflow


def note_rank_range(values, scales, zeros, spec: QuantSpec, where: str) -> None:
    """One rank's range events of a call without rescaling (range_flags over everything it quantized: the
    pieces ``values`` [..., g] fp32, quantized under ``scales`` and ``zeros`` [...]), counted and warned
    about (note_range). The reference and the tests' torch stages pass their sent segments and the one reduced."""
    g = spec.group_size
    seg = torch.cat([v.reshape(-1, g) for v in values])[None]
    scale = torch.cat([s.reshape(-1) for s in scales])[None]
    zero = torch.cat([z.reshape(-1) for z in zeros])[None]
    clipped, underflow = range_flags(seg, scale, zero, spec)
    note_range(bool(clipped), bool(underflow), spec.bits, where)


def note_range(clipped: int, underflow: int, bits: int, where: str) -> None:
    """Count range events (RangeEvents: ``clipped`` and ``underflow`` calls, a bool for one call) and warn
    once per kind, naming the setting."""
    from echo_ds.log import log_once

    range_events.clipped_calls += int(clipped)
    range_events.underflow_calls += int(underflow)
    for kind, count in (("clipped", clipped), ("underflow", underflow)):
        if not count:
            continue
        what = ("values beyond what its group scales express were clipped (the format's largest scale "
                "cannot reach them)" if kind == "clipped" else
                "values are below what its group scales resolve (a scale below fp16's smallest normal value), "
                "so they were quantized coarsely or flushed to zero")
        log_once("warning",
                 f"echo: {where} with pow2_rescale=False: a message's {what}; its result is off by more than the "
                 f"{bits}-bit format's bound. Set pow2_rescale to \"auto\" (the config keys "
                 f"echo.forward.pow2_rescale / echo.backward.pow2_rescale) to rescale such messages by an exact "
                 f"power of two. Counted in echo_ds.algorithm.range_events (and EchoStats under DeepSpeed); "
                 f"this warning is shown once.", key=f"echo-range-{kind}", rank=0)


def quantize_segments(seg: torch.Tensor, spec: QuantSpec):
    """Quantize fp32 [..., G, g] -> (codes [..., G, g*b/8] uint8, scale [..., G] fp16, zero fp16)."""
    lead = seg.shape[:-1]
    codes, scale, zero = Q.quantize_groups(seg.reshape(-1, spec.group_size), spec.bits, spec.quantizer)
    return codes.view(*lead, -1), scale.view(lead), zero.view(lead)


def dequantize_segments(codes, scale, zero, spec: QuantSpec) -> torch.Tensor:
    lead = scale.shape
    values = Q.dequantize_groups(codes.reshape(-1, codes.shape[-1]), scale.reshape(-1), zero.reshape(-1),
                                 spec.bits)
    return values.view(*lead, spec.group_size)


def ordered_sum(terms: torch.Tensor) -> torch.Tensor:
    """fp32 sum over dim 0 in index order, ((t0 + t1) + t2) + ...: the owner's high-precision sum.

    terms: [P, ...] the P copies of a segment in rank order, the owner's own copy unquantized at the
    owner's index. The order is fixed so that the kernels reproduce it bit for bit.
    """
    acc = terms[0].clone()
    for r in range(1, terms.shape[0]):
        acc = acc + terms[r]
    return acc


def output_residual(r: torch.Tensor, s_hat: torch.Tensor, world_size: int) -> torch.Tensor:
    """The compensator's residual "output": u = r - s_hat / P.

    r: x' = rotate(x) + c, fp32 [..., P, G, g] (the rank axes of the caller in front); s_hat: the call's
    result before the unrotation, fp32 [P, G, g], broadcast over r's leading axes. The division by P is
    the product by its fp32 reciprocal (quant.reciprocal).
    """
    return r - s_hat * Q.reciprocal(world_size)


def local_residual(rs: torch.Tensor, sent: torch.Tensor, own, s_hat_scaled_own: torch.Tensor, acc: torch.Tensor,
                   sent_index=None, down=None) -> torch.Tensor:
    """The compensator's residual "local": u = -(err 2^-k), err the rounding error of what a rank quantized.

    err = dequantize(sent codes) - rs on the segments a rank sends, s_hat_scaled - acc on the segment it
    owns (its reduced value against its fp32 sum, both scaled by 2^k).

    rs: x' 2^k, fp32 [..., P, G, g]; sent: the dequantized codes of the sent segments, rs[sent_index]'s
    shape, or rs's whole shape when ``sent_index`` is None (its owned entries are then overwritten);
    own: the index of the owned segment(s) in rs; s_hat_scaled_own, acc: the owned segment(s)' reduced
    value and fp32 sum, rs[own]'s shape; down: 2^-k (a float or an fp32 tensor), None for no rescaling.
    """
    if sent_index is None:
        err = sent - rs
    else:
        err = torch.empty_like(rs)
        err[sent_index] = sent - rs[sent_index]
    err[own] = s_hat_scaled_own - acc
    return -(err * down) if down is not None else -err
