"""Group-wise b-bit quantizers with fp16 per-group parameters (section 4.3 of the Echo paper).

Every value of a group of ``group_size`` (g) consecutive elements is sent as a b-bit code ``q`` together
with two fp16 parameters of the group, a scale ``s`` and a zero-point ``z`` (in code units). Every quantizer
decodes with the same affine map::

    x_hat = (q - z) * s                      (fp32: one subtraction, then one multiplication)

and encodes with the parameters *after* their fp16 rounding, so that every rank that decodes the codes
gets the same values::

    inv = 1 / s                              (fp32 division)
    q   = clip(rint(x * inv + z), q_min, 2^b - 1)

Quantizers (``quantizer``):

``"symmetric"`` (equation 8)
    ``s = max|x| / (2^(b-1) - 1)``, ``z = 2^(b-1)``, codes ``1 .. 2^b - 1`` (the most negative code is
    never used, so the levels are symmetric about zero and 0 is exact).
``"naive"`` (equation 9 anchored at the group minimum)
    ``s = (max - min) / (2^b - 1)``, ``z = -min / s``: the grid spans exactly the group's range and 0
    generally falls between two codes.
``"zero_aware"`` (section 4.3)
    When the group straddles zero, the zero-point is moved to the nearest integer in [1, 2^b - 2] and
    the scale widened just enough that the whole range stays on the grid, so 0 is exact. When the group
    lies on one side of zero, more than one code away from it, the naive map is used. In between (a
    one-sided group within one code of zero) the zero-point blends continuously from the naive value to
    the straddling limit. See ``_zero_aware_params``.
``"zero_aware_int"`` (issue 20: g = 64 in 4.25 bits per value)
    The zero-aware grid with an integer zero-point ``z`` in [0, 2^b - 1], so that a group's two
    parameters share 16 bits on the wire: ``z`` in b bits and the scale in the other 16 - b, an unsigned
    float with fp16's exponent and its top 11 - b mantissa bits (4-bit codes: a 12-bit scale and a 4-bit
    zero-point, half the parameter bytes of the fp16 pair). A group that straddles zero takes the
    zero-aware integer zero-point and scale; a group on one side of zero (all-zero groups included)
    puts 0 at the grid's end, ``z = 0`` and ``s = max / (2^b - 1)`` (or ``z = 2^b - 1`` and
    ``s = -min / (2^b - 1)``), since a zero-point outside [0, 2^b - 1] cannot be sent. 0 is exact in every
    group. The scale is rounded up to the packed format. See ``_integer_zero_params`` and
    ``pack_params``.

Numerics contract (the CUDA kernels reproduce it bit for bit, so the operation order matters):

* All arithmetic is fp32, every operation rounded to nearest even, no fused multiply-add.
* The scale is rounded *up* to fp16 (never below what the range needs), clamped to the largest finite
  fp16 (65504: values beyond ``65504 * (2^b - 1)`` in range saturate to the grid's ends instead of
  producing inf) and to at least the smallest fp16 subnormal (2^-24, so a scale never underflows to 0).
* For the asymmetric quantizers the scale is at least ``max|x| / 1024``, which keeps ``|z| <= 1024`` so
  the fp16 zero-point is exact to a quarter code; below that ratio the group is narrower than fp16's own
  resolution of its values.
* A group that holds a NaN or an infinity gets scale NaN and codes 0: it decodes to NaN in full, so
  non-finite values propagate (DeepSpeed's loss scaler then sees the overflow) instead of becoming a
  silent finite number.
* Padding (the last group of a length that is not a multiple of g) is zeros.
* ``"zero_aware_int"``'s scale is rounded up to its 16 - b bit format instead of fp16 (an exact carry
  into the exponent), clamped to [2^(b - 25), the format's largest value] (4-bit: [2^-21, 65280]).

Error bound, per element of a finite group: ``|x_hat - x| <= s/2 + ulp16(z) s`` plus fp32 rounding,
where the middle term is 0 whenever z is an integer by construction (symmetric, and zero-aware groups
that straddle 0). ``step_bound`` returns it per group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, get_args

import torch

# The quantizers, in the order of their codes: a quantizer's code is its index here (the kernels' Quantizer
# enum, csrc/echo_api.cuh; echo_ds.ops.kernels.QUANTIZER_CODES; the call descriptors). Append, never reorder.
Quantizer = Literal["zero_aware", "symmetric", "naive", "zero_aware_int"]
QUANTIZERS = get_args(Quantizer)
# Quantizers whose scale and zero-point share one 16-bit word on the wire (pack_params).
PACKED_QUANTIZERS = ("zero_aware_int",)
SUPPORTED_BITS = (4, 8)
# Group sizes: the powers of two in [MIN_GROUP_SIZE, MAX_GROUP_SIZE] (is_group_size); the CUDA kernels take
# a subset (echo_ds.ops.kernels.SUPPORTED_GROUP_SIZES).
MIN_GROUP_SIZE = 16
MAX_GROUP_SIZE = 4096

kFp16Max = 65504.0
kFp16MinSubnormal = 2.0**-24
# Asymmetric scales stay >= max|x| / kMaxZeroPoint so that |z| <= kMaxZeroPoint codes (fp16 ulp <= 1/2).
kMaxZeroPoint = 1024.0


def f32(v: float) -> float:
    """``v`` rounded to fp32, so that a Python scalar enters the fp32 arithmetic exactly."""
    return float(torch.tensor(v, dtype=torch.float32))


def reciprocal(c: float) -> float:
    """fp32 1/c. Divisions by a constant are written as products by it: PyTorch on a GPU computes
    ``tensor / scalar`` that way, on the CPU it divides, and the two differ in the last bit."""
    return f32(1.0 / c)


def is_group_size(group_size) -> bool:
    """Whether ``group_size`` is a group size the quantizer takes."""
    return (isinstance(group_size, int) and MIN_GROUP_SIZE <= group_size <= MAX_GROUP_SIZE
            and group_size & (group_size - 1) == 0)


def check_quant_args(bits: int, group_size: int, quantizer: str) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported: use one of {SUPPORTED_BITS}")
    if not is_group_size(group_size):
        raise ValueError(f"group_size={group_size!r} must be a power of two in "
                         f"[{MIN_GROUP_SIZE}, {MAX_GROUP_SIZE}]")
    if quantizer not in QUANTIZERS:
        raise ValueError(f"quantizer={quantizer!r} is not one of {QUANTIZERS}")


@dataclass(frozen=True)
class QuantSpec:
    """Quantizer settings of one collective call: bit width b, group size g, quantizer, rotation."""

    bits: int = 4
    group_size: int = 128
    quantizer: str = "zero_aware"
    rotation: bool = False

    def __post_init__(self):
        # Types first: True is an int and 4.0 == 4, and any non-empty string (even "none") is truthy.
        for name in ("bits", "group_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"QuantSpec: {name}={value!r} must be an int")
        if not isinstance(self.quantizer, str):
            raise TypeError(f"QuantSpec: quantizer={self.quantizer!r} must be one of {QUANTIZERS}")
        if not isinstance(self.rotation, bool):
            raise TypeError(f"QuantSpec: rotation={self.rotation!r} must be True or False")
        check_quant_args(self.bits, self.group_size, self.quantizer)

    def wire_bytes(self, numel: int) -> int:
        return wire_bytes(numel, self.bits, self.group_size, self.quantizer)

    @property
    def bits_per_value(self) -> float:
        """Bits on the wire per value of a whole group: codes plus the group's parameters."""
        return 8.0 * group_wire_bytes(self.bits, self.group_size, self.quantizer) / self.group_size


