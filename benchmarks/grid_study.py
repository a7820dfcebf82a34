"""Non-uniform 4-bit grids for the rotated messages (issue 20, second lever).

Today's 4-bit format puts 16 evenly spaced levels on each group's [min, max] (zero-aware, fp16 scale +
fp16 zero-point, 4.25 bits/value at g = 128). After the Hadamard rotation a group's values are close to
Gaussian, for which evenly spaced levels are not the best use of 16 codes: a grid denser near 0 and
sparser in the tails has a lower mean squared error. This study replaces the grid, not the rest of the
collective:

    g128_uniform        today's default: zero-aware uniform, fp16 scale + fp16 zero          4.25 bits
    g64_nf4             g = 64, QLoRA's NF4 levels (16 Gaussian quantiles normalised to
                        [-1, 1], 7 negative, an exact 0, 8 positive), scale = the group's
                        max|x| as fp16 rounded up (nothing clips), no zero-point           4.25 bits
    g64_lloyd           g = 64, the same absmax scale, levels = LLOYD_ABSMAX_POS[64]: Lloyd-Max
                        table fitted once to x / max|x| of real rotated messages (symmetric,
                        +-1 kept as levels, no 0 level: 8 levels a side)                  4.25 bits
    g128_lloyd2         g = 128, two fp16 scales: the group's max (for x >= 0) and -min (for
                        x < 0), both rounded up; levels = LLOYD_TWO_SIDED_POS[128], Lloyd-Max
                        fitted to x / max (x >= 0) and x / -min (x < 0)                    4.25 bits

    not in the default set (--variants):
    g64_uniform         today's grid at g = 64                                              4.50 bits
    g64_lloyd2          the two-sided Lloyd-Max grid at g = 64, two fp16 scales             4.50 bits
    g64_lloyd2_16b      the same levels at g = 64 with both scales in 16 bits: the larger
                        side's scale S with fp16's exponent and 5 mantissa bits (10 bits,
                        rounded up), 1 bit for which side that is, and 5 bits k in 1..32
                        giving the other side's scale S k / 32 (the smallest that covers it) 4.25 bits
    g128_nf4, g128_lloyd (absmax at g = 128, 4.125 bits), g64_nf4_2s, g128_nf4_2s (NF4 levels with
    two fp16 scales, 4.5 and 4.25 bits).

The grids (study only, not in the library). A group x (fp32, g values) gets a per-group scale (two
for the two-sided variants) and 4-bit codes into a fixed table of 16 fp32 levels in [-1, 1]:

* absmax scale: s = fp16_round_up(clamp(max|x|, 2^-24, 65504)), so |x| / s <= 1: nothing clips
  (beyond 65504 the ends saturate, as the library's scale does).
* two-sided scales: s+ = the same of max(x) (x >= 0 uses it), s- = the same of -min(x) (x < 0 uses
  it); an unused side (a one-sided group) gets 2^-24. A negative level decodes with s-, 0 and the
  positive levels with s+, so both ends of the group are levels and 0 stays 0 (where the table has it).
* encode: t = x * (1 / s) in fp32 (the side's s for two-sided), code = the nearest level (the
  midpoints between adjacent levels are the decision thresholds; a tie goes to the lower level).
* decode: x_hat = level[code] * s (fp32; the level's side's s for two-sided).
* a group with a NaN or an infinity gets scale NaN and codes 0, so it decodes to NaN (as the library).

The Lloyd-Max tables were fitted once (``--fit``, printed, then pasted below) on the first 1024 tokens
of twelfth_night.txt (a play that is none of the three evaluated texts): two 512-token passes per group
size with the library's default config at that g, 0.5 % of the groups of every quantization call (the segments
the ranks send and the owners' sums; seeded), the first half of the sampled groups fitted, the second
half kept to report each format's error, per group (the mean over groups of |x_hat - x|^2 / |x|^2) and
by energy (sum |x_hat - x|^2 / sum |x|^2, which the few groups of largest magnitude dominate), and how
Gaussian the groups are (``group_shape``; ``--fit --json PATH`` saves all of it). Each table is
fitted on |t| (t = x / scale), 8 levels with the top one fixed at 1 (so a group's extreme value is
exact), 500 Lloyd iterations from evenly spaced levels, and mirrored.

Implementation: the study process replaces ``echo_ds.quant.quantize_groups`` and
``dequantize_groups`` (the emulator reaches them through ``echo_ds.algorithm``'s module attribute
lookups ``Q.quantize_groups`` / ``Q.dequantize_groups``, at every call) with dispatchers that apply the
grid of the variant being evaluated (the library's own functions for the uniform variant and for any
8-bit call), and ``echo_ds.quant.wire_bytes`` (looked up by the emulator's wire statistics) with one
that counts the variant's parameter bytes per group (4 for uniform, 2 for one fp16 scale, 4 for two).
The compensator's "local" residual is -(dequantize(quantize(x)) - x) of those same calls, so it
follows the grid. The library files are not modified.

Everything else is as in benchmarks/param_format_study.py: SmolLM2-135M in float32 on the CPU,
emulated TP at P = 4 over the 60 forward sites, the default Echo config (Hadamard rotation, residual
"local", gain 1.0, compensator reset per sequence) with only the group size and the grid changed;
perplexity, KL(p_16bit || p) and top-1 agreement against the 16-bit model on every predicted position
of the first 4096 tokens of the default held-out text (The Tempest), macbeth.txt and hamlet.txt.
Run from the repository root (CPU, 2 cores shared with test suites, 2026-12-04: the fit 1 to 4 min,
the default four variants 15 min, the two 4.5-bit ones 17 min, g64_lloyd2_16b 5 min; docs/accuracy.md,
"Non-uniform 4-bit grid"):

    python benchmarks/grid_study.py --self-check        # the grids' invariants only (seconds)
    python benchmarks/grid_study.py --fit --json docs/results/grid_study_fit.json
    python benchmarks/grid_study.py --json docs/results/grid_study.json
    python benchmarks/grid_study.py --variants g64_uniform,g64_lloyd2 \
        --json docs/results/grid_study_g64_4p5.json
    python benchmarks/grid_study.py --variants g64_lloyd2_16b \
        --json docs/results/grid_study_g64_lloyd2_16b.json

Each variant's result in the JSON carries "grid_stats", counted over every quantization call: the
groups quantized by the study's grid (so a run shows that the patched functions were the ones
called), and the share of codes per level.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import accuracy_study as AS  # benchmarks/: puts the repository on sys.path
from echo_ds import algorithm as A
from echo_ds import quant as Q
from echo_ds.config import EchoConfig
from echo_ds.eval import perplexity as PPL
from echo_ds.eval.tp_emulation import TPEmulator

kFitFile = "twelfth_night.txt"
kFitTokens = 1024
kFitSampleFraction = 0.005
kFitSeed = 20

# QLoRA's NF4 table (bitsandbytes, ``NF4`` data type): 7 negative levels, 0, 8 positive, in [-1, 1].
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0)

# Lloyd-Max tables (``--fit``), the 8 positive levels; the table is them mirrored (no 0 level).
# absmax: fitted to x / max|x|; two-sided: to x / max (x >= 0) and x / -min (x < 0).
LLOYD_ABSMAX_POS = {
    64: (0.0493, 0.1491, 0.2515, 0.3601, 0.4785, 0.613, 0.7772, 1.0),
    128: (0.0474, 0.143, 0.2425, 0.3478, 0.4642, 0.5981, 0.7637, 1.0),
}
LLOYD_TWO_SIDED_POS = {
    64: (0.052, 0.1566, 0.2639, 0.3772, 0.4999, 0.637, 0.7982, 1.0),
    128: (0.0493, 0.1489, 0.2527, 0.3624, 0.4827, 0.6179, 0.781, 1.0),
}


def mirrored(pos) -> tuple:
    return tuple(-v for v in reversed(pos)) + tuple(pos)


# name -> (group_size, grid, scale mode); grid "uniform" is the library's zero-aware quantizer.
VARIANTS = {
    "g128_uniform": (128, "uniform", "zero_aware"),
    "g64_uniform": (64, "uniform", "zero_aware"),
    "g64_nf4": (64, "nf4", "absmax"),
    "g64_lloyd": (64, "lloyd_absmax_64", "absmax"),
    "g128_lloyd2": (128, "lloyd_two_sided_128", "two_sided"),
    "g128_nf4": (128, "nf4", "absmax"),
    "g128_lloyd": (128, "lloyd_absmax_128", "absmax"),
    "g64_nf4_2s": (64, "nf4", "two_sided"),
    "g128_nf4_2s": (128, "nf4", "two_sided"),
    "g64_lloyd2": (64, "lloyd_two_sided_64", "two_sided"),
    "g64_lloyd2_16b": (64, "lloyd_two_sided_64", "two_sided_16b"),
}
DEFAULT_VARIANTS = ("g128_uniform", "g64_nf4", "g64_lloyd", "g128_lloyd2")
PARAM_BYTES = {"zero_aware": 4, "absmax": 2, "two_sided": 4, "two_sided_16b": 2}   # per group on the wire
TWO_SIDED = ("two_sided", "two_sided_16b")
# two_sided_16b: the larger side's scale with fp16's exponent and 5 mantissa bits (10 bits), rounded up.
kS10Min = 2.0**-19      # smallest subnormal: mantissa 1 of 5 bits
kS10Max = 64512.0       # exponent 30, mantissa all ones
kRatioSteps = 32        # the smaller side's scale: S k / 32, k in 1..32 (5 bits)


def grid_tables() -> dict:
    tables = {"nf4": NF4}
    for g, pos in LLOYD_ABSMAX_POS.items():
        tables[f"lloyd_absmax_{g}"] = mirrored(pos)
    for g, pos in LLOYD_TWO_SIDED_POS.items():
        tables[f"lloyd_two_sided_{g}"] = mirrored(pos)
    return tables


GRIDS = grid_tables()

_original = {"quantize_groups": Q.quantize_groups, "dequantize_groups": Q.dequantize_groups,
             "wire_bytes": Q.wire_bytes}
_state = {"variant": None, "grid": "uniform", "mode": "zero_aware"}   # set by StudyEmulator.set_config
_stats = {}   # variant name -> {"groups": n, "code_counts": [16]}


# ----------------------------------------------------------------------------------------------------
# The grids
# ----------------------------------------------------------------------------------------------------

def levels_of(grid: str) -> torch.Tensor:
    return torch.tensor(GRIDS[grid], dtype=torch.float32)


def thresholds_of(levels: torch.Tensor) -> torch.Tensor:
    """Decision thresholds: the fp32 midpoints of adjacent levels."""
    return (levels[1:] + levels[:-1]) * 0.5


def fp16_scale(v: torch.Tensor) -> torch.Tensor:
    """Smallest fp16 >= v, v clamped to [2^-24, 65504] (as the library's scales); NaN stays NaN."""
    return Q.fp16_round_up(torch.clamp(v, min=Q.kFp16MinSubnormal, max=Q.kFp16Max))


def s10_round_up(v: torch.Tensor) -> torch.Tensor:
    """Smallest value >= v (clamped to [2^-19, 64512]) with fp16's exponent and 5 mantissa bits (fp32)."""
    h = Q.fp16_round_up(torch.clamp(v, min=kS10Min, max=kS10Max))
    bits = h.view(torch.int16).to(torch.int32)
    bits = (bits + 31) & ~31                     # ceiling to 5 mantissa bits, carry into the exponent
    return bits.to(torch.int16).view(torch.float16).float()


def grid_params(groups: torch.Tensor, mode: str):
    """(scale, second, finite) of fp32 groups [n, g]: absmax (scale fp16, second = 0, not sent),
    two-sided (scale = s+ for x >= 0, second = s- for x < 0, both fp16) or two-sided in 16 bits
    (s+ and s- as fp32 tensors holding what the 16 bits encode: S = the larger side's max|x| rounded up to
    10 bits, one bit for which side it is, and k in 1..32 with the other side's scale S k / 32, the
    smallest such scale that covers that side; S k / 32 is exact in fp32)."""
    mn, mx, finite = Q.group_range(groups)
    nan = torch.full_like(mn, float("nan")).to(torch.float16)
    if mode == "absmax":
        scale = fp16_scale(torch.maximum(mn.abs(), mx.abs()))
        second = torch.zeros_like(scale)
    elif mode == "two_sided":
        scale = fp16_scale(torch.clamp(mx, min=0.0))
        second = fp16_scale(torch.clamp(-mn, min=0.0))
        second = torch.where(finite, second, nan)
    else:
        pos, neg = torch.clamp(mx, min=0.0), torch.clamp(-mn, min=0.0)
        pos_big = pos >= neg
        big = s10_round_up(torch.maximum(pos, neg))
        small = torch.where(pos_big, neg, pos)
        k = torch.clamp(torch.ceil(small / big * float(kRatioSteps)), 1.0, float(kRatioSteps))
        other = big * (k * (1.0 / kRatioSteps))
        nan = nan.float()
        scale = torch.where(pos_big, big, other)
        second = torch.where(finite, torch.where(pos_big, other, big), nan)
    return torch.where(finite, scale, nan), second, finite


def grid_encode(groups, scale, second, finite, levels, mode) -> torch.Tensor:
    """Codes (uint8 [n, g], unpacked): index of the nearest level to x / s (fp32)."""
    inv = 1.0 / scale.float()
    t = groups * inv[:, None]
    if mode in TWO_SIDED:
        inv_neg = 1.0 / second.float()
        t = torch.where(groups < 0, groups * inv_neg[:, None], t)
    q = torch.bucketize(t, thresholds_of(levels))
    q = torch.where(finite[:, None], q, torch.zeros_like(q))
    return q.to(torch.uint8)


def grid_decode(q, scale, second, levels, mode) -> torch.Tensor:
    lv = levels[q.long()]
    s = scale.float()[:, None]
    if mode in TWO_SIDED:
        s = torch.where(lv < 0, second.float()[:, None], s)
    return lv * s


def study_quantize_groups(groups: torch.Tensor, bits: int, quantizer: str):
    if _state["grid"] == "uniform" or bits != 4:
        return _original["quantize_groups"](groups, bits, quantizer)
    levels = levels_of(_state["grid"]).to(groups.device)
    scale, second, finite = grid_params(groups, _state["mode"])
    q = grid_encode(groups, scale, second, finite, levels, _state["mode"])
    st = _stats.setdefault(_state["variant"], {"groups": 0, "code_counts": [0] * 16})
    st["groups"] += int(finite.sum())
    counts = torch.bincount(q[finite].reshape(-1).long(), minlength=16)
    st["code_counts"] = [a + int(b) for a, b in zip(st["code_counts"], counts)]
    return Q.pack(q, bits), scale, second


def study_dequantize_groups(codes, scale, zero, bits: int):
    if _state["grid"] == "uniform" or bits != 4:
        return _original["dequantize_groups"](codes, scale, zero, bits)
    levels = levels_of(_state["grid"]).to(codes.device)
    return grid_decode(Q.unpack(codes, bits), scale, zero, levels, _state["mode"])


def study_wire_bytes(numel: int, bits: int, group_size: int, quantizer: str = "zero_aware") -> int:
    if bits != 4:
        return _original["wire_bytes"](numel, bits, group_size)
    num_groups = -(-numel // group_size)
    return num_groups * (group_size * bits // 8 + PARAM_BYTES[_state["mode"]])


def fake_quant(groups: torch.Tensor, grid: str, mode: str) -> torch.Tensor:
    """dequantize(quantize(groups)) under ``grid`` and ``mode`` ("uniform": the library's)."""
    if grid == "uniform":
        c, s, z = _original["quantize_groups"](groups, 4, "zero_aware")
        return _original["dequantize_groups"](c, s, z, 4)
    levels = levels_of(grid)
    scale, second, finite = grid_params(groups, mode)
    return grid_decode(grid_encode(groups, scale, second, finite, levels, mode), scale, second, levels, mode)


# ----------------------------------------------------------------------------------------------------
# Self-check
# ----------------------------------------------------------------------------------------------------

def self_check() -> None:
    """The grids' invariants (raises on failure)."""
    for name, table in GRIDS.items():
        lv = levels_of(name)
        assert lv.numel() == 16, f"{name}: {lv.numel()} levels"
        assert bool((lv[1:] > lv[:-1]).all()), f"{name}: levels not strictly increasing"
        assert float(lv[0]) == -1.0 and float(lv[-1]) == 1.0, f"{name}: the ends are not -1 and +1"
        if name == "nf4":
            assert bool((lv == 0).any()), "nf4: no exact 0 level"
        else:
            assert bool((lv == -lv.flip(0)).all()), f"{name}: not symmetric"
    torch.manual_seed(0)
    for name in GRIDS:
        lv = levels_of(name)
        half_gap = float((lv[1:] - lv[:-1]).max()) / 2
        for mode in ("absmax",) + TWO_SIDED:
            # 1. A value exactly on the grid comes back as that level's code, for many scales.
            def fp16_scales():
                s = (torch.rand(2048) * 8 - 4).exp2().to(torch.float16)    # fp16 scales in [1/16, 16]
                return torch.where(torch.rand(2048) < 0.5, s,
                                   (torch.rand(2048) * 35 - 20).exp2().to(torch.float16)).float()
            s_pos = fp16_scales()
            s_neg = s_pos if mode == "absmax" else fp16_scales()
            if mode == "two_sided_16b":
                big = s10_round_up(s_pos)
                other = big * (torch.randint(1, kRatioSteps + 1, (2048,)).float() / kRatioSteps)
                pos_big = torch.rand(2048) < 0.5
                s_pos, s_neg = torch.where(pos_big, big, other), torch.where(pos_big, other, big)
            codes = torch.randint(0, 16, (2048, 64))
            codes[:, 0], codes[:, 1] = 0, 15                               # both ends present
            x = torch.where(lv[codes] < 0, lv[codes] * s_neg[:, None], lv[codes] * s_pos[:, None])
            sc, sec, finite = grid_params(x, mode)
            assert bool((sc.float() == s_pos).all()), f"{name}/{mode}: the scale of an on-grid group is not its own"
            if mode in TWO_SIDED:
                assert bool((sec.float() == s_neg).all()), f"{name}/{mode}: s- of an on-grid group is not its own"
            q = grid_encode(x, sc, sec, finite, lv, mode)
            assert bool((q.long() == codes).all()), f"{name}/{mode}: quantize(level * scale) != level"
            assert bool((grid_decode(q, sc, sec, lv, mode) == x).all()), f"{name}/{mode}: round trip not exact"
            # 2. Random groups: nothing clips (error <= half the widest gap times the scale).
            y = torch.randn(4096, 64) * torch.exp2(torch.rand(4096, 1) * 32 - 20)   # no saturation
            y[:256] = y[:256].abs()                                        # one-sided groups
            y[256:512] = -y[256:512].abs()
            sc, sec, finite = grid_params(y, mode)
            s_neg_used = sc.float() if mode == "absmax" else sec.float()
            assert bool((sc.float() >= y.amax(1).clamp(min=0)).all() and (s_neg_used >= -y.amin(1)).all()), \
                f"{name}/{mode}: a scale does not cover its side of the group"
            yh = grid_decode(grid_encode(y, sc, sec, finite, lv, mode), sc, sec, lv, mode)
            side = sc.float()[:, None] if mode == "absmax" else torch.where(y < 0, sec.float()[:, None],
                                                                            sc.float()[:, None])
            assert bool(((yh - y).abs() <= side * (half_gap + 2.0**-20)).all()), f"{name}/{mode}: a value clipped"
            nz = y != 0
            assert bool((torch.sign(yh) == torch.sign(y))[nz & (yh != 0)].all()), f"{name}/{mode}: sign flip"
            # 3. Non-finite groups decode to NaN; an all-zero group decodes to (about) zero.
            z = torch.zeros(3, 64)
            z[1, 5] = float("nan")
            z[2, 7] = float("inf")
            sc, sec, finite = grid_params(z, mode)
            zh = grid_decode(grid_encode(z, sc, sec, finite, lv, mode), sc, sec, lv, mode)
            assert bool(torch.isnan(zh[1:]).all()), f"{name}/{mode}: a non-finite group does not decode to NaN"
            assert bool((zh[0].abs() <= kS10Min).all()), f"{name}/{mode}: a zero group is not ~0"
            if name == "nf4":
                assert bool((zh[0] == 0).all()), "nf4: a zero group is not exactly 0"
    # 4. The emulator's calls reach the patched functions: algorithm's quantize/dequantize under a grid.
    saved = dict(_state), Q.quantize_groups, Q.dequantize_groups
    try:
        Q.quantize_groups, Q.dequantize_groups = study_quantize_groups, study_dequantize_groups
        _state.update(variant="self-check", grid="nf4", mode="absmax")
        spec = Q.QuantSpec(bits=4, group_size=64, rotation=True)
        seg = torch.randn(2, 3, 64)
        got = A.dequantize_segments(*A.quantize_segments(seg, spec), spec)
        assert torch.equal(got.reshape(-1, 64), fake_quant(seg.reshape(-1, 64), "nf4", "absmax")), \
            "the emulator's algorithm does not reach the patched quantizer"
        assert _stats["self-check"]["groups"] == 6, "the grid's call was not counted"
    finally:
        _state.clear()
        _state.update(saved[0])
        Q.quantize_groups, Q.dequantize_groups = saved[1], saved[2]
        _stats.clear()


# ----------------------------------------------------------------------------------------------------
# Lloyd-Max fit
# ----------------------------------------------------------------------------------------------------

def lloyd_positive(a: torch.Tensor, iters: int = 500) -> torch.Tensor:
    """8 levels in (0, 1] for the magnitudes ``a`` (fp32, in [0, 1]), the top one fixed at 1."""
    lv = torch.linspace(1.0 / 16, 1.0, 8)
    for _ in range(iters):
        idx = torch.bucketize(a, thresholds_of(lv))
        s = torch.zeros(8, dtype=torch.float64).index_add_(0, idx, a.double())
        n = torch.zeros(8, dtype=torch.float64).index_add_(0, idx, torch.ones_like(a, dtype=torch.float64))
        new = torch.where(n > 0, s / n.clamp(min=1), lv.double()).float()
        new[-1] = 1.0
        lv = new.sort().values
    return lv


def mean_group_nmse(x: torch.Tensor, xh: torch.Tensor) -> float:
    return float((((xh - x) ** 2).sum(1) / (x ** 2).sum(1)).mean())


def energy_nmse(x: torch.Tensor, xh: torch.Tensor) -> float:
    return float(((xh - x) ** 2).sum() / (x ** 2).sum())


def group_shape(x: torch.Tensor) -> dict:
    """How Gaussian the groups are: median kurtosis (3 for a Gaussian, 1.8 for a uniform law) and the
    share of values with |x| > 0.8 max|x|, for the 1 % of groups with the largest sum x^2 and the rest."""
    energy = (x ** 2).sum(1)
    order = energy.argsort(descending=True)
    top, rest = order[: max(1, len(order) // 100)], order[max(1, len(order) // 100):]

    def stats(sel):
        xs = x[sel]
        xc = xs - xs.mean(1, keepdim=True)
        kurt = (xc ** 4).mean(1) / (xc ** 2).mean(1) ** 2
        near_max = (xs.abs() > 0.8 * xs.abs().amax(1, keepdim=True)).float().mean()
        return dict(groups=len(sel), energy_share=float(energy[sel].sum() / energy.sum()),
                    median_kurtosis=float(kurt.median()), share_above_0p8_absmax=float(near_max))

    return dict(top_1pct_energy=stats(top), rest=stats(rest))


def fit(args) -> int:
    from echo_ds.eval.models import load_model

    loaded = load_model("smollm2", dtype=torch.float32, device="cpu")
    text = PPL.read_text(AS.corpus_path(kFitFile))
    sequences = PPL.tokenize_sequences(loaded.tokenizer, text, kFitTokens, args.seq_len)
    gen = torch.Generator().manual_seed(kFitSeed)
    sample = {64: [], 128: []}

    def sampling_quantize_groups(groups, bits, quantizer):
        n = groups.shape[0]
        idx = torch.randperm(n, generator=gen)[: max(1, int(n * kFitSampleFraction))]
        sample[groups.shape[1]].append(groups[idx].clone())
        return _original["quantize_groups"](groups, bits, quantizer)

    Q.quantize_groups = sampling_quantize_groups
    base = EchoConfig()
    start = time.perf_counter()
    with TPEmulator(loaded.model, args.tp) as tp, torch.inference_mode():
        for g in sample:
            tp.set_config(AS.config_with(base, group_size=g))
            for seq in sequences:
                tp.begin_pass()
                loaded.model(input_ids=seq[None], use_cache=False)
    Q.quantize_groups = _original["quantize_groups"]
    seconds = time.perf_counter() - start
    print(f"fit sample: {kFitFile}, first {kFitTokens} tokens, {seconds:.0f} s")
    out = {}
    for g, parts in sample.items():
        x = torch.cat(parts)
        x = x[torch.isfinite(x).all(1) & (x.abs().amax(1) > 0)]
        half = x.shape[0] // 2
        xf, xt = x[:half], x[half:]
        t_abs = (xf / xf.abs().amax(1, keepdim=True)).reshape(-1)
        mx, mn = xf.amax(1, keepdim=True), xf.amin(1, keepdim=True)
        t_two = torch.where(xf >= 0, xf / mx.clamp(min=1e-30), xf / (-mn).clamp(min=1e-30)).reshape(-1)
        pos_abs = lloyd_positive(t_abs.abs())
        pos_two = lloyd_positive(t_two.abs())
        print(f"\ng = {g}: {x.shape[0]} groups sampled ({half} fitted, {x.shape[0] - half} held out)")
        print(f"  LLOYD_ABSMAX_POS[{g}] = {tuple(round(v, 4) for v in pos_abs.tolist())}")
        print(f"  LLOYD_TWO_SIDED_POS[{g}] = {tuple(round(v, 4) for v in pos_two.tolist())}")
        GRIDS[f"fit_abs_{g}"] = mirrored(tuple(pos_abs.tolist()))
        GRIDS[f"fit_two_{g}"] = mirrored(tuple(pos_two.tolist()))
        rows = [("uniform zero-aware (today)", "uniform", "zero_aware"), ("NF4, absmax", "nf4", "absmax"),
                ("NF4, two-sided", "nf4", "two_sided"), ("Lloyd absmax (this fit)", f"fit_abs_{g}", "absmax"),
                ("Lloyd two-sided (this fit)", f"fit_two_{g}", "two_sided"),
                ("Lloyd two-sided, 16-bit params (this fit)", f"fit_two_{g}", "two_sided_16b"),
                ("Lloyd absmax (table in use)", f"lloyd_absmax_{g}", "absmax"),
                ("Lloyd two-sided (table in use)", f"lloyd_two_sided_{g}", "two_sided")]
        out[g] = dict(groups_sampled=x.shape[0], groups_fitted=half,
                      absmax_table_pos=pos_abs.tolist(), two_sided_table_pos=pos_two.tolist(),
                      shape=group_shape(xt), errors={})
        print(f"  held-out groups: {out[g]['shape']}")
        print("  held-out error: per-group = mean over groups of |x_hat - x|^2 / |x|^2; "
              "energy = sum |x_hat - x|^2 / sum |x|^2")
        for label, grid, mode in rows:
            xh = fake_quant(xt, grid, mode)
            e = dict(per_group=mean_group_nmse(xt, xh), energy=energy_nmse(xt, xh))
            out[g]["errors"][label] = e
            print(f"    {label:32s} per-group {e['per_group']:.5f}   energy {e['energy']:.5f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(fit_text="shakespeare/" + kFitFile, fit_tokens=kFitTokens,
                                                   sample_fraction=kFitSampleFraction, seed=kFitSeed,
                                                   seconds=seconds, per_group_size=out), indent=1) + "\n")
    return 0


# ----------------------------------------------------------------------------------------------------
# Emulation
# ----------------------------------------------------------------------------------------------------

def switch(setting) -> None:
    """Install a variant's (name, grid, scale mode); None: the 16-bit baseline (never reached)."""
    _state["variant"], _state["grid"], _state["mode"] = setting or (None, "uniform", "zero_aware")


def make_variant(name: str, base: EchoConfig):
    g, grid, mode = VARIANTS[name]
    return AS.config_with(base, group_size=g), f"g={g}, grid {grid}, scale {mode}", (name, grid, mode)


def annotate(r: dict) -> None:
    g, grid, mode = VARIANTS[r["name"]]
    r.update(group_size=g, grid=grid, scale_mode=mode, levels=list(GRIDS[grid]) if grid in GRIDS else None)
    st = _stats.get(r["name"])
    if st:
        total = sum(st["code_counts"])
        r["grid_stats"] = dict(groups=st["groups"], code_share=[c / total for c in st["code_counts"]])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    AS.add_arguments(ap, VARIANTS, DEFAULT_VARIANTS)
    ap.add_argument("--self-check", action="store_true", help="check the grids and exit")
    ap.add_argument("--fit", action="store_true", help="fit the Lloyd-Max tables, print them and exit")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    self_check()
    if args.self_check:
        print("self-check passed:", ", ".join(GRIDS))
        return 0
    if args.fit:
        return fit(args)
    names = AS.variant_names(args, VARIANTS)
    Q.quantize_groups = study_quantize_groups
    Q.dequantize_groups = study_dequantize_groups
    Q.wire_bytes = study_wire_bytes
    return AS.run(args, names, make_variant, switch, annotate, _stats.clear, dict(
        variants={n: dict(zip(("group_size", "grid", "scale_mode"), VARIANTS[n])) for n in names},
        grids={k: list(v) for k, v in GRIDS.items()}, param_bytes_per_group=PARAM_BYTES))


if __name__ == "__main__":
    raise SystemExit(main())
