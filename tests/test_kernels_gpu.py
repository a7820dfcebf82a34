"""The CUDA kernels against the reference, bit for bit (skipped without a CUDA device).

Each stage is compared with the reference's own stage functions (echo_ds.algorithm / quant /
compensator) run on the same GPU, and the chained stages of P emulated ranks with
echo_ds.emulate.emulated_echo_all_reduce. Inputs are fresh random tensors with groups of every kind
(centred, one-sided, nearly one-sided for the zero-aware blend, wide dynamic range, exact zeros) and
lengths that need padding; every output is poisoned before the kernels run. Equality is bitwise, with two
stated exceptions: NaN compares by position (CUDA produces its canonical NaN, whose payload carries no
meaning), and the fp16 zero-point +0 / -0 of a group whose minimum is a signed zero compares as equal
(torch.amin picks either zero of a group holding both, by reduction order; the codes and every decoded
value are identical either way).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from echo_ds import algorithm as A  # noqa: E402
from echo_ds import quant as Q  # noqa: E402
from echo_ds.quant import QuantSpec  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BITS = (4, 8)
QUANTIZERS = Q.QUANTIZERS
GROUP_SIZES = (64, 128, 256)
WORLD_SIZES = (2, 4, 8)


def cycled_world_size(i: int) -> int:
    """P of the i-th case of a test that draws its other choices from i % 2, i % 3 and i % 4: the sizes in
    turn every four cases, so that each size meets each of those choices."""
    return WORLD_SIZES[(i // 4) % len(WORLD_SIZES)]


@pytest.fixture(scope="module")
def ops():
    import echo_ds.ops as E

    reason = E.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    E.load()
    return E


def dev():
    return torch.device("cuda")


# ----------------------------------------------------------------------------------------------------
# Inputs, poison, comparisons
# ----------------------------------------------------------------------------------------------------

def random_groups(num_groups: int, g: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 [num_groups, g] with groups of every kind the quantizer distinguishes."""
    base = torch.randn(num_groups, g, generator=gen, device=dev())
    mode = torch.randint(0, 6, (num_groups, 1), generator=gen, device=dev())
    scale = torch.exp(torch.empty(num_groups, 1, device=dev()).uniform_(-9.0, 9.0, generator=gen))
    x = base
    x = torch.where(mode == 1, base.abs() + 0.05, x)                       # one-sided positive
    x = torch.where(mode == 2, -(base.abs() + 0.05), x)                    # one-sided negative
    x = torch.where(mode == 3, base.abs() - 0.02 * base.abs().amax(1, keepdim=True), x)  # nearly one-sided
    x = torch.where(mode == 4, base * (torch.rand(num_groups, g, generator=gen, device=dev()) < 0.3), x)  # zeros
    x = torch.where(mode == 5, base + 3.0, x)                              # offset, straddle-free mostly
    return x * scale


def random_input(numel: int, g: int, dtype, gen) -> torch.Tensor:
    groups = -(-numel // g)
    return random_groups(groups, g, gen).reshape(-1)[:numel].to(dtype)


def poison_f32(*shape):
    return torch.full(shape, float("nan"), dtype=torch.float32, device=dev())


def poison_packets(num, layout, spec, ops):
    buf = ops.alloc_packets(num, layout, spec, dev())
    buf.fill_(0xFF)
    return buf


_INT_OF_SIZE = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_SIZE[t.element_size()])


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str, fold_zero_sign: bool = False):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.contiguous(), expected.contiguous()
    if a.is_floating_point():
        an, en = torch.isnan(a), torch.isnan(e)
        bad_nan = an != en
        assert not bool(bad_nan.any()), (f"{what}: NaN positions differ at {int(bad_nan.sum())} elements, first "
                                         f"{bad_nan.nonzero()[0].tolist()}")
        if fold_zero_sign:
            a = torch.where(a == 0, torch.zeros_like(a), a)
            e = torch.where(e == 0, torch.zeros_like(e), e)
        a = torch.where(an, torch.zeros_like(a), a)
        e = torch.where(en, torch.zeros_like(e), e)
    diff = _bits(a) != _bits(e)
    if bool(diff.any()):
        idx = diff.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} elements differ; first at {idx}: "
                             f"kernel {a[tuple(idx)].item()!r} vs reference {e[tuple(idx)].item()!r}")


def packed(spec) -> bool:
    return spec.quantizer in Q.PACKED_QUANTIZERS


def assert_packet(ops, row, layout, spec, codes, scale, zero, what):
    kc, ks, kz = ops.packet_views(row, layout, spec)
    assert_same(kc, codes.reshape(kc.shape), f"{what} codes")
    if packed(spec):  # one word per group in the scales; the zeros were never written (still poisoned)
        words = Q.pack_params(scale.reshape(-1), zero.reshape(-1), spec.bits).to(torch.int16)
        assert_same(ks.view(torch.int16), words, f"{what} packed parameter words")
        assert bool((kz.view(torch.int16) == -1).all()), f"{what}: a packed quantizer wrote the zeros"
        return
    assert_same(ks, scale.reshape(-1), f"{what} scales")
    assert_same(kz, zero.reshape(-1), f"{what} zeros", fold_zero_sign=True)