@dataclass(frozen=True)
class Quantized:
    """Codes and per-group parameters of a quantized tensor.

    codes: uint8, shape [num_groups, group_size * bits // 8] (4-bit codes packed two per byte: element
        2k in the low nibble of byte k, element 2k + 1 in the high nibble).
    scale, zero: float16, shape [num_groups].
    numel: number of real (unpadded) elements; shape: the original shape.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    numel: int
    shape: tuple
    quantizer: str = "zero_aware"

    @property
    def num_groups(self) -> int:
        return self.scale.numel()

    @property
    def wire_bytes(self) -> int:
        """Bytes this tensor takes on the wire: codes plus the parameters of every group."""
        return self.num_groups * group_wire_bytes(self.bits, self.group_size, self.quantizer)


# ----------------------------------------------------------------------------------------------------
# Sizes on the wire
# ----------------------------------------------------------------------------------------------------

# Bytes of a group's parameters: its fp16 scale and its fp16 zero-point, or one packed 16-bit word.
kParamBytesPerGroup = 4
kPackedParamBytesPerGroup = 2


def param_bytes(quantizer: str = "zero_aware") -> int:
    """Bytes of one group's parameters on the wire."""
    return kPackedParamBytesPerGroup if quantizer in PACKED_QUANTIZERS else kParamBytesPerGroup


