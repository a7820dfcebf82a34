"""The compensator's numerics contract (echo_ds/compensator.py): fp32 arithmetic, one rounding when
stored, non-finite values stored as zero; the "bf16" format (tests that read m1, m2 as bfloat16 ask for it
by name: the default is "int4"); the narrow formats ("int8", "int4": integers with one power-of-two
exponent per group, saturating); state_dict / load_state_dict; no autograd graph."""

from __future__ import annotations

import pytest
import torch

from echo_ds import algorithm as A
from echo_ds import compensator as C
from echo_ds.compensator import Compensator, kStateDtype, store_state
from echo_ds.config import STATE_DTYPES, DirectionConfig, EchoConfig
from echo_ds.emulate import CompensatedAllReduce


def make(residual="local", **kw) -> Compensator:
    return Compensator(DirectionConfig(residual=residual, **kw))


def test_store_state_rounds_to_nearest_even_and_zeroes_non_finite():
    bf16_max = torch.finfo(torch.bfloat16).max
    v = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -0.0, 2.0**-130, bf16_max, 3.4e38, float("nan"),
                      float("inf"), -float("inf"), -3.4e38])
    s = store_state(v)
    assert s.dtype == kStateDtype == torch.bfloat16
    # Ties to even: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7 (keeps 1); 1 + 3 2^-8 goes up to 1 + 2^-6.
    assert s[0].item() == 1.0 and s[1].item() == 1.0 + 2.0**-6
    assert s[2].item() == 0.0 and torch.signbit(s[2])  # a finite zero keeps its sign
    assert s[3].item() == 2.0**-130  # bf16 has fp32's exponent range (subnormal here), nothing flushes
    assert s[4].item() == bf16_max
    # Finite fp32 that rounds past bf16's range, NaN and the infinities: stored as +0.
    for i in range(5, 10):
        assert s[i].item() == 0.0 and not torch.signbit(s[i]), i


def test_update_is_fp32_arithmetic_rounded_once():
    comp = make(slow_decay=0.7, fast_decay=0.3, state_dtype="bf16")
    gen = torch.Generator().manual_seed(0)
    comp.correction((4096,), "cpu")  # allocates the zero state
    comp.m1.copy_(torch.randn(4096, generator=gen).to(kStateDtype))
    comp.m2.copy_(torch.randn(4096, generator=gen).to(kStateDtype))
    m1, m2 = comp.m1.double(), comp.m2.double()
    u = torch.randn(4096, generator=gen)
    comp.update(u)
    assert comp.m1.dtype == kStateDtype and comp.m2.dtype == kStateDtype
    # The result is the bf16 nearest to the fp32 expression: within half a bf16 ulp of the exact value
    # plus the fp32 operations' own rounding (far smaller).
    for m, old, d in ((comp.m1, m1, comp.slow_decay), (comp.m2, m2, comp.fast_decay)):
        exact = old * d + u.double() * (1 - d)
        ulp = torch.finfo(torch.bfloat16).eps * exact.abs()
        assert bool(((m.double() - exact).abs() <= 0.5 * ulp + 1e-6 * exact.abs() + 1e-30).all())
    # ... and it is exactly what the kernels compute: store_state of the fp32 expression.
    comp2 = make(slow_decay=0.7, fast_decay=0.3, state_dtype="bf16")
    comp2.correction((4096,), "cpu")
    comp2.m1.copy_(m1.to(kStateDtype)), comp2.m2.copy_(m2.to(kStateDtype))
    expected = store_state(comp2.m1.float() * comp2.slow_decay + u * comp2.one_minus_slow)
    comp2.update(u)
    assert torch.equal(comp2.m1.view(torch.int16), expected.view(torch.int16))


