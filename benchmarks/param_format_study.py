"""Cheaper per-group parameters so that g = 64 fits 4.25 bits per value (issue 20, first lever).

Today's quantizer sends, per group of g values, the 4-bit codes plus an fp16 scale and an fp16 zero-point
(32 bits): 4.25 bits/value at g = 128, 4.5 at g = 64. This study keeps g = 64 and spends 16 bits per group
on the parameters instead, 64 x 4 + 16 = 272 bits = 4.25 bits/value, and measures what that costs:

    g128_fp16           today's default: zero-aware, Hadamard, fp16 scale + fp16 zero        4.25 bits
    g64_fp16            the same at g = 64                                                    4.50 bits
    g64_ue5m3_int8      g = 64; scale as an unsigned 8-bit float "ue5m3" (fp16's 5-bit exponent,
                        bias 15, and the top 3 of its 10 mantissa bits; no sign: a scale is >= 0),
                        rounded UP; zero-point an 8-bit signed integer (int8)                 4.25 bits
    g64_symmetric_fp16  g = 64, the library's "symmetric" quantizer: fp16 scale, the zero-point is
                        the constant 2^(b-1) and is not sent                                   4.25 bits
    g128_ue5m3_int8     the 8 + 8 bit format at g = 128 (how much of the change is the format)  4.125 bits
    g64_ue5m7_uint4     g = 64; scale "ue5m7" (12 bits: the top 7 mantissa bits), rounded UP;
                        zero-point a 4-bit unsigned integer in [0, 15] (not in the default set:
                        --variants g64_ue5m7_uint4)                                           4.25 bits

The ue5m3 + int8 format (study only, not in the library; ue5m7 + uint4 is the same with 7 mantissa bits,
range [2^-21, 65280], and z in [0, 15]; see IntZeroFormat). The library's zero-aware parameters (s, z) of
a group are computed first (``echo_ds.quant.compute_params``, unchanged), then:

* scale: s8 = the smallest ue5m3 value >= s. ue5m3 is fp16 with the 7 low mantissa bits dropped, so
  s8 = fp16_round_up(s) with its bit pattern rounded up to a multiple of 2^7 (an exact carry into the
  exponent). Range [2^-17 (subnormal), 61440]; a scale below 2^-17 becomes 2^-17 (the library's floor is
  fp16's 2^-24), one above 61440 saturates to it (the library's ceiling is 65504). Exponent field 31 is
  kept for NaN (a non-finite group still decodes to NaN in full).
* zero-point: an integer z in [-128, 127] that keeps the whole group [min, max] on the grid under s8:
  ceil(-min / s8) <= z <= floor(2^b - 1 - max / s8). Of those integers the one nearest to the library's z
  is taken. For a group that straddles 0 the library's z is already an integer in [1, 14] and stays
  feasible under any s8 >= s, so it is kept unchanged (0 stays exact). A one-sided group, whose
  library z is fractional, may find no feasible integer (or none in int8's range) under s8: its s8 is
  first floored where the zero-point's range demands it (max / (2^b - 1 - zmin), -min / zmax), then
  raised to the next ue5m3 value until one exists (counted in "bumped" below). Nothing clips: the
  codes still cover [min, max] up to fp32 rounding.
* encode and decode are the library's own (q = clip(rint(x / s + z)), x_hat = (q - z) s, fp32), fed
  with these parameters (stored as fp16 tensors, which hold every ue5m3 value and every int8 exactly).

Implementation: the study process replaces ``echo_ds.quant.compute_params`` (looked up by
``quantize_groups`` at call time) with a dispatcher that applies the format of the variant being
evaluated, and ``echo_ds.quant.wire_bytes`` (looked up by the emulator's wire statistics) with one that
counts that format's parameter bytes per group (4 for fp16 + fp16, 2 for ue5m3 + int8 and for ue5m7 +
uint4, 2 for symmetric with the constant zero-point unsent). The library files are not modified.

Everything else is ``python -m echo_ds.eval perplexity`` (echo_ds.eval.perplexity.evaluate): SmolLM2-135M
in float32 on the CPU, emulated TP at P = 4 over the 60 forward sites, the default Echo config (Hadamard
rotation, zero-aware, residual "local", gain 1.0, compensator reset per sequence) with only the group
size, the quantizer and the parameter format changed; perplexity, KL(p_16bit || p) and top-1
agreement against the 16-bit model on every predicted position. Texts: the default held-out text
(PPL.kDefaultText; its first 4096 tokens are all The Tempest), and the first 4096 tokens of macbeth.txt
and hamlet.txt from the shared corpus. Run from the repository root (CPU; 14 min for the default five
variants, 7 min for the one extra, on 2 cores shared with a test suite, 2026-12-04):

    python benchmarks/param_format_study.py --json docs/results/param_format_study.json
    python benchmarks/param_format_study.py --variants g64_ue5m7_uint4 \
        --json docs/results/param_format_study_ue5m7_uint4.json

The integer-zero variants carry "format_stats" in the JSON, counted over every quantization call (the
segments each rank sends and the owners' re-quantization, all sequences): the finite groups quantized,
those whose ue5m3 scale had to be bumped past the round-up to admit an integer zero-point ("bumped"),
those at the saturated (largest) scale, the groups that straddle 0, the straddling groups whose
zero-point differs from the library's (0 by construction), and the sum of the ratios of the scale used to
the library's fp16 scale of the same group (mean_scale_ratio = that sum / groups).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

import accuracy_study as AS  # benchmarks/: puts the repository on sys.path
from echo_ds import quant as Q
from echo_ds.config import EchoConfig

# name -> (group_size, quantizer, parameter format)
VARIANTS = {
    "g128_fp16": (128, "zero_aware", "fp16"),
    "g64_fp16": (64, "zero_aware", "fp16"),
    "g64_ue5m3_int8": (64, "zero_aware", "ue5m3_int8"),
    "g64_symmetric_fp16": (64, "symmetric", "fp16_nozero"),
    "g128_ue5m3_int8": (128, "zero_aware", "ue5m3_int8"),
    "g64_ue5m7_uint4": (64, "zero_aware", "ue5m7_uint4"),
    # The library's quantizer "zero_aware_int" (the study's ue5m7 + uint4 made exact in closed form):
    "g64_zero_aware_int": (64, "zero_aware_int", "packed"),
    "g128_zero_aware_int": (128, "zero_aware_int", "packed"),
    "g32_zero_aware_int": (32, "zero_aware_int", "packed"),
    # 8-bit codes (a 4th field: the bit width; 4 otherwise): today's g = 128 fp16 pair against the packed
    # format at g = 64 (an 8-bit zero-point and an 8-bit scale with 3 mantissa bits), both 8.25 bits
    "g128_fp16_8bit": (128, "zero_aware", "fp16", 8),
    "g64_zero_aware_int_8bit": (64, "zero_aware_int", "packed", 8),
}
DEFAULT_VARIANTS = ("g128_fp16", "g64_fp16", "g64_ue5m3_int8", "g64_symmetric_fp16", "g128_ue5m3_int8")
# Parameter bytes per group on the wire, per format.
PARAM_BYTES = {"fp16": 4, "ue5m3_int8": 2, "ue5m7_uint4": 2, "fp16_nozero": 2, "packed": 2}


@dataclass(frozen=True)
class IntZeroFormat:
    """An unsigned float scale with fp16's 5-bit exponent (bias 15) and ``mantissa_bits`` of its mantissa,
    and an integer zero-point in [zmin, zmax]."""

    mantissa_bits: int
    zmin: float
    zmax: float

    @property
    def drop(self) -> int:          # fp16 mantissa bits dropped
        return 10 - self.mantissa_bits

    @property
    def max_scale(self) -> float:   # exponent 15, mantissa all ones
        return float(torch.tensor(0x7C00 - (1 << self.drop), dtype=torch.int16).view(torch.float16))

    @property
    def min_scale(self) -> float:   # smallest subnormal
        return 2.0 ** (-14 - self.mantissa_bits)


INT_ZERO_FORMATS = {
    "ue5m3_int8": IntZeroFormat(3, -128.0, 127.0),   # 8-bit scale + 8-bit zero
    "ue5m7_uint4": IntZeroFormat(7, 0.0, 15.0),      # 12-bit scale + 4-bit zero
}
_original_compute_params = Q.compute_params
_original_wire_bytes = Q.wire_bytes
_state = {"format": "fp16", "variant": None}  # the variant being evaluated (set by StudyEmulator)
_stats = {}                   # variant name -> counters of the integer-zero formats


# ----------------------------------------------------------------------------------------------------
# The integer-zero parameter formats (ue5m3 + int8, ue5m7 + uint4)
# ----------------------------------------------------------------------------------------------------

def scale_round_up(s: torch.Tensor, fmt: IntZeroFormat) -> torch.Tensor:
    """Smallest value of ``fmt``'s scale >= s (fp32 in, fp16 out holding it); NaN stays NaN."""
    s = torch.clamp(s, min=fmt.min_scale, max=fmt.max_scale)
    h = Q.fp16_round_up(s)                       # smallest fp16 >= s (exact ceiling)
    bits = h.view(torch.int16).to(torch.int32)
    m = (1 << fmt.drop) - 1
    bits = (bits + m) & ~m                       # ceiling to the kept mantissa bits, carry into the exponent
    out = bits.to(torch.int16).view(torch.float16)
    return torch.where(torch.isnan(s), torch.full_like(out, float("nan")), out)


