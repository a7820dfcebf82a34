"""The compensator's numerics contract (echo_ds/compensator.py, "Storage"): 8-bit codes with an fp32 scale
per group, fp32 arithmetic, one rounding when stored, non-finite values stored as zero; state_dict /
load_state_dict; no autograd graph in the state."""

from __future__ import annotations

import pytest
import torch

from echo_ds import collective as C
from echo_ds.compensator import (Compensator, StoredAverage, kStateCodeDtype, kStateInvCodeMax, kStateMinScale,
                                 store_state)
from echo_ds.config import DirectionConfig, EchoConfig
from echo_ds.emulate import CompensatedAllReduce


def make(residual="local", **kw) -> Compensator:
    return Compensator(DirectionConfig(residual=residual, **kw))


def test_store_state_codes_and_scale():
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(64, 128, generator=gen) * torch.logspace(-30, 30, 64)[:, None]
    st = store_state(v)
    assert st.codes.dtype == kStateCodeDtype == torch.int8 and st.codes.shape == v.shape
    assert st.scale.dtype == torch.float32 and st.scale.shape == (64,)
    assert int(st.codes.abs().max()) == 127 and int(st.codes.min()) >= -127
    # The scale is the group's largest magnitude times fp32(1/127), and every value is within half a step
    # (plus the fp32 rounding of v / s) of what it stores, across 60 orders of magnitude.
    assert torch.equal(st.scale, v.abs().amax(1) * kStateInvCodeMax)
    err = (st.value() - v).abs()
    assert bool((err <= st.scale[:, None] * (0.5 + 1e-5)).all())


def test_store_state_special_values():
    v = torch.tensor([[1.0, -2.0, float("nan"), 0.5] + [0.0] * 12,
                      [float("inf")] + [0.0] * 15,
                      [2.0**-125] * 16,
                      [3.0e38, -3.0e38] + [1.0] * 14,
                      [0.0] * 16])
    st = store_state(v)
    # NaN and infinities are stored as 0; the rest of their group keeps its values.
    assert st.codes[0, 2] == 0 and st.codes[0, 1] == -127 and st.codes[0, 0] == 64  # rint(63.5) = 64 (even)
    assert torch.equal(st.codes[1], torch.zeros(16, dtype=torch.int8)) and st.scale[1] == 0
    # A group whose scale would be below 2^-120 is stored as zero (and 1 / s never overflows).
    assert st.scale[2] == 0 and not bool(st.codes[2].any())
    assert 2.0**-125 * kStateInvCodeMax < kStateMinScale
    # fp32's largest values keep a finite scale; all-zero groups store zeros.
    assert torch.isfinite(st.scale[3]) and st.codes[3, 0] == 127 and st.codes[3, 1] == -127
    assert st.scale[4] == 0 and not bool(st.codes[4].any())
    assert bool(torch.isfinite(st.value()).all())


def test_update_is_fp32_arithmetic_rounded_once():
    comp = make(slow_decay=0.7, fast_decay=0.3)
    gen = torch.Generator().manual_seed(1)
    comp.correction((32, 128), "cpu")  # allocates the zero state
    comp.m1.copy_(store_state(torch.randn(32, 128, generator=gen)))
    comp.m2.copy_(store_state(torch.randn(32, 128, generator=gen)))
    old1, old2 = comp.m1.clone(), comp.m2.clone()
    u = torch.randn(32, 128, generator=gen)
    comp.update(u)
    expected = store_state(old1.value() * comp.slow_decay + u * comp.one_minus_slow)
    assert comp.m1.equal(expected)
    assert comp.m2.equal(store_state(old2.value() * comp.fast_decay + u * comp.one_minus_fast))
    # ... and close to the exact average (within half a code step of the group).
    exact = old1.value().double() * 0.7 + u.double() * 0.3
    assert bool(((comp.m1.value().double() - exact).abs() <= comp.m1.scale[:, None].double() * 0.51).all())


def test_correction_reads_the_state():
    comp = make(gain=0.8, blend=0.3)
    comp.correction((2, 128), "cpu")
    comp.m1.copy_(store_state(torch.linspace(-1, 1, 256).view(2, 128)))
    comp.m2.copy_(store_state(torch.linspace(2, -2, 256).view(2, 128)))
    c = comp.correction((2, 128), "cpu")
    assert c.dtype == torch.float32
    expected = (comp.m1.value() * comp.blend + comp.m2.value() * comp.one_minus_blend) * comp.gain
    assert torch.equal(c, expected)