def test_correction_reads_the_state_exactly():
    comp = make(gain=0.8, blend=0.3, state_dtype="bf16")
    comp.correction((256,), "cpu")
    comp.m1.copy_(torch.linspace(-1, 1, 256).to(kStateDtype))
    comp.m2.copy_(torch.linspace(2, -2, 256).to(kStateDtype))
    c = comp.correction((256,), "cpu")
    assert c.dtype == torch.float32
    expected = (comp.m1.float() * comp.blend + comp.m2.float() * comp.one_minus_blend) * comp.gain
    assert torch.equal(c, expected)


@pytest.mark.parametrize("state_dtype", ["bf16", "int4"])
@pytest.mark.parametrize("residual", ["local", "output"])
def test_a_non_finite_call_poisons_only_itself(residual, state_dtype):
    # the slices below are groups of 128
    cfg = EchoConfig(group_size=128, forward={"residual": residual, "state_dtype": state_dtype})
    op = CompensatedAllReduce(4, cfg)
    gen = torch.Generator().manual_seed(1)
    op(torch.randn(4, 4096, generator=gen))
    bad = torch.randn(4, 4096, generator=gen)
    bad[2, 300] = float("nan")
    bad[1, 1000] = float("inf")
    y = op(bad)
    assert torch.isnan(y[256:384]).all() and torch.isnan(y[896:1024]).all()
    m1, m2 = op.compensator.values()
    assert torch.isfinite(m1).all() and torch.isfinite(m2).all()
    # Where a residual was non-finite the state restarted from zero; elsewhere it kept its estimate.
    assert (m1 == 0).any() and (m1 != 0).any()
    clean = torch.randn(4, 4096, generator=gen)
    y = op(clean)
    assert torch.isfinite(y).all()
    assert (y - clean.sum(0)).abs().max() < 0.5 * clean.sum(0).abs().max()


def test_state_memory_is_two_bytes_per_element_per_average():
    op = CompensatedAllReduce(2, EchoConfig(forward={"state_dtype": "bf16"}))
    op(torch.randn(2, 10_000))
    padded = A.Layout(10_000, 2, EchoConfig().group_size).padded_numel
    comp = op.compensator
    assert comp.m1.dtype == comp.m2.dtype == torch.bfloat16
    assert comp.m1.numel() * comp.m1.element_size() + comp.m2.numel() * comp.m2.element_size() == 2 * 2 * 2 * padded


def test_inputs_that_require_grad_leave_no_graph_in_the_state():
    op = CompensatedAllReduce(2, EchoConfig())
    for _ in range(3):
        parts = torch.randn(2, 1000, requires_grad=True)
        op(parts)
        for name in op.compensator.state_names:
            t = getattr(op.compensator, name)
            assert not t.requires_grad and t.grad_fn is None, name
        assert not any(v.requires_grad for v in op.compensator.values())


def test_state_dict_is_a_copy_and_round_trips():
    # The default format's tensors, each by name (state_names).
    op = CompensatedAllReduce(2, EchoConfig())
    op(torch.randn(2, 1000))
    comp = op.compensator
    names = comp.state_names
    held = (lambda c: [getattr(c, name) for name in names])
    sd = comp.state_dict()
    assert set(sd) == set(names) | {"num_calls"}
    for name, live in zip(names, held(comp)):
        assert sd[name].data_ptr() != live.data_ptr() and torch.equal(sd[name], live), name
    before = [t.clone() for t in held(comp)]
    for name in names:
        sd[name].fill_(7)
    assert all(map(torch.equal, held(comp), before)), "state_dict must not hand out the live tensors"
    other = make()
    other.load_state_dict(comp.state_dict())
    assert all(map(torch.equal, held(other), held(comp))) and other.num_calls == comp.num_calls
    src = comp.state_dict()
    other.load_state_dict(src)
    for name in names:
        src[name].fill_(3)
    assert all(map(torch.equal, held(other), held(comp))), "load_state_dict must copy in"
    empty = make()
    empty.load_state_dict(make().state_dict())  # a fresh state (None, None, 0) round-trips too
    assert all(t is None for t in held(empty)) and empty.num_calls == 0


