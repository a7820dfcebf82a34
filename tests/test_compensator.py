"""The compensator's numerics contract (echo_ds/compensator.py): bf16 storage, fp32 arithmetic, one
rounding when stored, non-finite values stored as zero; state_dict / load_state_dict; no autograd graph."""

from __future__ import annotations

import pytest
import torch

from echo_ds import algorithm as A
from echo_ds.compensator import Compensator, kStateDtype, store_state
from echo_ds.config import DirectionConfig, EchoConfig
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
    comp = make(slow_decay=0.7, fast_decay=0.3)
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
    comp2 = make(slow_decay=0.7, fast_decay=0.3)
    comp2.correction((4096,), "cpu")
    comp2.m1.copy_(m1.to(kStateDtype)), comp2.m2.copy_(m2.to(kStateDtype))
    expected = store_state(comp2.m1.float() * comp2.slow_decay + u * comp2.one_minus_slow)
    comp2.update(u)
    assert torch.equal(comp2.m1.view(torch.int16), expected.view(torch.int16))


def test_correction_reads_the_state_exactly():
    comp = make(gain=0.8, blend=0.3)
    comp.correction((256,), "cpu")
    comp.m1.copy_(torch.linspace(-1, 1, 256).to(kStateDtype))
    comp.m2.copy_(torch.linspace(2, -2, 256).to(kStateDtype))
    c = comp.correction((256,), "cpu")
    assert c.dtype == torch.float32
    expected = (comp.m1.float() * comp.blend + comp.m2.float() * comp.one_minus_blend) * comp.gain
    assert torch.equal(c, expected)


@pytest.mark.parametrize("residual", ["local", "output"])
def test_a_non_finite_call_poisons_only_itself(residual):
    cfg = EchoConfig(group_size=128, forward={"residual": residual})  # the slices below are groups of 128
    op = CompensatedAllReduce(4, cfg)
    gen = torch.Generator().manual_seed(1)
    op(torch.randn(4, 4096, generator=gen))
    bad = torch.randn(4, 4096, generator=gen)
    bad[2, 300] = float("nan")
    bad[1, 1000] = float("inf")
    y = op(bad)
    assert torch.isnan(y[256:384]).all() and torch.isnan(y[896:1024]).all()
    assert torch.isfinite(op.compensator.m1.float()).all() and torch.isfinite(op.compensator.m2.float()).all()
    # Where a residual was non-finite the state restarted from zero; elsewhere it kept its estimate.
    assert (op.compensator.m1.float() == 0).any() and (op.compensator.m1.float() != 0).any()
    clean = torch.randn(4, 4096, generator=gen)
    y = op(clean)
    assert torch.isfinite(y).all()
    assert (y - clean.sum(0)).abs().max() < 0.5 * clean.sum(0).abs().max()


def test_state_memory_is_two_bytes_per_element_per_average():
    op = CompensatedAllReduce(2, EchoConfig())
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
        assert not op.compensator.m1.requires_grad and op.compensator.m1.grad_fn is None
        assert not op.compensator.m2.requires_grad and op.compensator.m2.grad_fn is None


def test_state_dict_is_a_copy_and_round_trips():
    op = CompensatedAllReduce(2, EchoConfig())
    op(torch.randn(2, 1000))
    comp = op.compensator
    sd = comp.state_dict()
    assert sd["m1"].data_ptr() != comp.m1.data_ptr() and torch.equal(sd["m1"], comp.m1)
    before = comp.m1.clone()
    sd["m1"].fill_(7)
    assert torch.equal(comp.m1, before), "state_dict must not hand out the live tensors"
    other = make()
    other.load_state_dict(comp.state_dict())
    assert torch.equal(other.m1, comp.m1) and torch.equal(other.m2, comp.m2) and other.num_calls == comp.num_calls
    src = comp.state_dict()
    other.load_state_dict(src)
    src["m2"].fill_(3)
    assert torch.equal(other.m2, comp.m2), "load_state_dict must copy in"
    empty = make()
    empty.load_state_dict(make().state_dict())  # a fresh state (None, None, 0) round-trips too
    assert empty.m1 is None and empty.num_calls == 0


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
    op = CompensatedAllReduce(2, EchoConfig())
    op(torch.randn(2, 1000))
    sd = op.compensator.state_dict()
    change(sd)
    with pytest.raises(ValueError, match=match):
        make().load_state_dict(sd)


def test_update_without_a_matching_state_raises():
    comp = make()
    with pytest.raises(RuntimeError, match="without a matching correction"):
        comp.update(torch.zeros(128))
    comp.correction((256,), "cpu")
    with pytest.raises(RuntimeError, match="residual of shape \\(128,\\)"):
        comp.update(torch.zeros(128))