def read_packet(ops, row, layout, spec):
    """(codes, scales fp16, zeros fp16) a kernel wrote into packet ``row`` (a packed quantizer's unpacked)."""
    kc, ks, kz = ops.packet_views(row, layout, spec)
    if packed(spec):
        return (kc,) + Q.unpack_params(ks.view(torch.int16), spec.bits)
    return kc, ks, kz


def packets_holding(ops, layout, spec, segments):
    """A packet buffer, poisoned first, whose row j holds segments[j] = (codes, scales, zeros)."""
    buf = poison_packets(len(segments), layout, spec, ops)
    for row, (codes, scale, zero) in zip(buf, segments):
        kc, ks, kz = ops.packet_views(row, layout, spec)
        kc.copy_(codes.reshape(kc.shape))
        if packed(spec):
            ks.view(torch.int16).copy_(Q.pack_params(scale.reshape(-1), zero.reshape(-1), spec.bits).to(torch.int16))
        else:
            ks.copy_(scale), kz.copy_(zero)
    return buf


def make_comp(residual="output", gain=0.75, blend=0.35, slow=0.7, fast=0.3):
    """A "bf16" compensator, named (the default is "int4"): these tests hand the kernels bf16 m1, m2
    (random_state), and set and read the compensator's own m1, m2 as bf16; the other formats are
    tests/test_state_narrow_kernels.py's and tests/p2p_suite.py's."""
    from echo_ds.compensator import Compensator
    from echo_ds.config import DirectionConfig

    return Compensator(DirectionConfig(gain=gain, blend=blend, slow_decay=slow, fast_decay=fast, residual=residual,
                                       state_dtype="bf16"))