@pytest.mark.parametrize("residual", ["local", "output"])
def test_a_non_finite_call_poisons_only_itself(residual):
    cfg = EchoConfig(forward={"residual": residual})
    op = CompensatedAllReduce(4, cfg)
    gen = torch.Generator().manual_seed(1)
    op(torch.randn(4, 4096, generator=gen))
    bad = torch.randn(4, 4096, generator=gen)
    bad[2, 300] = float("nan")
    bad[1, 1000] = float("inf")
    y = op(bad)
    assert torch.isnan(y[256:384]).all() and torch.isnan(y[896:1024]).all()
    for avg in (op.compensator.m1, op.compensator.m2):
        assert torch.isfinite(avg.scale).all() and torch.isfinite(avg.value()).all()
    # Where a residual was non-finite the state restarted from zero; elsewhere it kept its estimate.
    m1 = op.compensator.m1.value()
    assert (m1 == 0).any() and (m1 != 0).any()
    clean = torch.randn(4, 4096, generator=gen)
    y = op(clean)
    assert torch.isfinite(y).all()
    assert (y - clean.sum(0)).abs().max() < 0.5 * clean.sum(0).abs().max()


def test_state_memory_is_about_one_byte_per_element_per_average():
    op = CompensatedAllReduce(2, EchoConfig())
    op(torch.randn(2, 10_000))
    padded = C.Layout(10_000, 2, 128).padded_numel
    nbytes = sum(t.numel() * t.element_size() for avg in (op.compensator.m1, op.compensator.m2)
                 for t in (avg.codes, avg.scale))
    assert nbytes == 2 * 2 * (padded + 4 * padded // 128)  # P = 2 emulated ranks, two averages


def test_inputs_that_require_grad_leave_no_graph_in_the_state():
    op = CompensatedAllReduce(2, EchoConfig())
    for _ in range(3):
        parts = torch.randn(2, 1000, requires_grad=True)
        op(parts)
        for avg in (op.compensator.m1, op.compensator.m2):
            for t in avg:
                assert not t.requires_grad and t.grad_fn is None


def test_state_dict_is_a_copy_and_round_trips():
    op = CompensatedAllReduce(2, EchoConfig())
    op(torch.randn(2, 1000))
    comp = op.compensator
    sd = comp.state_dict()
    assert sd["m1_codes"].data_ptr() != comp.m1.codes.data_ptr() and torch.equal(sd["m1_codes"], comp.m1.codes)
    before = comp.m1.clone()
    sd["m1_codes"].fill_(7)
    sd["m1_scale"].fill_(7)
    assert comp.m1.equal(before), "state_dict must not hand out the live tensors"
    other = make()
    other.load_state_dict(comp.state_dict())
    assert other.m1.equal(comp.m1) and other.m2.equal(comp.m2) and other.num_calls == comp.num_calls
    src = comp.state_dict()
    other.load_state_dict(src)
    src["m2_scale"].fill_(3)
    assert other.m2.equal(comp.m2), "load_state_dict must copy in"
    empty = make()
    empty.load_state_dict(make().state_dict())  # a fresh state (all None, 0 calls) round-trips too
    assert empty.m1 is None and empty.num_calls == 0


@pytest.mark.parametrize("change,match", [
    (lambda sd: sd.pop("m2_codes"), "missing keys \\['m2_codes'\\]"),
    (lambda sd: sd.update(extra=1), "unknown keys \\['extra'\\]"),
    (lambda sd: sd.update(m1_codes=sd["m1_codes"].float()), "m1_codes must be a torch.int8 tensor, got torch.float32"),
    (lambda sd: sd.update(m2_scale=sd["m2_scale"].half()), "m2_scale must be a torch.float32 tensor"),
    (lambda sd: sd.update(m2_codes=sd["m2_codes"][..., :-1, :]), "shapes must match"),
    (lambda sd: sd.update(m1_scale=sd["m1_scale"][..., :-1]), "shapes must match"),
    (lambda sd: sd.update(m1_codes=None), "must all be tensors or all None"),
    (lambda sd: sd.update(num_calls=-1), "num_calls=-1"),
    (lambda sd: sd.update(num_calls=True), "num_calls=True"),
])
def test_load_state_dict_refuses_bad_state(change, match):
    op = CompensatedAllReduce(2, EchoConfig())
    op(torch.randn(2, 1000))
    sd = op.compensator.state_dict()
    change(sd)
    with pytest.raises(ValueError, match=match):
        make().load_state_dict(sd)


def test_update_without_a_matching_state_raises():
    comp = make()
    with pytest.raises(RuntimeError, match="without a matching correction"):
        comp.update(torch.zeros(2, 128))
    comp.correction((4, 128), "cpu")
    with pytest.raises(RuntimeError, match="residual of shape \\(2, 128\\)"):
        comp.update(torch.zeros(2, 128))


def test_stored_average_value_is_one_product():
    st = StoredAverage(torch.tensor([[-127, 1, 0, 77]], dtype=torch.int8), torch.tensor([0.1]))
    assert torch.equal(st.value(), torch.tensor([[-127.0, 1.0, 0.0, 77.0]]) * torch.tensor(0.1))