def scale_next_up(s8: torch.Tensor, fmt: IntZeroFormat) -> torch.Tensor:
    """The next value of ``fmt``'s scale above s8 (saturating at the largest)."""
    bits = s8.view(torch.int16).to(torch.int32) + (1 << fmt.drop)
    out = bits.to(torch.int16).view(torch.float16)
    return torch.where(out.float() > fmt.max_scale, s8, out)


def on_scale_grid(s8: torch.Tensor, fmt: IntZeroFormat) -> torch.Tensor:
    bits = s8.view(torch.int16).to(torch.int32)
    return (bits & ((1 << fmt.drop) - 1)) == 0


def int_zero_params(groups: torch.Tensor, bits: int, quantizer: str, fmt_name: str = "ue5m3_int8"):
    """(scale, zero, finite) in an integer-zero format, from the library's zero-aware parameters."""
    fmt = INT_ZERO_FORMATS[fmt_name]
    scale16, zero16, finite = _original_compute_params(groups, bits, quantizer)
    mn = groups.amin(dim=1)
    mx = groups.amax(dim=1)
    zf = torch.zeros_like(mn)
    mn = torch.where(finite, mn, zf)
    mx = torch.where(finite, mx, zf)
    L = float(2**bits - 1)
    # Necessary for a zero-point in [zmin, zmax] (a no-op for every group straddling 0): the grid's top
    # (L - z) s >= mx with z >= zmin, and its bottom -z s <= mn with z <= zmax.
    floor = torch.maximum(mx / (L - fmt.zmin), -mn / fmt.zmax) if fmt.zmax > 0 else mx / (L - fmt.zmin)
    s8 = scale_round_up(torch.maximum(scale16.float(), floor), fmt)
    z_lib = zero16.float()
    bumped = torch.zeros_like(finite)
    for _ in range(256):
        s = s8.float()
        lo = torch.clamp(torch.ceil(-mn / s), min=fmt.zmin)
        hi = torch.clamp(torch.floor(L - mx / s), max=fmt.zmax)
        bad = finite & (lo > hi) & (s < fmt.max_scale)
        if not bool(bad.any()):
            break
        bumped |= bad
        s8 = torch.where(bad, scale_next_up(s8, fmt), s8)
    else:
        raise RuntimeError("int_zero_params: no feasible integer zero-point after 256 bumps")
    # Nearest integer to the library's zero-point inside [lo, hi] (an empty range only at the saturated
    # scale: then the clamp takes hi, and the group's far end clips, as the library's saturation does).
    z = torch.minimum(torch.maximum(torch.round(z_lib), lo), hi)
    z = torch.where(finite, z, torch.zeros_like(z))
    scale = torch.where(finite, s8, torch.full_like(s8, float("nan")))
    st = _stats.setdefault(_state["variant"], {"groups": 0, "bumped": 0, "scale_ratio_sum": 0.0,
                                               "straddle": 0, "straddle_zero_changed": 0, "saturated": 0})
    st["groups"] += int(finite.sum())
    st["bumped"] += int(bumped.sum())
    st["saturated"] += int((finite & (s8.float() >= fmt.max_scale)).sum())
    ratio = s8.float() / scale16.float()
    st["scale_ratio_sum"] += float(ratio[finite].double().sum())
    straddle = finite & (mn < 0) & (mx > 0)
    st["straddle"] += int(straddle.sum())
    st["straddle_zero_changed"] += int((straddle & (z != z_lib)).sum())
    return scale, z.to(torch.float16), finite