@pytest.mark.parametrize("change,match", [
    (lambda sd: sd.pop("m2"), "missing keys \\['m2'\\]"),
    (lambda sd: sd.update(extra=1), "unknown keys \\['extra'\\]"),
    (lambda sd: sd.update(m1=sd["m1"].float()), "m1 must be a torch.bfloat16 tensor, got torch.float32"),
    (lambda sd: sd.update(m2=sd["m2"][:-128]), "must match"),
    (lambda sd: sd.update(m1=None), "must both be tensors or both None"),
    (lambda sd: sd.update(num_calls=-1), "num_calls=-1"),
    (lambda sd: sd.update(num_calls=True), "num_calls=True"),
])
def test_load_state_dict_refuses_bad_state(change, match):
    # The bf16 format's messages (the integer formats': the int8 and int4 tests below).
    op = CompensatedAllReduce(2, EchoConfig(forward={"state_dtype": "bf16"}))
    op(torch.randn(2, 1000))
    sd = op.compensator.state_dict()
    change(sd)
    with pytest.raises(ValueError, match=match):
        make(state_dtype="bf16").load_state_dict(sd)


def test_update_without_a_matching_state_raises():
    comp = make()
    with pytest.raises(RuntimeError, match="without a matching correction"):
        comp.update(torch.zeros(128))
    comp.correction((256,), "cpu")
    with pytest.raises(RuntimeError, match="residual of shape \\(128,\\)"):
        comp.update(torch.zeros(128))


# ----------------------------------------------------------------------------------------------------
# The narrow formats ("int8", "int4")
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", (8, 4))
def test_encode_state_puts_the_group_max_in_the_top_binade_and_saturates(bits):
    qmax = 2 ** (bits - 1) - 1
    gen = torch.Generator().manual_seed(bits)
    n1 = torch.randn(300, 64, generator=gen) * torch.logspace(-30, 30, 300)[:, None]
    n2 = torch.randn(300, 64, generator=gen) * torch.logspace(-30, 30, 300)[:, None] * 0.3
    q1, q2, e = C.encode_state(n1, n2, bits)
    assert q1.dtype == q2.dtype == e.dtype == torch.int8 and e.shape == (300,)
    a = torch.maximum(n1.abs().amax(-1), n2.abs().amax(-1))
    step = 2.0 ** e.double()
    # The group's largest value lies in [2^(b-2), 2^(b-1)) steps: the step follows the group.
    assert bool(((a / step >= 2 ** (bits - 2)) & (a / step < 2 ** (bits - 1))).all())
    for q, n in ((q1, n1), (q2, n2)):
        assert int(q.abs().max()) <= qmax
        back = C.decode_state(q, e).double()
        assert torch.equal(back, q.double() * step[:, None])  # exact decode
        err = (back - n.double()).abs()
        inside = n.double().abs() <= qmax * step[:, None]
        assert bool((err[inside] <= 0.5 * step.expand(64, -1).T[inside]).all())  # round to nearest
        assert bool((err[~inside] <= step.expand(64, -1).T[~inside]).all())  # saturated: < one step
        # never wraps: a saturated code keeps its value's sign and the largest magnitude
        assert bool((q[~inside].abs() == qmax).all()) and bool((q[~inside].sign() == n[~inside].sign()).all())
    assert int(q1.abs().max()) == qmax  # some group's largest value reached the top code


def test_encode_state_rounds_half_to_even_and_stores_zero_groups_alike():
    # Group max 7.5 -> E = 0 for int4 (7.5 = 0.94 2^3, E = 3 - 3): 2.5 -> 2, 3.5 -> 4, -0.5 -> 0, 7.5 -> 7.
    n = torch.tensor([[2.5, 3.5, -0.5, 7.5]])
    q1, q2, e = C.encode_state(n, torch.zeros_like(n), 4)
    assert e.tolist() == [0] and q1.tolist() == [[2, 4, 0, 7]] and q2.tolist() == [[0, 0, 0, 0]]
    zero = torch.zeros(3, 8)
    zero[1, 2] = 1e-40  # subnormal
    q1, q2, e = C.encode_state(zero, zero, 8)
    assert e.tolist() == [C.kMinStateExp] * 3 and not q1.any()
    assert C.encode_state(torch.full((1, 4), 3.0e38), torch.zeros(1, 4), 4)[2].item() <= C.kMaxStateExp