def random_state(layout, gen, scale=1e-2):
    """m1 or m2 as the kernels hold it: compensator.kStateDtype (bf16) [padded], random groups."""
    from echo_ds.compensator import kStateDtype

    g = layout.group_size
    return (random_groups(layout.padded_numel // g, g, gen).reshape(-1) * scale).to(kStateDtype)


def expected_state(comp, m1, m2, u, segments):
    """The state the kernels must leave: Compensator.update(u) on ``segments`` (indices of dim 0 of the
    [P, G, g] views), the old state elsewhere. m1, m2: the flat state before the call."""
    shape = u.shape
    ref = make_comp(comp.residual, comp.cfg.gain, comp.cfg.blend, comp.cfg.slow_decay, comp.cfg.fast_decay)
    ref.m1, ref.m2 = m1.view(shape).clone(), m2.view(shape).clone()
    ref.update(u)
    e1, e2 = m1.view(shape).clone(), m2.view(shape).clone()
    e1[segments], e2[segments] = ref.m1[segments], ref.m2[segments]
    return e1.reshape(-1), e2.reshape(-1)


# ----------------------------------------------------------------------------------------------------
# Stage references (the reference's per-rank operations, reference.py's echo_all_reduce)
# ----------------------------------------------------------------------------------------------------

def ref_rotated(x, layout, spec):
    return A.rotate_if(A.to_segments(x.reshape(1, -1), layout), spec)[0]  # [P, G, g]


def ref_pow2(amax):
    return A.pow2_exponent(amax) if amax is not None else 0


def ref_contribution(x, layout, spec, comp_mode, pow2, gen):
    """rs = (rotate(x) + c) 2^k [P, G, g] as the reference forms it, k, the kernels' keywords (comp_mode
    "state": a random bf16 state m1, m2 the kernels may update in place, and its coefficients) and the
    state before the call (comp, m1, m2) or None."""
    comp = make_comp()
    kw, before = {}, None
    r = ref_rotated(x, layout, spec)
    if comp_mode == "state":
        m1, m2 = random_state(layout, gen), random_state(layout, gen)
        comp.m1, comp.m2 = m1.view(r.shape).clone(), m2.view(r.shape).clone()
        r = r + comp.correction(r.shape, r.device)
        kw = dict(m1=m1, m2=m2, coeffs=comp)
        before = (comp, m1.clone(), m2.clone())
    else:
        assert comp_mode == "none", comp_mode
    amax = None
    if pow2:  # another rank holds a larger maximum
        amax = (r.abs().amax() * 1.37).reshape(1)
    k = ref_pow2(amax)
    return (r * 2.0**k if k else r), k, dict(kw, pow2_amax=amax), before


def plant_specials(x: torch.Tensor, layout, rank: int) -> None:
    """Groups 1-6 of the first segment the entry sends (x in place, whole groups only): a NaN, +inf and
    -inf group; the dtype's extremes (largest finite of both signs and the smallest subnormal); signed
    zeros only; a constant negative group. The uncompensated entry takes 16-bit statistics on packed pairs,
    so these reach its NaN propagation, the negated maximum and the zero signs."""
    g, S = layout.group_size, layout.segment_numel
    seg = 1 if rank == 0 else 0
    fi = torch.finfo(x.dtype)
    for n, kind in enumerate(("nan", "inf", "-inf", "extremes", "zeros", "constant"), start=1):
        start = seg * S + n * g
        if start + g > x.numel():
            break
        t = x[start:start + g]
        if kind == "nan":
            t[g // 3] = float("nan")
        elif kind == "inf":
            t[0] = float("inf")
        elif kind == "-inf":
            t[g - 1] = float("-inf")
        elif kind == "extremes":
            t[0], t[1], t[2] = fi.max, -fi.max, fi.tiny * fi.eps
        elif kind == "zeros":
            t.zero_()
            t[1::2] = -0.0
        else:
            t.fill_(-3.0)


def entry_case(ops, *, P, rank, dtype, spec, numel, comp_mode, local, pow2, gen, specials=False):
    g = spec.group_size
    layout = A.Layout(numel, P, g)
    x = random_input(numel, g, dtype, gen)
    if specials:
        plant_specials(x, layout, rank)
    rs, k, kw, before = ref_contribution(x, layout, spec, comp_mode, pow2, gen)
    update = local and before is not None
    others = [j for j in range(P) if j != rank]
    codes, scale, zero = A.quantize_segments(rs[others], spec)

    packets = poison_packets(P, layout, spec, ops)
    rows = [None if j == rank else packets[j] for j in range(P)]
    ops.push_quantize(x, rank=rank, world_size=P, spec=spec, out=ops.packet_table(rows, layout, spec),
                      update_state=update, **kw)
    torch.cuda.synchronize()
    for n, j in enumerate(others):
        assert_packet(ops, packets[j], layout, spec, codes[n], scale[n], zero[n], f"segment {j}")
    assert bool((packets[rank] == 0xFF).all()), "the owned segment is the owner reduce's, not the entry's"
    if before is not None:
        comp, m1, m2 = before
        if update:  # residual "local" of the sent segments, folded in; the own segment is the reduce's
            u = torch.zeros_like(rs)
            err = A.dequantize_segments(codes, scale, zero, spec) - rs[others]
            u[others] = -(err * 2.0**-k) if k else -err
            m1, m2 = expected_state(comp, m1, m2, u, others)
        assert_same(kw["m1"], m1, "m1 after the entry")
        assert_same(kw["m2"], m2, "m2 after the entry")


ENTRY_CASES = list(itertools.product(DTYPES, BITS, QUANTIZERS, (False, True), GROUP_SIZES))


@pytest.mark.parametrize("dtype,bits,quantizer,rotation,g", ENTRY_CASES,
                         ids=[f"{str(d)[6:]}-b{b}-{p}-rot{int(r)}-g{g}" for d, b, p, r, g in ENTRY_CASES])
def test_push_quantize(ops, dtype, bits, quantizer, rotation, g):
    i = ENTRY_CASES.index((dtype, bits, quantizer, rotation, g))
    gen = torch.Generator(device=dev()).manual_seed(1000 + i)
    P = cycled_world_size(i)
    spec = QuantSpec(bits=bits, group_size=g, quantizer=quantizer, rotation=rotation)
    numel = P * g * (3 + i % 5) - (i * 37) % (P * g) + 1  # rarely a whole number of chunks
    entry_case(ops, P=P, rank=(i * 3) % P, dtype=dtype, spec=spec, numel=numel,
               comp_mode=("none", "state", "state")[i % 3], local=(i % 2 == 0), pow2=(i % 4 in (1, 2)),
               gen=gen, specials=(i % 3 == 2))


UNCOMPENSATED_CASES = list(itertools.product(DTYPES, BITS, QUANTIZERS, GROUP_SIZES))


@pytest.mark.parametrize("dtype,bits,quantizer,g", UNCOMPENSATED_CASES,
                         ids=[f"{str(d)[6:]}-b{b}-{p}-g{g}" for d, b, p, g in UNCOMPENSATED_CASES])
def test_push_quantize_uncompensated(ops, dtype, bits, quantizer, g):
    """The uncompensated entry (no compensation, rotation or residual: its own instantiation) for every
    dtype, bit width, quantizer and group size; non-finite and extreme groups where pow2 is off (a
    non-finite amax gives k = 0)."""
    i = UNCOMPENSATED_CASES.index((dtype, bits, quantizer, g))
    gen = torch.Generator(device=dev()).manual_seed(3000 + i)
    P = cycled_world_size(i)
    spec = QuantSpec(bits=bits, group_size=g, quantizer=quantizer)
    numel = P * g * (40 + i % 5) - (i * 37) % (P * g) + 1  # a few blocks per segment, a ragged end
    entry_case(ops, P=P, rank=(i * 3) % P, dtype=dtype, spec=spec, numel=numel, comp_mode="none", local=False,
               pow2=(i % 2 == 1), gen=gen, specials=(i % 2 == 0))


@pytest.mark.parametrize("numel", [1, 7, 1000, 100_003, 4_000_037])
def test_push_quantize_sizes(ops, numel):
    gen = torch.Generator(device=dev()).manual_seed(numel)
    for n, (P, dtype, rot) in enumerate([(4, torch.bfloat16, True), (8, torch.float16, False), (2, torch.float32, True)]):
        spec = QuantSpec(bits=4 if n != 1 else 8, group_size=128, quantizer="zero_aware", rotation=rot)
        entry_case(ops, P=P, rank=n % P, dtype=dtype, spec=spec, numel=numel, comp_mode=("state", "none", "state")[n],
                   local=n == 0, pow2=n == 2, gen=gen)


def test_unaligned_view(ops):
    """x as a view at an odd offset takes the scalar load path in the entry and the owner reduce and gives
    the same bits."""
    gen = torch.Generator(device=dev()).manual_seed(5)
    spec = QuantSpec(bits=4, group_size=128)
    base = random_input(10_001, 128, torch.float16, gen)
    x = base[3:]
    layout = A.Layout(x.numel(), 4, 128)
    rs = ref_rotated(x, layout, spec)
    codes, scale, zero = A.quantize_segments(rs[1:], spec)
    packets = poison_packets(4, layout, spec, ops)
    ops.push_quantize(x, rank=0, world_size=4, spec=spec, out=ops.packet_table([None, *packets[1:]], layout, spec))
    for n in range(3):
        assert_packet(ops, packets[n + 1], layout, spec, codes[n], scale[n], zero[n], f"segment {n + 1}")
    copies = [A.quantize_segments(random_groups(layout.groups_per_segment, 128, gen), spec) for _ in range(4)]
    acc = A.ordered_sum(torch.stack([rs[0]] + [A.dequantize_segments(*c, spec) for c in copies[1:]]))
    inbuf = packets_holding(ops, layout, spec, copies)
    out = poison_packets(1, layout, spec, ops)
    ops.owner_reduce(x, rank=0, world_size=4, spec=spec, copies=ops.packet_table([None, *inbuf[1:]], layout, spec),
                     out=ops.packet_table([out[0], None, None, None], layout, spec))
    assert_packet(ops, out[0], layout, spec, *A.quantize_segments(acc[None], spec), "reduced segment")


@pytest.mark.parametrize("rotation", [False, True], ids=["uncompensated", "rotated"])
def test_push_quantize_tiles(ops, rotation):
    """Tiles of groups (37 and 150 in turn) written one after the other give the whole-segment result, for
    the uncompensated entry and the rotated one (two instantiations)."""
    gen = torch.Generator(device=dev()).manual_seed(6)
    spec = QuantSpec(bits=4, group_size=64, rotation=rotation)
    x = random_input(50_000, 64, torch.bfloat16, gen)
    P, rank = 4, 2
    layout = A.Layout(x.numel(), P, 64)
    G = layout.groups_per_segment
    whole, tiled = poison_packets(P, layout, spec, ops), poison_packets(P, layout, spec, ops)
    ops.push_quantize(x, rank=rank, world_size=P, spec=spec,
                      out=ops.packet_table([None if j == rank else whole[j] for j in range(P)], layout, spec))
    b, n = 0, 0
    while b < G:
        t = min((37, 150)[n % 2], G - b)
        ops.push_quantize(x, rank=rank, world_size=P, spec=spec,
                          out=ops.packet_table([None if j == rank else tiled[j] for j in range(P)], layout, spec),
                          group_begin=b, num_groups=t)
        b, n = b + t, n + 1
    pb = ops.packet_bytes(layout, spec)
    assert_same(tiled[:, :pb], whole[:, :pb], "tiled packets")


# ----------------------------------------------------------------------------------------------------
# pow2 amax
# ----------------------------------------------------------------------------------------------------

AMAX_CASES = list(itertools.product(DTYPES, (False, True), ("none", "state")))


@pytest.mark.parametrize("dtype,rotation,comp_mode", AMAX_CASES)
def test_pow2_amax(ops, dtype, rotation, comp_mode):
    gen = torch.Generator(device=dev()).manual_seed(5000 + AMAX_CASES.index((dtype, rotation, comp_mode)))
    g = 128
    spec = QuantSpec(bits=4, group_size=g, rotation=rotation)
    x = random_input(300_001, g, dtype, gen)
    layout = A.Layout(x.numel(), 4, g)
    r = ref_rotated(x, layout, spec)
    comp = make_comp()
    kw = {}
    if comp_mode == "state":
        m1, m2 = random_state(layout, gen, scale=1.0), random_state(layout, gen, scale=1.0)
        comp.m1, comp.m2 = m1.view(r.shape).clone(), m2.view(r.shape).clone()
        r = r + comp.correction(r.shape, r.device)
        kw = dict(m1=m1, m2=m2, coeffs=comp)
    out = poison_f32(1)
    ops.pow2_amax(x, out, world_size=4, spec=spec, **kw)
    assert_same(out, r.abs().amax().reshape(1), "amax")
    x[12345] = float("nan")
    ops.pow2_amax(x, out, world_size=4, spec=spec, **kw)
    assert bool(torch.isnan(out).all()), "NaN must propagate into amax"


# ----------------------------------------------------------------------------------------------------
# Owner reduce
# ----------------------------------------------------------------------------------------------------

def owner_case(ops, *, P, rank, dtype, spec, numel, comp_mode, local, pow2, tiled, inf_own, gen):
    """The owner reduce against the reference: copies of random groups from the other ranks, the own
    segment formed from x (and the state), written to every other destination and to its own."""
    g = spec.group_size
    layout = A.Layout(numel, P, g)
    G, S = layout.groups_per_segment, layout.segment_numel
    x = random_input(numel, g, dtype, gen)
    if inf_own and rank * S + 3 * g < numel:  # a non-finite own group must give a NaN group
        x[rank * S + 2 * g + 3] = float("inf")
    rs, k, kw, before = ref_contribution(x, layout, spec, comp_mode, pow2, gen)
    update = local and before is not None
    sent = [A.quantize_segments(random_groups(G, g, gen), spec) for _ in range(P)]
    terms = torch.stack([rs[rank] if r == rank else A.dequantize_segments(*sent[r], spec) for r in range(P)])
    acc = A.ordered_sum(terms)
    codes, scale, zero = A.quantize_segments(acc[None], spec)

    inbuf = packets_holding(ops, layout, spec, sent)
    outbuf = poison_packets(P, layout, spec, ops)
    dests = [outbuf[d] if d % 2 == 0 or d == rank else None for d in range(P)]
    tiles = [(b, min(b + 2, G)) for b in range(0, G, 2)] if tiled else [(0, G)]
    for b, e in tiles:
        ops.owner_reduce(x, rank=rank, world_size=P, spec=spec,
                         copies=ops.packet_table([None if r == rank else inbuf[r] for r in range(P)], layout, spec),
                         out=ops.packet_table(dests, layout, spec), update_state=update, group_begin=b,
                         num_groups=e - b, **kw)
    torch.cuda.synchronize()
    for d, row in enumerate(dests):
        if row is not None:
            assert_packet(ops, row, layout, spec, codes[0], scale[0], zero[0], f"reduced segment to {d}")
        else:
            assert bool((outbuf[d] == 0xFF).all()), f"destination {d} was not asked for but written"
    if before is not None:
        comp, m1, m2 = before
        if update:  # residual "local", own share: the requantization error, folded into the own segment
            u = torch.zeros_like(rs)
            err = A.dequantize_segments(codes, scale, zero, spec)[0] - acc
            u[rank] = -(err * 2.0**-k) if k else -err
            m1, m2 = expected_state(comp, m1, m2, u, [rank])
        assert_same(kw["m1"], m1, "m1 after the owner reduce")
        assert_same(kw["m2"], m2, "m2 after the owner reduce")


REDUCE_CASES = list(itertools.product(WORLD_SIZES, BITS, QUANTIZERS, GROUP_SIZES))


@pytest.mark.parametrize("P,bits,quantizer,g", REDUCE_CASES, ids=[f"P{P}-b{b}-{p}-g{g}" for P, b, p, g in REDUCE_CASES])
def test_owner_reduce(ops, P, bits, quantizer, g):
    i = REDUCE_CASES.index((P, bits, quantizer, g))
    gen = torch.Generator(device=dev()).manual_seed(2000 + i)
    spec = QuantSpec(bits=bits, group_size=g, quantizer=quantizer, rotation=i % 4 >= 2)
    owner_case(ops, P=P, rank=i % P, dtype=DTYPES[i % 3], spec=spec,
               numel=P * g * (2 + i % 7) - (i * 53) % (P * g), comp_mode=("none", "state", "state")[i % 3],
               local=i % 2 == 1, pow2=i % 3 == 0, tiled=i % 4 == 1, inf_own=i % 5 == 0, gen=gen)


REDUCE_UNCOMPENSATED_CASES = list(itertools.product(DTYPES, WORLD_SIZES, BITS, GROUP_SIZES))


@pytest.mark.parametrize("dtype,P,bits,g", REDUCE_UNCOMPENSATED_CASES,
                         ids=[f"{str(d)[6:]}-P{P}-b{b}-g{g}" for d, P, b, g in REDUCE_UNCOMPENSATED_CASES])
def test_owner_reduce_uncompensated(ops, dtype, P, bits, g):
    """The uncompensated owner reduce (its own instantiation, which keeps x as loaded until its turn in the
    sum) for every dtype, world size, bit width and group size; the quantizer cycles."""
    i = REDUCE_UNCOMPENSATED_CASES.index((dtype, P, bits, g))
    gen = torch.Generator(device=dev()).manual_seed(4000 + i)
    spec = QuantSpec(bits=bits, group_size=g, quantizer=QUANTIZERS[i % len(QUANTIZERS)])
    owner_case(ops, P=P, rank=(i * 5) % P, dtype=dtype, spec=spec,
               numel=P * g * (40 + i % 7) - (i * 53) % (P * g), comp_mode="none", local=False,
               pow2=i % 2 == 1, tiled=i % 4 == 3, inf_own=i % 5 == 0, gen=gen)


# ----------------------------------------------------------------------------------------------------
# Dequantize
# ----------------------------------------------------------------------------------------------------

DEQ_CASES = list(itertools.product(DTYPES, BITS, (False, True), GROUP_SIZES))


@pytest.mark.parametrize("dtype,bits,rotation,g", DEQ_CASES,
                         ids=[f"{str(d)[6:]}-b{b}-rot{int(r)}-g{g}" for d, b, r, g in DEQ_CASES])
def test_dequantize(ops, dtype, bits, rotation, g):
    i = DEQ_CASES.index((dtype, bits, rotation, g))
    gen = torch.Generator(device=dev()).manual_seed(3000 + i)
    P = cycled_world_size(i)
    spec = QuantSpec(bits=bits, group_size=g, quantizer=QUANTIZERS[i % len(QUANTIZERS)], rotation=rotation)
    numel = P * g * (1 + i % 6) - (i * 29) % (P * g) + 3
    layout = A.Layout(numel, P, g)
    G = layout.groups_per_segment
    vals = random_groups(P * G, g, gen).view(P, G, g)
    vals[0, 0, 1] = float("nan")
    codes, scale, zero = A.quantize_segments(vals, spec)
    amax = torch.tensor([float(3.0 ** (i % 7))], device=dev()) if i % 2 else None
    k = ref_pow2(amax)
    s_hat = A.dequantize_segments(codes, scale, zero, spec)
    s_hat = s_hat * 2.0**-k if k else s_hat
    shape = (numel,) if i % 2 else (1, numel)
    y_ref = A.from_segments(A.unrotate_if(s_hat, spec), layout, shape, dtype)

    buf = packets_holding(ops, layout, spec, list(zip(codes, scale, zero)))
    y = torch.full(shape, float("nan"), dtype=dtype, device=dev())
    ops.dequantize(y, world_size=P, spec=spec, gathered=ops.packet_table(list(buf), layout, spec), pow2_amax=amax)
    torch.cuda.synchronize()
    assert_same(y, y_ref, "y")
    assert bool(torch.isnan(y.reshape(-1)[:g].float()).all()), "a NaN group decodes to NaN in full"


@pytest.mark.parametrize("rotation", [False, True])
def test_dequantize_tiles_and_unaligned_output(ops, rotation):
    """Tiles of (segments, groups) written one after the other, into an output view at an odd offset (the
    scalar store path of the rotated pairs), give the whole call's bits."""
    gen = torch.Generator(device=dev()).manual_seed(7 + rotation)
    P, g = 4, 128
    spec = QuantSpec(bits=4, group_size=g, rotation=rotation)
    numel = 70_001
    layout = A.Layout(numel, P, g)
    G = layout.groups_per_segment
    codes, scale, zero = A.quantize_segments(random_groups(P * G, g, gen).view(P, G, g), spec)
    buf = packets_holding(ops, layout, spec, list(zip(codes, scale, zero)))
    table = ops.packet_table(list(buf), layout, spec)
    whole = torch.full((numel,), float("nan"), dtype=torch.bfloat16, device=dev())
    ops.dequantize(whole, world_size=P, spec=spec, gathered=table)
    base = torch.full((numel + 1,), float("nan"), dtype=torch.bfloat16, device=dev())
    tiled = base[1:]
    for sb, ns in ((0, 1), (1, 3)):
        for b in range(0, G, 29):
            ops.dequantize(tiled, world_size=P, spec=spec, gathered=table, segment_begin=sb, num_segments=ns,
                           group_begin=b, num_groups=min(29, G - b))
    torch.cuda.synchronize()
    assert_same(tiled, whole, "tiled, unaligned y")
    assert not bool(torch.isnan(whole.float()).any()), "every element of y is written"


# ----------------------------------------------------------------------------------------------------
# Dequantize with the compensator update of residual "output"
# ----------------------------------------------------------------------------------------------------

UPD_CASES = list(itertools.product(DTYPES, BITS, (False, True), GROUP_SIZES))


@pytest.mark.parametrize("dtype,bits,rotation,g", UPD_CASES,
                         ids=[f"{str(d)[6:]}-b{b}-rot{int(r)}-g{g}" for d, b, r, g in UPD_CASES])
def test_dequantize_updates_output_residual(ops, dtype, bits, rotation, g):
    """y as test_dequantize has it, and m1, m2 of every decoded group (padding included) updated from
    u = (rotate(x) + c) - s_hat / P, in segment ranges and group tiles."""
    from echo_ds.quant import reciprocal

    i = UPD_CASES.index((dtype, bits, rotation, g))
    gen = torch.Generator(device=dev()).manual_seed(4000 + i)
    P = cycled_world_size(i)
    spec = QuantSpec(bits=bits, group_size=g, rotation=rotation)
    numel = P * g * (2 + i % 5) - (i * 31) % (P * g)
    layout = A.Layout(numel, P, g)
    G = layout.groups_per_segment
    x = random_input(numel, g, dtype, gen)
    if i % 4 == 3:
        x[min(5, numel - 1)] = float("inf")  # its group's u is NaN: stored as zero
    comp = make_comp(gain=0.8, blend=0.3, slow=0.9, fast=0.2)
    r = ref_rotated(x, layout, spec)
    m1, m2 = random_state(layout, gen), random_state(layout, gen)
    comp.m1, comp.m2 = m1.view(r.shape).clone(), m2.view(r.shape).clone()
    r = r + comp.correction(r.shape, r.device)
    codes, scale, zero = A.quantize_segments(random_groups(P * G, g, gen).view(P, G, g), spec)
    amax = torch.tensor([123.0], device=dev()) if i % 2 else None
    k = ref_pow2(amax)
    s_hat = A.dequantize_segments(codes, scale, zero, spec)
    s_hat = s_hat * 2.0**-k if k else s_hat
    y_ref = A.from_segments(A.unrotate_if(s_hat, spec), layout, (numel,), dtype)
    e1, e2 = expected_state(comp, m1, m2, r - s_hat * reciprocal(P), list(range(P)))

    buf = packets_holding(ops, layout, spec, list(zip(codes, scale, zero)))
    table = ops.packet_table(list(buf), layout, spec)
    y = torch.full((numel,), float("nan"), dtype=dtype, device=dev())
    for first, count in ((0, 1), (1, P - 1)):  # the gather's own segment and the tail's others
        for b in range(0, G, 3):
            ops.dequantize(y, world_size=P, spec=spec, gathered=table, pow2_amax=amax, segment_begin=first,
                           num_segments=count, group_begin=b, num_groups=min(3, G - b), x=x, m1=m1, m2=m2,
                           coeffs=comp)
    torch.cuda.synchronize()
    assert_same(y, y_ref, "y")
    assert_same(m1, e1, "m1")
    assert_same(m2, e2, "m2")


# ----------------------------------------------------------------------------------------------------
# The chained stages of P ranks against the emulator (several calls, so the state evolves)
# ----------------------------------------------------------------------------------------------------

def kernel_all_reduce(ops, parts, spec, state, coeffs, residual, pow2):
    """One Echo all-reduce of P emulated ranks through the kernels; state: per-rank [m1, m2] (bf16), updated
    by the stages as the transport runs them (entry and owner reduce: "local"; dequantize: "output")."""
    P = parts.shape[0]
    x_shape = parts.shape[1:]
    layout = A.Layout(parts[0].numel(), P, spec.group_size)
    comp_kw = [{} if state is None else dict(m1=state[i][0], m2=state[i][1], coeffs=coeffs) for i in range(P)]
    local = state is not None and residual == "local"
    amax = None
    if pow2:
        amaxes = torch.stack([poison_f32(1) for _ in range(P)])
        for i in range(P):
            ops.pow2_amax(parts[i], amaxes[i], world_size=P, spec=spec, **comp_kw[i])
        amax = amaxes.amax().reshape(1)  # the max all-reduce
    send = [poison_packets(P, layout, spec, ops) for _ in range(P)]  # send[i][j]: rank i's copy of segment j
    for i in range(P):
        ops.push_quantize(parts[i], rank=i, world_size=P, spec=spec,
                          out=ops.packet_table([None if j == i else send[i][j] for j in range(P)], layout, spec),
                          update_state=local, pow2_amax=amax, **comp_kw[i])
    gathered = poison_packets(P, layout, spec, ops)
    for j in range(P):
        ops.owner_reduce(parts[j], rank=j, world_size=P, spec=spec,
                         copies=ops.packet_table([None if r == j else send[r][j] for r in range(P)], layout, spec),
                         out=ops.packet_table([gathered[j] if d == j else None for d in range(P)], layout, spec),
                         update_state=local, pow2_amax=amax, **comp_kw[j])
    table = ops.packet_table(list(gathered), layout, spec)
    ys = []
    for i in range(P):
        y = torch.full(x_shape, float("nan"), dtype=parts.dtype, device=dev())
        update = dict(x=parts[i], **comp_kw[i]) if state is not None and residual == "output" else {}
        ops.dequantize(y, world_size=P, spec=spec, gathered=table, pow2_amax=amax, **update)
        ys.append(y)
    torch.cuda.synchronize()
    return ys


E2E_CASES = [
    # P, dtype, bits, quantizer, rotation, g, residual, pow2, numel
    (2, torch.bfloat16, 4, "zero_aware", False, 128, "output", False, 10_000),
    (4, torch.float16, 4, "zero_aware", True, 128, "output", True, 77_777),
    (4, torch.bfloat16, 4, "zero_aware", True, 128, "local", True, 131_072),
    (8, torch.float32, 8, "symmetric", False, 64, "local", False, 5_003),
    (8, torch.float16, 4, "naive", True, 256, "output", False, 40_001),
    (8, torch.bfloat16, 8, "zero_aware", True, 256, "local", True, 999_999),
    (2, torch.float32, 4, "symmetric", True, 64, "output", True, 1),
    (2, torch.float16, 4, "zero_aware", True, 128, "local", False, 65_536),
    (4, torch.bfloat16, 4, "zero_aware", False, 128, None, True, 3_000_017),
]


@pytest.mark.parametrize("case", E2E_CASES, ids=[f"P{c[0]}-{str(c[1])[6:]}-b{c[2]}-{c[3]}-rot{int(c[4])}-g{c[5]}-{c[6]}"
                                                 f"-pow2{int(c[7])}-n{c[8]}" for c in E2E_CASES])
def test_all_reduce_matches_emulator(ops, case):
    """Four calls: y and both ranks' states bitwise equal to the emulator's after each. The third carries a
    NaN and an inf (NaN over their groups in y; the state of those groups restarts from zero), the fourth
    is clean again and must be finite everywhere (a non-finite call poisons only itself)."""
    from echo_ds.emulate import emulated_echo_all_reduce

    P, dtype, bits, quantizer, rotation, g, residual, pow2, numel = case
    gen = torch.Generator(device=dev()).manual_seed(numel)
    spec = QuantSpec(bits=bits, group_size=g, quantizer=quantizer, rotation=rotation)
    comp = make_comp(residual=residual) if residual else None
    layout = A.Layout(numel, P, g)
    state = None
    if comp is not None:
        from echo_ds.compensator import kStateDtype

        state = [[torch.zeros(layout.padded_numel, dtype=kStateDtype, device=dev()) for _ in range(2)]
                 for _ in range(P)]
    for call in range(4):
        parts = torch.stack([random_input(numel, g, dtype, gen) for _ in range(P)])
        poisoned = call == 2 and numel > 1000
        if poisoned:
            parts[1, 517] = float("nan")  # NaN propagates over its group, on every rank
            parts[0, 901] = float("inf")
        y_ref = emulated_echo_all_reduce(parts, spec, comp, pow2)
        ys = kernel_all_reduce(ops, parts, spec, state, comp, residual, pow2)
        for i in range(P):
            assert_same(ys[i], y_ref, f"call {call}: y on rank {i}")
        if comp is not None:
            for i in range(P):
                assert_same(state[i][0], comp.m1[i].reshape(-1), f"call {call}: m1 of rank {i}")
                assert_same(state[i][1], comp.m2[i].reshape(-1), f"call {call}: m2 of rank {i}")
                assert bool(torch.isfinite(state[i][0].float()).all()), f"call {call}: the state stays finite"
        if poisoned:
            y0 = ys[0].reshape(-1).float()
            for pos in (517, 901):
                grp = pos // g * g
                assert bool(torch.isnan(y0[grp:grp + g]).all()), "a non-finite input must give NaN over its group"
        elif call == 3:
            assert bool(torch.isfinite(ys[0].float()).all()), "a clean call after a non-finite one is finite"


@pytest.mark.parametrize("quantizer", ["zero_aware", "symmetric"])
@pytest.mark.parametrize("rotation", [False, True])
def test_fp16_sum_at_the_range_edge_saturates(ops, quantizer, rotation):
    """Two fp16 ranks at 32736: the codes carry the sum past 65504 (up to 82358 before the cast), and the
    dequantize saturates to 65504 as algorithm.from_segments does: bitwise the emulator's, all finite."""
    from echo_ds.emulate import emulated_echo_all_reduce

    spec = QuantSpec(bits=4, group_size=128, quantizer=quantizer, rotation=rotation)
    parts = torch.full((2, 4096), 32736.0, dtype=torch.float16, device=dev())
    parts[1, ::3] = 32700
    y_ref = emulated_echo_all_reduce(parts, spec)
    ys = kernel_all_reduce(ops, parts, spec, None, None, None, False)
    for i in range(2):
        assert_same(ys[i], y_ref, f"y on rank {i}")
    assert bool(torch.isfinite(ys[0].float()).all()) and ys[0].float().abs().max().item() <= 65504.0


# ----------------------------------------------------------------------------------------------------
# One large case: a 1 GB fp16 message through entry, owner reduce and dequantize (P = 4, one rank's view)
# ----------------------------------------------------------------------------------------------------

def test_one_gigabyte(ops):
    gen = torch.Generator(device=dev()).manual_seed(1 << 30)
    P, g = 4, 128
    spec = QuantSpec(bits=4, group_size=g, quantizer="zero_aware")
    numel = (1 << 29) - 5  # 1 GB of fp16, a length that needs padding
    x = (torch.randn(numel, generator=gen, device=dev()) * 3.0).to(torch.float16)
    layout = A.Layout(numel, P, g)
    rank = 1
    packets = poison_packets(P, layout, spec, ops)
    ops.push_quantize(x, rank=rank, world_size=P, spec=spec,
                      out=ops.packet_table([None if j == rank else packets[j] for j in range(P)], layout, spec))
    torch.cuda.synchronize()
    segs = A.to_segments(x.reshape(1, -1), layout)[0]
    for j in range(P):
        if j == rank:
            continue
        codes, scale, zero = A.quantize_segments(segs[j], spec)
        assert_packet(ops, packets[j], layout, spec, codes, scale, zero, f"segment {j}")
        del codes, scale, zero
    # Owner reduce of segment `rank` with the other ranks' copies taken as this rank's own codes of other
    # segments (any valid codes will do), then dequantize everything.
    copies = [packets[j] if j != rank else None for j in range(P)]
    gathered = poison_packets(P, layout, spec, ops)
    ops.owner_reduce(x, rank=rank, world_size=P, spec=spec, copies=ops.packet_table(copies, layout, spec),
                     out=ops.packet_table([gathered[rank] if d == rank else None for d in range(P)], layout, spec))
    terms = torch.stack([segs[rank] if r == rank else A.dequantize_segments(*read_packet(ops, packets[r], layout, spec), spec)
                         for r in range(P)])
    acc = A.ordered_sum(terms)
    del terms
    codes, scale, zero = A.quantize_segments(acc, spec)
    torch.cuda.synchronize()
    assert_packet(ops, gathered[rank], layout, spec, codes, scale, zero, "reduced segment")
    del acc, codes, scale, zero
    for j in range(P):
        if j != rank:
            gathered[j].copy_(packets[j])
    y = torch.full((numel,), float("nan"), dtype=torch.float16, device=dev())
    ops.dequantize(y, world_size=P, spec=spec, gathered=ops.packet_table(list(gathered), layout, spec))
    s_hat = torch.stack([A.dequantize_segments(*read_packet(ops, gathered[j], layout, spec), spec) for j in range(P)])
    torch.cuda.synchronize()
    assert_same(y, A.from_segments(s_hat, layout, (numel,), torch.float16), "y")


@pytest.mark.parametrize("P", [3, 5])
def test_unsupported_world_size_raises(ops, P):
    spec = QuantSpec(bits=4, group_size=128)
    x = torch.randn(1000, device=dev())
    layout = A.Layout(x.numel(), P, 128)
    packets = ops.alloc_packets(P, layout, spec, dev())
    with pytest.raises(RuntimeError, match=f"unsupported world size {P}"):
        ops.push_quantize(x, rank=0, world_size=P, spec=spec, out=ops.packet_table([None, *packets[1:]], layout, spec))


def test_cuda_path_available(ops):
    assert ops.available()
    assert math.isfinite(ops.load_seconds())