def group_code_bytes(bits: int, group_size: int) -> int:
    """Bytes of one group's packed codes: g b / 8."""
    return group_size * bits // 8


def group_wire_bytes(bits: int, group_size: int, quantizer: str = "zero_aware") -> int:
    """Bytes of one group on the wire: g b / 8 code bytes plus its parameters (param_bytes)."""
    return group_code_bytes(bits, group_size) + param_bytes(quantizer)


def wire_bytes(numel: int, bits: int, group_size: int, quantizer: str = "zero_aware") -> int:
    """Bytes of ``numel`` elements quantized at ``bits``, group_size values and one parameter set per group."""
    num_groups = -(-numel // group_size)
    return num_groups * group_wire_bytes(bits, group_size, quantizer)


# ----------------------------------------------------------------------------------------------------
# fp16 parameter rounding
# ----------------------------------------------------------------------------------------------------

def fp16_round_up(s: torch.Tensor) -> torch.Tensor:
    """Smallest fp16 value >= s, for s in [0, 65504] (NaN stays NaN). Matches ``__float2half_ru``."""
    h = s.to(torch.float16)
    below = h.float() < s
    bits = h.view(torch.int16) + below.to(torch.int16)
    return bits.view(torch.float16)


def _group_scale(raw: torch.Tensor) -> torch.Tensor:
    """fp32 scale -> fp16 scale: clamp to [2^-24, 65504], round up. NaN propagates."""
    raw = torch.clamp(raw, min=kFp16MinSubnormal, max=kFp16Max)
    return fp16_round_up(raw)


def _levels(bits: int) -> float:
    return float(2**bits - 1)


def group_range(groups: torch.Tensor):
    """(min, max, finite) per group of ``groups`` (fp32 [num_groups, g]); a group with a NaN or an
    infinity is not finite, and its min and max read 0."""
    mn = groups.amin(dim=1)
    mx = groups.amax(dim=1)
    finite = torch.isfinite(mn) & torch.isfinite(mx)
    zero_f = torch.zeros_like(mn)
    return torch.where(finite, mn, zero_f), torch.where(finite, mx, zero_f), finite


def compute_params(groups: torch.Tensor, bits: int, quantizer: str):
    """Per-group fp16 (scale, zero) of ``groups`` (fp32, shape [num_groups, g]).

    Returns (scale fp16 [num_groups], zero fp16 [num_groups], finite bool [num_groups]).
    """
    mn, mx, finite = group_range(groups)
    amax = torch.maximum(mn.abs(), mx.abs())
    L = _levels(bits)

    if quantizer == "symmetric":
        qmax = float(2 ** (bits - 1) - 1)
        scale = _group_scale(amax * reciprocal(qmax))
        zero = torch.full_like(scale, float(2 ** (bits - 1)))
    elif quantizer == "zero_aware_int":
        s0 = torch.maximum((mx - mn) * reciprocal(L), amax * reciprocal(kMaxZeroPoint))
        scale, zero = _integer_zero_params(mn, mx, s0, L, bits)
    else:
        # Naive scale, floored so that |zero| <= kMaxZeroPoint codes.
        s0 = torch.maximum((mx - mn) * reciprocal(L), amax * reciprocal(kMaxZeroPoint))
        if quantizer == "naive":
            scale = _group_scale(s0)
            zero = (-mn / scale.float()).to(torch.float16)
        else:
            scale, zero = _zero_aware_params(mn, mx, s0, L)
    nan = torch.full_like(scale, float("nan"))
    scale = torch.where(finite, scale, nan)
    return scale, zero, finite


def _zero_aware_params(mn, mx, s0, L):
    """Zero-aware (scale, zero) per group; mn, mx, s0 (the floored naive scale) fp32 [num_groups].

    * straddling (mn < 0 < mx): z is an integer in [1, L - 1], so 0 is exact, and the scale is widened
      to cover both ends, s(z) = max(-mn / z, mx / (L - z)). Of the two integers around z0 = -mn / s0
      the one with the smaller s(z) is taken (floor on a tie): the plain nearest integer can cost up to
      half a code of range on each side (s = 1.5 s0 at z0 = 1.5), this choice at most one code in all.
    * one-sided within one code of 0 (0 <= mn < s0, or -s0 < mx <= 0): the zero-point moves from the
      naive value z0 = -mn / s0 (w = 0, one code away) to the straddling limit 1 (or L - 1) (w = 1, at 0),
      z = z0 + w (1 - z0) with w = 1 - mn / s0, and the scale covers the far end: s = mx / (L - z)
      (negative side: w = 1 + mx / s0, z = z0 + w ((L - 1) - z0), s = -mn / z).
    * otherwise the naive map: s = s0, z = -mn / s.
    Every branch keeps [mn, mx] on the grid, and the map is continuous across the branches.
    """
    straddle = (mn < 0) & (mx > 0)
    pos_blend = (mn >= 0) & (mn < s0)
    neg_blend = (mx <= 0) & (-mx < s0)
    z0 = -mn / s0
    zs, ss = _straddle_params(mn, mx, s0, L)

    wp = 1.0 - mn / s0
    zp = z0 + wp * (1.0 - z0)
    sp = mx / (L - zp)

    wn = 1.0 + mx / s0
    zn = z0 + wn * ((L - 1.0) - z0)
    sn = -mn / zn

    raw = torch.where(straddle, ss, torch.where(pos_blend, sp, torch.where(neg_blend, sn, s0)))
    scale = _group_scale(raw)
    naive_zero = -mn / scale.float()
    zero = torch.where(straddle, zs, torch.where(pos_blend, zp, torch.where(neg_blend, zn, naive_zero)))
    return scale, zero.to(torch.float16)


def _straddle_params(mn, mx, s0, L):
    """(z, raw scale) of a group that straddles 0 (mn < 0 < mx): of the two integers around
    z0 = -mn / s0 in [1, L - 1], the one whose widened scale s(z) = max(-mn / z, mx / (L - z)) is smaller
    (floor on a tie). Computed for every group; meaningful where the group straddles."""
    z0 = -mn / s0
    zf = torch.clamp(torch.floor(z0), 1.0, L - 1.0)
    zc = torch.clamp(torch.ceil(z0), 1.0, L - 1.0)
    sf = torch.maximum(-mn / zf, mx / (L - zf))
    sc = torch.maximum(-mn / zc, mx / (L - zc))
    use_ceil = sc < sf
    return torch.where(use_ceil, zc, zf), torch.where(use_ceil, sc, sf)


def _integer_zero_params(mn, mx, s0, L, bits):
    """"zero_aware_int" (scale, zero) per group: the zero-aware integer choice where the group straddles 0,
    else 0 at the end of the grid on the group's side (z = 0, s = mx / L; or z = L, s = -mn / L; an all-zero
    group takes the first). The scale rounds up to the packed format (packed_scale), which keeps the whole
    range on the grid under the same z."""
    straddle = (mn < 0) & (mx > 0)
    negative = (mx <= 0) & (mn < 0)
    zs, ss = _straddle_params(mn, mx, s0, L)
    inv_l = reciprocal(L)
    raw = torch.where(straddle, ss, torch.where(negative, -mn * inv_l, mx * inv_l))
    zero = torch.where(straddle, zs, torch.where(negative, torch.full_like(zs, L), torch.zeros_like(zs)))
    return packed_scale(raw, bits), zero.to(torch.float16)


# ----------------------------------------------------------------------------------------------------
# The packed parameter word of "zero_aware_int"
# ----------------------------------------------------------------------------------------------------

def _packed_drop(bits: int) -> int:
    """fp16 mantissa bits the packed scale drops: the zero-point takes b bits and fp16's sign bit is free."""
    return bits - 1


def packed_scale_range(bits: int):
    """(smallest, largest) scale of the packed format: the smallest subnormal and the largest finite
    value of fp16 with ``bits - 1`` low mantissa bits dropped (4-bit: 2^-21 and 65280)."""
    d = _packed_drop(bits)
    largest = torch.tensor(0x7C00 - (1 << d), dtype=torch.int16).view(torch.float16).item()
    return 2.0 ** (d - 24), float(largest)


def packed_scale(raw: torch.Tensor, bits: int) -> torch.Tensor:
    """Smallest packed-format scale >= raw (fp32 in, fp16 out holding it; NaN stays NaN): clamp to the
    format's range, round up to fp16, then round the bit pattern up to a multiple of 2^(b - 1), which
    carries into the exponent exactly. The packed grid is part of fp16's, so this is the ceiling of raw."""
    lo, hi = packed_scale_range(bits)
    h = fp16_round_up(torch.clamp(raw, min=lo, max=hi))
    m = (1 << _packed_drop(bits)) - 1
    b = (h.view(torch.int16).to(torch.int32) + m) & ~m
    out = b.to(torch.int16).view(torch.float16)
    return torch.where(torch.isnan(raw), torch.full_like(out, float("nan")), out)


def pack_params(scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """The 16-bit wire words (int32 values in [0, 2^16)) of packed-format (scale, zero), fp16 each: the
    scale's fp16 bits without the sign and the dropped mantissa bits, above the zero-point's b bits.
    A NaN scale (a non-finite group) stays a NaN after unpack_params."""
    h = scale.contiguous().view(torch.int16).to(torch.int32) & 0x7FFF
    z = zero.float().to(torch.int32)
    return ((h >> _packed_drop(bits)) << bits) | z


def unpack_params(words: torch.Tensor, bits: int):
    """(scale fp16, zero fp16) of packed words (any integer dtype holding the 16 bits)."""
    w = words.to(torch.int32) & 0xFFFF
    h = ((w >> bits) << _packed_drop(bits)).to(torch.int16).view(torch.float16)
    z = (w & ((1 << bits) - 1)).to(torch.float16)
    return h, z


# ----------------------------------------------------------------------------------------------------
# Codes
# ----------------------------------------------------------------------------------------------------

def encode(groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, finite: torch.Tensor,
           bits: int, quantizer: str) -> torch.Tensor:
    """Integer codes (uint8, [num_groups, g], unpacked) of fp32 ``groups`` under fp16 parameters."""
    inv = 1.0 / scale.float()
    t = groups * inv[:, None]
    t = t + zero.float()[:, None]
    q = torch.round(t)
    q_min = 1.0 if quantizer == "symmetric" else 0.0
    q = torch.clamp(q, q_min, _levels(bits))
    q = torch.where(finite[:, None], q, torch.zeros_like(q))
    return q.to(torch.uint8)


def decode(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """fp32 values of unpacked codes ``q`` ([num_groups, g] uint8) under fp16 (scale, zero)."""
    return (q.float() - zero.float()[:, None]) * scale.float()[:, None]


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[num_groups, g] uint8 codes -> packed bytes (two 4-bit codes per byte, low nibble first)."""
    if bits == 8:
        return q
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes
    lo = codes & 0x0F
    hi = codes >> 4
    return torch.stack((lo, hi), dim=-1).reshape(codes.shape[0], -1)


# ----------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------

def to_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Flatten to fp32 and zero-pad to a whole number of groups: shape [num_groups, group_size]."""
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % group_size
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, group_size)


def quantize_groups(groups: torch.Tensor, bits: int, quantizer: str):
    """(packed codes, scale, zero) of fp32 ``groups`` [num_groups, g]."""
    scale, zero, finite = compute_params(groups, bits, quantizer)
    q = encode(groups, scale, zero, finite, bits, quantizer)
    return pack(q, bits), scale, zero


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 [num_groups, g] values of packed codes."""
    return decode(unpack(codes, bits), scale, zero)


def quantize(x: torch.Tensor, bits: int = 4, group_size: int = 128,
             quantizer: Quantizer = "zero_aware") -> Quantized:
    """Quantize ``x`` (any shape; fp32, bf16 or fp16) group-wise along its flattened order."""
    check_quant_args(bits, group_size, quantizer)
    if not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point tensor, got {x.dtype}")
    groups = to_groups(x, group_size)
    codes, scale, zero = quantize_groups(groups, bits, quantizer)
    return Quantized(codes, scale, zero, bits, group_size, x.numel(), tuple(x.shape), quantizer)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values a peer receiving ``q`` reconstructs, in ``dtype`` and the original shape."""
    values = dequantize_groups(q.codes, q.scale, q.zero, q.bits).reshape(-1)[: q.numel]
    return values.reshape(q.shape).to(dtype)


def fake_quantize(x: torch.Tensor, bits: int = 4, group_size: int = 128,
                  quantizer: Quantizer = "zero_aware") -> torch.Tensor:
    """The quantize-dequantize round trip of ``x``, in ``x``'s dtype and shape."""
    return dequantize(quantize(x, bits, group_size, quantizer), x.dtype)


def step_bound(q: Quantized) -> torch.Tensor:
    """Per-group bound on |x_hat - x| (fp32 [num_groups]), derived from the stored parameters.

    Rounding to the nearest code costs s/2. A zero-point that is not an integer by construction (naive
    groups, one-sided zero-aware groups, the blend zone) was rounded to fp16, which shifts the grid by at
    most half an fp16 ulp of z; rounding the scale up against a fixed non-integer z (the blend zone,
    |z| <= 1) moves the grid's near end by at most |z| 2^-11 s: one ulp of z covers both. The encode and decode arithmetic is fp32 on values of at most
    (2^b - 1 + |z|) codes, which a relative slack of 2^-22 on that magnitude covers.
    """
    s = q.scale.float()
    z = q.zero.float()
    L = _levels(q.bits)
    integral = z == torch.round(z)
    if q.quantizer in ("symmetric", "zero_aware_int"):
        exact_zero = torch.ones_like(integral)
    elif q.quantizer == "zero_aware":
        exact_zero = integral & (z >= 1) & (z <= L - 1)
    else:
        exact_zero = torch.zeros_like(integral)
    z_shift = torch.where(exact_zero, torch.zeros_like(z), _fp16_ulp(z))
    return (0.5 + z_shift + (L + z.abs()) * 2.0**-22) * s


def _fp16_ulp(z: torch.Tensor) -> torch.Tensor:
    a = z.abs().clamp(min=2.0**-14)
    return torch.exp2(torch.floor(torch.log2(a)) - 10)


# ----------------------------------------------------------------------------------------------------
# Randomized Hadamard rotation of each group
# ----------------------------------------------------------------------------------------------------

kHadamardSeed = 0x5EED_EC40


@lru_cache(maxsize=None)
def _hadamard_signs_cpu(group_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(kHadamardSeed)
    bits = torch.randint(0, 2, (group_size,), generator=gen)
    return (1.0 - 2.0 * bits).to(torch.float32)


def hadamard_signs(group_size: int, device=None) -> torch.Tensor:
    """The fixed +-1 diagonal D of the rotation (fp32 [g]), identical on every rank and process."""
    return _hadamard_signs_cpu(group_size).to(device)


def hadamard_norm(group_size: int) -> float:
    """1/sqrt(g) rounded to fp32 (the kernels receive the same constant)."""
    return float(torch.tensor(1.0 / math.sqrt(group_size), dtype=torch.float32))


def _fwht(groups: torch.Tensor) -> torch.Tensor:
    """Unnormalised fast Walsh-Hadamard transform along the last dim, butterflies h = 1, 2, 4, ...

    Stage h pairs element i with i + h inside blocks of 2h and writes (a + b, a - b). The kernels run the
    same stages in the same order, so the result is bit-identical.
    """
    n, g = groups.shape
    y = groups
    h = 1
    while h < g:
        y = y.view(n, g // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).reshape(n, g)
        h *= 2
    return y


def rotate(groups: torch.Tensor) -> torch.Tensor:
    """Forward rotation of fp32 groups [n, g]: (H (D x)) / sqrt(g), H the Walsh-Hadamard matrix."""
    g = groups.shape[1]
    return _fwht(groups * hadamard_signs(g, groups.device)) * hadamard_norm(g)


def unrotate(groups: torch.Tensor) -> torch.Tensor:
    """Inverse rotation: D (H y) / sqrt(g) (H is symmetric and H H = g I)."""
    g = groups.shape[1]
    return (_fwht(groups) * hadamard_norm(g)) * hadamard_signs(g, groups.device)
