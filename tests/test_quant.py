"""Quantizer properties: exact zero, the per-element step bound, reproducible parameters, packing,
edge cases (zero / constant / tiny / huge / non-finite groups), dtypes, padding, the rotation."""

import math

import pytest
import torch

from echo_ds import quant as Q

BITS = (4, 8)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def activations(num_groups, g, seed):
    """Activation-like groups: peaked at zero, per-group scale, some offset, a few outliers."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_groups, g, generator=gen) * torch.rand(num_groups, 1, generator=gen) * 4
    x = x + torch.randn(num_groups, 1, generator=gen) * (torch.rand(num_groups, 1, generator=gen) < 0.3)
    outliers = torch.rand(num_groups, g, generator=gen) < 0.01
    return torch.where(outliers, x * 20, x)


@pytest.mark.parametrize("quantizer", Q.QUANTIZERS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("g", (16, 64, 128, 256))
def test_error_within_step_bound(quantizer, bits, g):
    x = activations(300, g, seed=bits * 1000 + g)
    q = Q.quantize(x, bits, g, quantizer)
    err = (Q.dequantize(q) - x).abs()
    bound = Q.step_bound(q)[:, None]
    assert torch.all(err <= bound), f"max err/bound {(err / bound).max():.6f}"
    # The bound is tight: some element uses most of its half step.
    assert (err / bound).max() > 0.8


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("quantizer", ("zero_aware", "symmetric"))
def test_zero_is_exact(quantizer, bits):
    x = activations(200, 128, seed=7)
    x[:, ::5] = 0.0
    y = Q.fake_quantize(x, bits, 128, quantizer)
    assert torch.all(y[:, ::5] == 0)


def test_naive_zero_is_not_exact():
    # The property above is a real property of the zero-aware map: the naive one misses 0.
    x = activations(200, 128, seed=7)
    x[:, ::5] = 0.0
    y = Q.fake_quantize(x, 4, 128, "naive")
    assert (y[:, ::5] != 0).float().mean() > 0.5


def test_zero_aware_half_step_on_straddling_groups():
    x = activations(300, 128, seed=3)
    q = Q.quantize(x, 4, 128, "zero_aware")
    straddle = (x.amin(1) < 0) & (x.amax(1) > 0)
    s = q.scale.float()[:, None]
    err = (Q.dequantize(q) - x).abs()
    z = q.zero.float()
    inner = straddle & (z == torch.round(z))
    assert inner.sum() > 100
    assert torch.all(err[inner] <= 0.5 * s[inner] * (1 + 2.0**-18))


@pytest.mark.parametrize("sign", (1.0, -1.0))
def test_zero_aware_is_continuous_across_zero(sign):
    # Slide a group of range ~1 across zero: the scale never jumps, the grid's low end moves smoothly
    # through the one-sided blend zone, and more than one code away from zero the map is exactly the
    # naive one. (Inside the straddling zone the integer zero-point steps by one code as the group
    # slides, by design: 0 stays exact.)
    base = torch.linspace(0.0, 1.0, 128)
    s0 = 1.0 / 15
    prev = None
    for shift in torch.linspace(-2 * s0, 2 * s0, 801):
        x = sign * (base + shift)
        q = Q.quantize(x[None], 4, 128, "zero_aware")
        scale, low = q.scale.float()[0], -q.zero.float()[0] * q.scale.float()[0]
        if prev is not None:
            assert abs(scale - prev[0]) < 2e-3, f"scale jumps at shift {shift:.5f}"
            if shift >= 0:
                assert abs(low - prev[1]) < 2e-3, f"grid jumps at shift {shift:.5f}"
        prev = (scale, low)
        assert q.scale.float()[0] <= s0 * 15 / 14 * 1.001  # at most one code of range lost
        if shift > 1.01 * s0:
            nv = Q.quantize(x[None], 4, 128, "naive")
            assert torch.equal(q.scale, nv.scale) and torch.equal(q.zero, nv.zero)


def test_zero_aware_beats_naive_on_peaked_data():
    x = activations(500, 128, seed=11)
    mse = {p: (Q.fake_quantize(x, 4, 128, p) - x).pow(2).mean().item() for p in Q.QUANTIZERS}
    assert mse["zero_aware"] < mse["naive"]


def reference_encode(x, scale, zero, bits, quantizer):
    """Codes recomputed from the stored fp16 parameters, element by element in double-checked fp32."""
    s = scale.float()[:, None]
    z = zero.float()[:, None]
    t = (x * (1.0 / s)) + z
    q_min = 1 if quantizer == "symmetric" else 0
    return torch.clamp(torch.round(t), q_min, 2**bits - 1).to(torch.uint8)


@pytest.mark.parametrize("quantizer", Q.QUANTIZERS)
@pytest.mark.parametrize("bits", BITS)
def test_codes_follow_the_stored_fp16_parameters(quantizer, bits):
    x = activations(100, 64, seed=5)
    q = Q.quantize(x, bits, 64, quantizer)
    assert q.scale.dtype == torch.float16 and q.zero.dtype == torch.float16
    assert torch.equal(Q.unpack(q.codes, bits), reference_encode(x, q.scale, q.zero, bits, quantizer))
    # Same input, same bits, any batching: a group's parameters depend on that group alone.
    q_half = Q.quantize(x[50:], bits, 64, quantizer)
    assert torch.equal(q_half.codes, q.codes[50:]) and torch.equal(q_half.scale, q.scale[50:])


@pytest.mark.parametrize("bits", BITS)
def test_pack_round_trip(bits):
    q = torch.randint(0, 2**bits, (37, 128), dtype=torch.uint8)
    packed = Q.pack(q, bits)
    assert packed.shape == (37, 128 * bits // 8)
    assert torch.equal(Q.unpack(packed, bits), q)
    if bits == 4:
        assert torch.equal(packed[:, 0] & 0xF, q[:, 0]) and torch.equal(packed[:, 0] >> 4, q[:, 1])


@pytest.mark.parametrize("quantizer", Q.QUANTIZERS)
@pytest.mark.parametrize("bits", BITS)
def test_edge_groups(quantizer, bits):
    g = 64
    rows = [
        torch.zeros(g),                                   # all zero
        torch.full((g,), 3.25),                           # constant
        torch.full((g,), -1e-3),                          # constant negative
        torch.randn(g) * 1e-6,                            # scale below fp16's smallest normal
        torch.randn(g) * 1e-9,                            # scale below fp16's smallest subnormal
        torch.randn(g) * 1e5,                             # beyond fp16's range (fp32 input)
        torch.randn(g) * 2e4 + 1.5e5,                     # one-sided, beyond fp16's range
        torch.linspace(-1e-30, 1.0, g),                   # straddles zero by a hair
    ]
    x = torch.stack(rows)
    q = Q.quantize(x, bits, g, quantizer)
    y = Q.dequantize(q)
    assert torch.isfinite(y).all() and torch.isfinite(q.scale.float()).all()
    assert (q.scale.float() > 0).all(), "a scale underflowed to zero"
    err = (y - x).abs()
    assert torch.all(err <= Q.step_bound(q)[:, None])
    assert torch.all(y[0] == 0)
    # A constant group: within fp16's resolution, or the packed scale's where z = 0 forces code 2^b - 1.
    assert torch.allclose(y[1], x[1], rtol=2**-7 if quantizer == "zero_aware_int" else 2**-10, atol=0)
    # Subnormal scales keep small values (rounded up, never flushed to zero); below the smallest scale
    # (fp16's 2^-24; the packed format's 2^(b - 25)) the error is at most half of it: what the power-of-two
    # rescaling avoids.
    smallest = Q.packed_scale_range(bits)[0] if quantizer == "zero_aware_int" else 2.0**-24
    assert (y[3] != 0).any() or smallest > x[3].abs().max() * 2
    assert (y[4] - x[4]).abs().max() <= smallest / 2


def test_saturates_instead_of_inf():
    # A range beyond 65504 * (2^b - 1) cannot be represented with an fp16 scale: values saturate to
    # the grid's ends, they never become inf.
    x = torch.tensor([[-2e6, 2e6] + [0.0] * 14])
    y = Q.fake_quantize(x, 4, 16, "symmetric")
    assert torch.isfinite(y).all()
    assert y[0, 1] == 65504 * 7


@pytest.mark.parametrize("quantizer", Q.QUANTIZERS)
@pytest.mark.parametrize("bad", (float("nan"), float("inf"), float("-inf")))
def test_non_finite_propagates_to_its_group_only(quantizer, bad):
    x = activations(4, 32, seed=1)
    x[2, 7] = bad
    y = Q.fake_quantize(x, 4, 32, quantizer)
    assert torch.isnan(y[2]).all()
    assert torch.isfinite(y[[0, 1, 3]]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", (1, 5, 127, 128, 129, 1000))
def test_dtypes_and_padding(dtype, numel):
    x = (torch.randn(numel) * 3).to(dtype)
    q = Q.quantize(x, 4, 128, "zero_aware")
    assert q.num_groups == math.ceil(numel / 128)
    y = Q.dequantize(q, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    err = (Q.dequantize(q).float() - x.float()).abs()
    bound = Q.step_bound(q).repeat_interleave(128)[:numel]
    assert torch.all(err <= bound)
    assert Q.fake_quantize(x).dtype == dtype


def test_wire_bytes():
    assert Q.wire_bytes(128, 4, 128) == 68
    assert Q.wire_bytes(129, 4, 128) == 136
    assert Q.wire_bytes(256, 8, 128) == 2 * 132
    assert Q.quantize(torch.randn(1000), 4, 128).wire_bytes == Q.wire_bytes(1000, 4, 128)


# ----------------------------------------------------------------------------------------------------
# "zero_aware_int": integer zero-point and a scale that share one 16-bit word
# ----------------------------------------------------------------------------------------------------

def mixed_groups(num_groups, g, seed):
    """Activation-like groups plus one-sided ones (far from and within a code of 0) and all-zero ones."""
    x = activations(num_groups, g, seed)
    q = num_groups // 8
    x[:q] = x[:q].abs() + 3.0 * x[:q].abs().amax(1, keepdim=True)      # one-sided, far from 0
    x[q:2 * q] = -x[q:2 * q].abs()                                     # one-sided negative, touching 0
    x[2 * q:3 * q] = x[2 * q:3 * q].abs() + 1e-3                       # one-sided, within a code of 0
    x[3 * q] = 0.0
    return x


@pytest.mark.parametrize("bits", BITS)
def test_integer_zero_params_are_on_the_packed_grid(bits):
    x = mixed_groups(400, 64, seed=bits)
    q = Q.quantize(x, bits, 64, "zero_aware_int")
    L = 2**bits - 1
    z = q.zero.float()
    assert torch.equal(z, torch.round(z)) and bool(((z >= 0) & (z <= L)).all())
    drop = bits - 1
    assert bool(((q.scale.view(torch.int16) & ((1 << drop) - 1)) == 0).all()), "scale off the packed grid"
    lo, hi = Q.packed_scale_range(bits)
    assert lo == 2.0 ** (bits - 25) and bool((q.scale.float() >= lo).all() and (q.scale.float() <= hi).all())
    # One-sided groups put 0 at the grid's end on their side; straddling ones keep zero_aware's integer z
    # under a scale rounded up from the same value.
    mn, mx = x.amin(1), x.amax(1)
    assert bool((z[mn >= 0] == 0).all()) and bool((z[mx < 0] == L).all())
    straddle = (mn < 0) & (mx > 0)
    za = Q.quantize(x, bits, 64, "zero_aware")
    assert torch.equal(z[straddle], za.zero.float()[straddle])
    assert bool((q.scale.float()[straddle] >= za.scale.float()[straddle]).all())
    assert bool((q.scale.float()[straddle] <= za.scale.float()[straddle] * (1 + 2.0 ** (drop - 10))).all())
    # Nothing clips, and 0 is exact in every group.
    y = Q.dequantize(q)
    assert torch.all((y - x).abs() <= Q.step_bound(q)[:, None])
    x0 = x.clone()
    x0[:, ::7] = 0.0
    assert torch.all(Q.fake_quantize(x0, bits, 64, "zero_aware_int")[:, ::7] == 0)


def test_packed_scale_is_the_ceiling_on_its_grid():
    # fp16's normal range, below both formats' largest values (subnormals have a fixed step)
    raw = torch.exp(torch.empty(20000).uniform_(-9.0, 10.5, generator=torch.Generator().manual_seed(1)))
    for bits in BITS:
        s = Q.packed_scale(raw, bits).float()
        step = 2.0 ** (bits - 1 - 10) * torch.exp2(torch.floor(torch.log2(s)))  # ulp of the packed format
        assert bool((s >= raw).all()) and bool((s - step < raw).all())


@pytest.mark.parametrize("bits", BITS)
def test_pack_params_round_trip(bits):
    x = mixed_groups(200, 64, seed=5)
    x[7, 3] = float("nan")
    q = Q.quantize(x, bits, 64, "zero_aware_int")
    words = Q.pack_params(q.scale, q.zero, bits)
    assert bool(((words >= 0) & (words < 2**16)).all())
    assert torch.equal(words & (2**bits - 1), q.zero.to(torch.int32))
    scale, zero = Q.unpack_params(words, bits)
    assert torch.equal(zero, q.zero)
    finite = torch.isfinite(q.scale)
    assert torch.equal(scale[finite], q.scale[finite]) and bool(torch.isnan(scale[7]))


def test_integer_zero_fits_g64_in_4_25_bits():
    spec = Q.QuantSpec(bits=4, group_size=64, quantizer="zero_aware_int")
    assert Q.group_wire_bytes(4, 64, "zero_aware_int") == 34 and spec.bits_per_value == 4.25
    assert Q.QuantSpec(bits=4, group_size=128).bits_per_value == 4.25
    assert Q.quantize(torch.randn(1000), 4, 64, "zero_aware_int").wire_bytes == 16 * 34


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits"):
        Q.quantize(torch.randn(10), 3)
    with pytest.raises(ValueError, match="group_size"):
        Q.quantize(torch.randn(10), 4, 100)
    with pytest.raises(ValueError, match="quantizer"):
        Q.quantize(torch.randn(10), 4, 128, "log")
    with pytest.raises(TypeError):
        Q.quantize(torch.arange(10), 4, 128)


@pytest.mark.parametrize("g", (16, 128, 4096))
def test_hadamard_is_orthonormal_and_fixed(g):
    x = torch.randn(20, g)
    r = Q.rotate(x)
    assert torch.allclose(r.norm(dim=1), x.norm(dim=1), rtol=1e-5)
    assert torch.allclose(Q.unrotate(r), x, atol=1e-5)
    # The sum commutes with it (linear), and the signs are the same in every call.
    y = torch.randn(20, g)
    assert torch.allclose(Q.rotate(x + y), Q.rotate(x) + Q.rotate(y), atol=1e-5)
    assert torch.equal(Q.hadamard_signs(g), Q.hadamard_signs(g))
    assert set(Q.hadamard_signs(g).tolist()) == {-1.0, 1.0}


def test_hadamard_spreads_sparse_outliers():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(500, 128, generator=gen)
    x = x * (1 + 20 * (torch.rand(500, 128, generator=gen) < 0.02))
    plain = (Q.fake_quantize(x, 4, 128) - x).pow(2).sum()
    rotated = (Q.unrotate(Q.fake_quantize(Q.rotate(x), 4, 128)) - x).pow(2).sum()
    assert rotated < 0.5 * plain


def test_fp16_round_up_matches_directed_rounding():
    s = torch.cat([torch.rand(10000) * 10.0 ** torch.randint(-9, 5, (10000,)).float(),
                   torch.tensor([0.0, 2.0**-24, 2.0**-25, 65504.0, 1.0])])
    h = Q.fp16_round_up(s).float()
    assert torch.all(h >= s)
    # The next fp16 below h is below s: h is the smallest fp16 >= s.
    below = (Q.fp16_round_up(s).view(torch.int16) - 1).view(torch.float16).float()
    assert torch.all((below < s) | (h == 0))