@pytest.mark.parametrize("state_dtype", ("int8", "int4"))
def test_narrow_update_is_the_fp32_expression_encoded_per_group(state_dtype):
    comp = make(slow_decay=0.7, fast_decay=0.3, state_dtype=state_dtype)
    gen = torch.Generator().manual_seed(2)
    shape = (2, 4, 16, 64)
    comp.correction(shape, "cpu")
    assert comp.exponent.dtype == torch.int8 and comp.exponent.shape == shape[:-1]
    for _ in range(3):  # a few updates, so the old state is not zero
        u = torch.randn(shape, generator=gen) * torch.rand(shape[:-1] + (1,), generator=gen)
        m1, m2 = comp.values()
        q1, q2, exponent = C.encode_state(m1 * comp.slow_decay + u * comp.one_minus_slow,
                                          m2 * comp.fast_decay + u * comp.one_minus_fast, C.kStateBits[state_dtype])
        comp.update(u)
        codes = (C.pack_int4(q1, q2),) if state_dtype == "int4" else (q1, q2)
        for name, want in zip(comp.state_names, codes + (exponent,)):
            assert torch.equal(getattr(comp, name), want), name
    # The correction reads the decoded values, in the bf16 path's order.
    m1, m2 = comp.values()
    assert torch.equal(comp.correction(shape, "cpu"), (m1 * comp.blend + m2 * comp.one_minus_blend) * comp.gain)


def test_narrow_update_zeroes_non_finite_values_only():
    # A residual with NaN and inf stores what the same residual with zeros there stores: the rest of the
    # group keeps its estimate (its exponent included).
    gen = torch.Generator().manual_seed(4)
    u = torch.randn(2, 64, generator=gen)
    bad = u.clone()
    bad[0, 5], bad[1, 7] = float("nan"), float("inf")
    u[0, 5], u[1, 7] = 0.0, 0.0
    comp, clean = make(state_dtype="int4"), make(state_dtype="int4")
    for c, residual in ((comp, bad), (clean, u)):
        c.correction((2, 64), "cpu")
        c.update(residual)
    assert all(torch.equal(getattr(comp, n), getattr(clean, n)) for n in comp.state_names)
    m1, m2 = comp.values()
    assert m1[0, 5] == 0 and m2[1, 7] == 0 and torch.isfinite(m1).all() and torch.isfinite(m2).all()
    assert (m2[0] != 0).sum() > 32  # the state moved: the comparison is not of zeros


def test_state_bytes_per_element():
    assert C.state_bytes_per_element("bf16", 64) == 4
    assert C.state_bytes_per_element("int8", 64) == 2 + 1 / 64
    assert C.state_bytes_per_element("int4", 64) == 1 + 1 / 64
    with pytest.raises(ValueError, match="state_dtype='fp8'"):
        C.state_bytes_per_element("fp8", 64)



@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_the_reference_holds_the_bytes_per_element_it_states(state_dtype):
    # The tensors of state_names, as the kernels hold them: "int4" one uint8 per element (both codes) and
    # one int8 exponent per group.
    P, n = 2, 10_000
    op = CompensatedAllReduce(P, EchoConfig(forward={"state_dtype": state_dtype}))
    op(torch.randn(P, n))
    comp = op.compensator
    g = EchoConfig().group_size
    shape = (P, P, A.Layout(n, P, g).groups_per_segment, g)  # the emulator's batch of P ranks
    held = {name: getattr(comp, name) for name in comp.state_names}
    assert {name: t.dtype for name, t in held.items()} == C.kStateTensorDtypes[state_dtype]
    for name, t in held.items():
        assert t.shape == (shape[:-1] if name == "exponent" else shape), name
    assert sum(t.numel() * t.element_size() for t in held.values()) == \
        C.state_bytes_per_element(state_dtype, g) * (P * P * shape[2] * g)
    if state_dtype == "int4":
        assert comp.state_names == ("q", "exponent") and comp.m1 is None and comp.m2 is None
    else:
        assert comp.q is None