def study_compute_params(groups: torch.Tensor, bits: int, quantizer: str):
    if _state["format"] in INT_ZERO_FORMATS:
        return int_zero_params(groups, bits, quantizer, _state["format"])
    return _original_compute_params(groups, bits, quantizer)


def study_wire_bytes(numel: int, bits: int, group_size: int, quantizer: str = "zero_aware") -> int:
    num_groups = -(-numel // group_size)
    return num_groups * (Q.group_code_bytes(bits, group_size) + PARAM_BYTES[_state["format"]])


def self_check() -> None:
    """The formats' invariants on random groups (raises on failure)."""
    torch.manual_seed(0)
    x = torch.randn(4096, 64) * torch.exp(torch.randn(4096, 1) * 2)
    x[:512] = x[:512].abs() + torch.rand(512, 1) * 10 * x[:512].abs().amax(1, keepdim=True)  # one-sided
    x[512:1024] = -x[512:1024].abs()
    x[1024] = 0.0
    x[1025, 3] = float("nan")
    s16, _, _ = _original_compute_params(x, 4, "zero_aware")
    for name, fmt in INT_ZERO_FORMATS.items():
        s, z, finite = int_zero_params(x, 4, "zero_aware", name)
        ok = finite & (s.float() < fmt.max_scale)
        assert bool(on_scale_grid(s[ok], fmt).all()), f"{name}: scale not on the format's grid"
        assert bool((z[ok] == torch.round(z[ok])).all()), f"{name}: zero not an integer"
        assert bool((z[ok] >= fmt.zmin).all() and (z[ok] <= fmt.zmax).all()), f"{name}: zero out of range"
        q = Q.encode(x, s, z, finite, 4, "zero_aware")
        xh = Q.decode(q, s, z)
        err = (xh - x).abs()[ok]
        bound = (0.5 * s.float()[ok, None]) * (1 + 2.0**-20)
        assert bool((err <= bound + x.abs()[ok].amax() * 2.0**-22).all()), f"{name}: a value clipped"
        assert bool(torch.isnan(xh[1025]).all()), f"{name}: non-finite group does not decode to NaN"
        assert bool((s.float()[ok] >= s16.float()[ok]).all()), f"{name}: scale rounded down"
    _stats.clear()


# ----------------------------------------------------------------------------------------------------
# Emulation
# ----------------------------------------------------------------------------------------------------

def switch(setting) -> None:
    """Install a variant's (name, parameter format); None: the 16-bit baseline (fp16, never reached)."""
    _state["variant"], _state["format"] = setting or (None, "fp16")


def variant_fields(name: str):
    """(group_size, quantizer, parameter format, bits) of a variant (4-bit unless it says otherwise)."""
    fields = VARIANTS[name]
    return fields if len(fields) == 4 else fields + (4,)


def make_variant(name: str, base: EchoConfig):
    g, quantizer, fmt, bits = variant_fields(name)
    return (AS.config_with(base, group_size=g, quantizer=quantizer, bits=bits),
            f"g={g}, {quantizer}, params {fmt}, {bits}-bit", (name, fmt))


def annotate(r: dict) -> None:
    g, quantizer, fmt, bits = variant_fields(r["name"])
    r.update(group_size=g, quantizer=quantizer, param_format=fmt, bits=bits)
    st = _stats.get(r["name"])
    if st:
        r["format_stats"] = dict(st, bumped_share=st["bumped"] / st["groups"],
                                 mean_scale_ratio=st["scale_ratio_sum"] / st["groups"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    AS.add_arguments(ap, VARIANTS, DEFAULT_VARIANTS)
    args = ap.parse_args()
    names = AS.variant_names(args, VARIANTS)
    self_check()
    Q.compute_params = study_compute_params
    Q.wire_bytes = study_wire_bytes
    return AS.run(args, names, make_variant, switch, annotate, _stats.clear, dict(
        variants={n: dict(zip(("group_size", "quantizer", "param_format", "bits"), variant_fields(n))) for n in names},
        param_bytes_per_group=PARAM_BYTES))


if __name__ == "__main__":
    raise SystemExit(main())