def test_int4_holds_q_and_exponent_through_reset_and_resize():
    comp = make(state_dtype="int4")
    comp.correction((2, 3, 64), "cpu")
    assert comp.q.dtype == torch.uint8 and not comp.q.any()  # zero codes in both nibbles
    assert bool((comp.exponent == C.kMinStateExp).all())  # as encode_state stores a zero group
    comp.update(torch.randn(2, 3, 64))
    comp.correction((2, 5, 64), "cpu")  # another length: a new zero state
    assert comp.num_resizes == 1 and comp.q.shape == (2, 5, 64) and not comp.q.any()
    comp.reset()
    assert comp.q is None and comp.exponent is None and comp.num_calls == 0


def test_pack_int4_nibbles():
    q1 = torch.tensor([-7, -1, 0, 3, 7], dtype=torch.int8)
    q2 = torch.tensor([7, 1, -2, -7, 0], dtype=torch.int8)
    packed = C.pack_int4(q1, q2)
    assert packed.tolist() == [0x79, 0x1F, 0xE0, 0x93, 0x07]
    lo = (packed.to(torch.int32) & 0xF)
    hi = (packed.to(torch.int32) >> 4)
    assert torch.equal(torch.where(lo > 7, lo - 16, lo).to(torch.int8), q1)
    assert torch.equal(torch.where(hi > 7, hi - 16, hi).to(torch.int8), q2)


def test_unpack_int4_inverts_pack_int4_over_every_pair_of_codes():
    codes = torch.arange(-7, 8, dtype=torch.int8)
    q1, q2 = torch.meshgrid(codes, codes, indexing="ij")  # all 15 x 15 pairs
    packed = C.pack_int4(q1, q2)
    assert packed.dtype == torch.uint8 and packed.unique().numel() == 15 * 15
    back1, back2 = C.unpack_int4(packed)
    assert back1.dtype == back2.dtype == torch.int8
    assert torch.equal(back1, q1) and torch.equal(back2, q2)
    # Every byte decodes to its two nibbles, sign-extended (0x8 to -8, no code of the format).
    every = torch.arange(256)
    signed = (lambda n: torch.where(n > 7, n - 16, n))
    lo, hi = C.unpack_int4(every.to(torch.uint8))
    assert torch.equal(lo.long(), signed(every % 16)) and torch.equal(hi.long(), signed(every // 16))


def _old_int4_run(comp, us):
    """The "int4" update as it was before the state was held packed: int8 codes q1, q2 (one per value),
    decoded and encoded with the same functions. Returns the correction of every call and the codes."""
    shape = us[0].shape
    q1 = torch.zeros(shape, dtype=torch.int8)
    q2 = torch.zeros(shape, dtype=torch.int8)
    exponent = torch.full(shape[:-1], C.kMinStateExp, dtype=torch.int8)
    corrections = []
    for u in us:
        m1, m2 = C.decode_state(q1, exponent), C.decode_state(q2, exponent)
        corrections.append((m1 * comp.blend + m2 * comp.one_minus_blend) * comp.gain)
        n1 = m1 * comp.slow_decay + u * comp.one_minus_slow
        n2 = m2 * comp.fast_decay + u * comp.one_minus_fast
        finite = (lambda n: torch.where(torch.isfinite(n), n, torch.zeros(())))
        q1, q2, exponent = C.encode_state(finite(n1), finite(n2), 4)
    return corrections, q1, q2, exponent


def test_packed_int4_state_has_the_numbers_of_the_int8_codes_it_replaced():
    comp = make(gain=0.9, blend=0.3, slow_decay=0.8, fast_decay=0.3, state_dtype="int4")
    gen = torch.Generator().manual_seed(11)
    shape = (3, 16, 64)
    us = [torch.randn(shape, generator=gen) * torch.logspace(-20, 20, 16)[:, None] for _ in range(6)]
    us[3][1, 2, 5] = float("nan")
    want, q1, q2, exponent = _old_int4_run(comp, us)
    for u, c_want in zip(us, want):
        c = comp.correction(shape, "cpu")
        assert torch.equal(c.view(torch.int32), c_want.view(torch.int32))
        comp.update(u)
    assert torch.equal(comp.q, C.pack_int4(q1, q2)) and torch.equal(comp.exponent, exponent)
    m1, m2 = comp.values()
    assert torch.equal(m1, C.decode_state(q1, exponent)) and torch.equal(m2, C.decode_state(q2, exponent))
    assert bool((q1 != 0).any() and (q2 != 0).any())  # the state moved: the comparison is not of zeros


def _with_nibble(q: torch.Tensor, high: bool) -> torch.Tensor:
    """q with one byte's low (or high) nibble set to 0x8, the -8 that no "int4" code is."""
    q = q.clone()
    flat = q.view(-1)
    flat[5] = (int(flat[5]) & 0x0F) | 0x80 if high else (int(flat[5]) & 0xF0) | 0x08
    return q


def test_int4_state_dict_round_trips_and_is_validated():
    op = CompensatedAllReduce(2, EchoConfig(forward={"state_dtype": "int4"}))
    op(torch.randn(2, 1000))
    comp = op.compensator
    sd = comp.state_dict()
    assert set(sd) == {"q", "exponent", "num_calls"} and sd["q"].dtype == torch.uint8
    other = make(state_dtype="int4")
    other.load_state_dict(sd)
    assert torch.equal(other.q, comp.q) and torch.equal(other.exponent, comp.exponent)
    assert all(torch.equal(a, b) for a, b in zip(other.values(), comp.values()))
    sd["q"].fill_(0x11)
    assert not torch.equal(other.q, sd["q"]), "load_state_dict must copy in"
    sd["exponent"].fill_(3)
    assert not torch.equal(comp.exponent, sd["exponent"]), "state_dict must not hand out the live tensors"
    empty = make(state_dtype="int4")
    empty.load_state_dict(make(state_dtype="int4").state_dict())  # a fresh state (None, None, 0)
    assert empty.q is None and empty.exponent is None and empty.num_calls == 0
    codes = "codes must lie in \\[-7, 7\\] \\(both nibbles of q"
    for change, match in (
            (lambda d: d.pop("exponent"), "missing keys \\['exponent'\\]"),
            (lambda d: d.update(m1=d["q"]), "unknown keys \\['m1'\\]"),
            (lambda d: d.update(q=d["q"].view(torch.int8)), "q must be a torch.uint8 tensor, got torch.int8"),
            (lambda d: d.update(exponent=d["exponent"].to(torch.int16)), "exponent must be a torch.int8 tensor"),
            (lambda d: d.update(q=_with_nibble(d["q"], high=False)), codes),
            (lambda d: d.update(q=_with_nibble(d["q"], high=True)), codes),
            (lambda d: d.update(exponent=d["exponent"].fill_(C.kMaxStateExp + 1)), "exponents in \\[-126, 126\\]"),
            (lambda d: d.update(exponent=d["exponent"].fill_(C.kMinStateExp - 1)), "exponents in \\[-126, 126\\]"),
            (lambda d: d.update(exponent=d["exponent"][..., :-1]), "exponent .* must have q's shape"),
            (lambda d: d.update(exponent=d["exponent"].to("meta")), "exponent .* on meta must have q's shape"),
            (lambda d: d.update(exponent=None), "q and exponent must both be tensors or both None")):
        bad = comp.state_dict()
        change(bad)
        with pytest.raises(ValueError, match=match):
            make(state_dtype="int4").load_state_dict(bad)
    with pytest.raises(ValueError, match="unknown keys \\['exponent', 'q'\\]"):
        make(state_dtype="bf16").load_state_dict(comp.state_dict())  # an int4 state into a bf16 compensator
    with pytest.raises(ValueError, match="missing keys \\['m1', 'm2'\\], unknown keys \\['q'\\]"):
        make(state_dtype="int8").load_state_dict(comp.state_dict())


def test_int8_state_dict_round_trips_and_is_validated():
    op = CompensatedAllReduce(2, EchoConfig(forward={"state_dtype": "int8"}))
    op(torch.randn(2, 1000))
    comp = op.compensator
    sd = comp.state_dict()
    assert set(sd) == {"m1", "m2", "exponent", "num_calls"}
    other = make(state_dtype="int8")
    other.load_state_dict(sd)
    assert all(torch.equal(getattr(other, n), getattr(comp, n)) for n in comp.state_names)
    smallest = (lambda t: t.clone().view(-1).index_fill_(0, torch.tensor([3]), -128).view(t.shape))
    for change, match in (
            (lambda d: d.update(m1=d["m1"].to(torch.bfloat16)), "m1 must be a torch.int8 tensor"),
            (lambda d: d.update(m2=smallest(d["m2"])), "codes must lie in \\[-127, 127\\] and"),
            (lambda d: d.update(m2=d["m2"][:-1]), "m1 .* and m2 .* must match"),
            (lambda d: d.update(exponent=d["exponent"][..., :-1]), "exponent .* must have m1's shape"),
            (lambda d: d.update(exponent=None), "m1, m2 and exponent must all be tensors or all None")):
        bad = comp.state_dict()
        change(bad)
        with pytest.raises(ValueError, match=match):
            make(state_dtype="int8").load_state_dict(bad)


@pytest.mark.parametrize("state_dtype", ("int8", "int4"))
def test_narrow_state_steps_follow_each_groups_magnitude(state_dtype):
    # Inputs spanning six decades: each group's step follows its own largest value.
    P, n = 4, 4096
    gen = torch.Generator().manual_seed(9)
    op = CompensatedAllReduce(P, EchoConfig(forward={"state_dtype": state_dtype}))
    for _ in range(4):
        op(torch.randn(P, n, generator=gen) * torch.logspace(-3, 3, n)[None])
    m1 = op.compensator.values()[0]
    step = 2.0 ** op.compensator.exponent.float()
    a = m1.abs().amax(-1)
    assert bool((a <= 2 ** (C.kStateBits[state_dtype] - 1) * step).all())
    assert float(step.max() / step.min()) > 1e3  # a step per group, not per tensor


@pytest.mark.parametrize("state_dtype", ("bf16", "int8", "int4"))
def test_the_staged_schedule_hands_the_kernels_every_stored_format(state_dtype):
    # The stages take the state as kernel_state gives it: "int4" its packed bytes q in m1's place (its own
    # m1, m2 are None, which must not pass for "no compensator"), "int8" the exponents beside m1 and m2.
    from echo_ds.ops import kernels as K
    from echo_ds.p2p.stages import KernelSchedule

    sched = object.__new__(KernelSchedule)  # begin() and _state() need the kernels' module only
    sched.ops = K
    x = torch.randn(256)
    comp = make(state_dtype=state_dtype)
    comp.correction((2, 2, 64), "cpu")
    sched.begin(x, torch.empty_like(x), comp, False)
    state = sched._state()
    assert state["coeffs"] is comp and state["m1"] is (comp.q if state_dtype == "int4" else comp.m1)
    assert state["m2"] is comp.m2 and state["exponent"] is comp.exponent
    assert K._state_args(state["m1"], state["m2"], state["exponent"], comp)[:3] == (state["m1"], state["m2"],
                                                                                    state["exponent"])
