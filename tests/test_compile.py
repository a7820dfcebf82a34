"""``torch.compile(fullgraph=True)`` through Echo's custom ops, on 2 gloo ranks (one spawn, many checks).

``echo_all_reduce`` goes through ``torch.ops.echo_ds.all_reduce`` (``all_reduce_compensated`` with a
compensator) and the DeepSpeed mode's all-reduces through ``torch.ops.echo_ds.site_all_reduce``
(echo_ds.collective, echo_ds.deepspeed.mappings). Compiled with ``fullgraph=True`` (a graph break
raises), each must return the eager result bit for bit, leave the compensator in the eager state, count
every call, and route to a backend registered for the group. Each rank returns plain numbers and flags;
the tests assert on them.
"""

from __future__ import annotations

import pytest

from utils import free_port, run_distributed

kNumel = 4096


class _Recorder:
    """A backend (EchoBuffer's all_reduce signature) that counts its calls and declines them all: it falls
    back to echo_all_reduce, as EchoBuffer does, which must then run the reference (not this again)."""

    def __init__(self):
        self.num_calls = 0

    def all_reduce(self, x, spec, compensator=None, pow2_rescale="auto", *, site=None, direction=None):
        from echo_ds.reference import echo_all_reduce

        self.num_calls += 1
        return echo_all_reduce(x, spec, compensator=compensator, pow2_rescale=pow2_rescale, site=site,
                               direction=direction)


def _equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def _int4_through_the_op(xs, spec):
    """torch.ops.echo_ds.all_reduce_compensated called with an "int4" compensator's own tensors (q,
    exponent) against the reference called directly (reference._echo_all_reduce, no op): the same output
    bits and the same state, updated in place in the tensors the op was given."""
    import torch
    import torch.distributed as dist

    from echo_ds import algorithm as A
    from echo_ds import collective, reference
    from echo_ds.compensator import Compensator
    from echo_ds.config import DirectionConfig

    plain, viaop = Compensator(DirectionConfig(state_dtype="int4")), Compensator(DirectionConfig(state_dtype="int4"))
    equal, state_equal, in_place = [], [], []
    for x in xs:
        want = reference._echo_all_reduce(x, spec, None, plain, "auto", direction=None, site=None, timeout_s=None)
        viaop._ensure(collective.state_shape(x.numel(), dist.get_world_size(), spec.group_size), x.device)
        state = [viaop.q, viaop.exponent]
        got = torch.ops.echo_ds.all_reduce_compensated(x, state, collective.group_name(None), spec.bits,
                                                       spec.group_size, spec.quantizer, spec.rotation,
                                                       A.pow2_code("auto"), None, None, None,
                                                       collective.handle(viaop))
        equal.append(_equal(want, got))
        state_equal.append(all(_equal(getattr(plain, a), getattr(viaop, a)) for a in ("q", "exponent"))
                           and plain.num_calls == viaop.num_calls)
        in_place.append(viaop.q is state[0] and viaop.exponent is state[1])
    try:  # a state list that is not the tensors of state_names: refused, not mixed up
        torch.ops.echo_ds.all_reduce_compensated(xs[0], [viaop.q], collective.group_name(None), spec.bits,
                                                 spec.group_size, spec.quantizer, spec.rotation, A.pow2_code("auto"),
                                                 None, None, None, collective.handle(viaop))
        refused = ""
    except ValueError as e:
        refused = str(e)
    return dict(op_int4_equal=equal, op_int4_state_equal=state_equal, op_int4_in_place=in_place,
                op_int4_moved=bool(plain.q.any()), op_int4_refused=refused)


def _cases(rank, world_size, shm_port):
    import torch

    from echo_ds import collective
    from echo_ds.compensator import Compensator
    from echo_ds.config import DirectionConfig
    from echo_ds.quant import QuantSpec
    from echo_ds.reference import call_count, echo_all_reduce

    res = {}
    gen = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(kNumel, generator=gen) * (i + 1) for i in range(3)]

    # --- without a compensator: fp32, then a non-contiguous bf16 message of an odd size ---------------
    spec = QuantSpec()
    compiled = torch.compile(lambda t: echo_all_reduce(t, spec), fullgraph=True)
    eager = [echo_all_reduce(x, spec) for x in xs]
    before = call_count()
    got = [compiled(x) for x in xs]
    res["plain_calls"] = call_count() - before
    res["plain_equal"] = [_equal(e, g) for e, g in zip(eager, got)]
    odd = torch.randn(37, 5, generator=gen).to(torch.bfloat16).t()  # [5, 37], strides (1, 5)
    e, g = echo_all_reduce(odd, spec), compiled(odd)
    res["odd_equal"] = _equal(e, g)
    res["odd_meta"] = (tuple(g.shape), str(g.dtype), g.stride(), g.is_contiguous())

    # The fake implementation gives what the op returns: x's shape and dtype, contiguous.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.ops.echo_ds.all_reduce(mode.from_tensor(odd), collective.group_name(None), 4, 128,
                                            "zero_aware", False, 2, None, None, None)
    res["fake_meta"] = (tuple(fake.shape), str(fake.dtype), fake.stride(), fake.is_contiguous())

    # --- with a compensator (state updated in place), rotation, pow2 rescaling, a reset -----------------
    # The default state format, every tensor by name (Compensator.state_names).
    rot = QuantSpec(rotation=True)
    cfg = DirectionConfig()
    ce, cc = Compensator(cfg), Compensator(cfg)
    tensors = (lambda c: [getattr(c, name) for name in c.state_names])
    fc = torch.compile(lambda t: echo_all_reduce(t, rot, compensator=cc, pow2_rescale=True, direction="backward",
                                                 site=3), fullgraph=True)
    comp_equal, state_equal, in_place = [], [], []
    for i, x in enumerate(xs):
        if i == 2:  # a new pass: the state restarts from None, as after the first call's trace
            ce.reset()
            cc.reset()
        e = echo_all_reduce(x, rot, compensator=ce, pow2_rescale=True, direction="backward", site=3)
        held = tensors(cc)
        g = fc(x)
        comp_equal.append(_equal(e, g))
        state_equal.append(all(map(_equal, tensors(ce), tensors(cc))) and ce.num_calls == cc.num_calls)
        in_place.append(all(h is None or t is h for h, t in zip(held, tensors(cc))))
    res.update(comp_equal=comp_equal, state_equal=state_equal, in_place=in_place, num_calls=cc.num_calls,
               state_moved=any(bool(v.abs().sum() > 0) for v in cc.values()))

    # The "bf16" state (selectable): m1 and m2 as bfloat16, two tensors updated in place.
    ce, cc = Compensator(DirectionConfig(state_dtype="bf16")), Compensator(DirectionConfig(state_dtype="bf16"))
    fc = torch.compile(lambda t: echo_all_reduce(t, spec, compensator=cc), fullgraph=True)
    bf16 = []
    for x in xs[:2]:
        e, g = echo_all_reduce(x, spec, compensator=ce), fc(x)
        bf16.append(_equal(e, g) and all(map(_equal, tensors(ce), tensors(cc))))
    res["bf16_equal"] = bf16
    res["bf16_state"] = {a: str(getattr(cc, a).dtype) for a in cc.state_names}
    res.update(_int4_through_the_op(xs, spec))

    # --- a backend registered for the group: eager calls and the graph compiled above take it, except
    # inside reference_only() --------------------------------------------------------------------------
    recorder = _Recorder()
    collective.register_backend(None, recorder)
    try:
        routed = [echo_all_reduce(xs[0], spec), compiled(xs[0])]
        with collective.reference_only():  # the specification, whatever is registered
            routed.append(compiled(xs[0]))
    finally:
        collective.unregister_backend(None)
    res["backend_calls"] = recorder.num_calls
    res["backend_equal"] = [_equal(eager[0], y) for y in routed]
    compiled(xs[0])
    res["backend_calls_after"] = recorder.num_calls

    # --- the DeepSpeed mode's row-parallel layer: forward compiled, backward as eager --------------------
    from test_deepspeed_layers import _build, _cfg, _inputs
    from utils import deepspeed_env

    import echo_ds.deepspeed as echo

    deepspeed_env(rank, world_size, shm_port)
    net = _build()
    rt = echo.enable(net, _cfg())
    row = net.blocks[0].o
    x, grad = _inputs(7 + rank)
    x = x[..., :row.weight.shape[1]].detach()

    def step(layer):
        rt.begin_forward_pass(True)
        xx = x.clone().requires_grad_()
        row.weight.grad = None
        y1 = layer(xx)
        y2 = layer(xx * 0.5)  # the forward state carries over from the first call
        ((y1 + 2 * y2) * grad).sum().backward()
        return [y1.detach(), y2.detach(), xx.grad, row.weight.grad]

    calls = rt.stats.forward_calls
    want = step(row)
    got = step(torch.compile(row, fullgraph=True))
    res["row_equal"] = [_equal(a, b) for a, b in zip(want, got)]
    res["row_calls"] = rt.stats.forward_calls - calls
    res["row_state"] = rt.forward_state is not None and rt.forward_state.num_calls
    echo.disable(net)
    return res


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("deepspeed")
    return run_distributed(_cases, 2, free_port(), timeout=300)


def test_uncompensated_compiles_and_matches_eager_bit_for_bit(results):
    for r in results:
        assert r["plain_equal"] == [True] * 3
        assert r["plain_calls"] == 3  # every compiled call is an Echo call (counted on the group)
        assert r["odd_equal"]
        assert r["odd_meta"] == ((5, 37), "torch.bfloat16", (37, 1), True)
    assert results[0]["plain_equal"] == results[1]["plain_equal"]


def test_fake_implementation_matches_the_op(results):
    for r in results:
        assert r["fake_meta"] == r["odd_meta"]


def test_compensated_compiles_matches_eager_and_updates_the_state_in_place(results):
    # the default state (with rotation, pow2 rescaling and a reset), then the "bf16" state by name
    for r in results:
        assert r["comp_equal"] == [True] * 3
        assert r["state_equal"] == [True] * 3
        assert r["in_place"] == [True] * 3
        assert r["num_calls"] == 1 and r["state_moved"]  # one call since the reset, and it fed back
        assert r["bf16_equal"] == [True, True]
        assert r["bf16_state"] == {"m1": "torch.bfloat16", "m2": "torch.bfloat16"}


def test_int4_state_through_the_custom_op_is_the_reference_bit_for_bit(results):
    # The op receives the compensator's own packed tensors (q, exponent) and updates them in place.
    for r in results:
        assert r["op_int4_equal"] == [True] * 3
        assert r["op_int4_state_equal"] == [True] * 3
        assert r["op_int4_in_place"] == [True] * 3
        assert r["op_int4_moved"]  # the state fed back: the comparison is not of zeros
        assert "1 state tensors for a compensator that holds 2 (q, exponent)" in r["op_int4_refused"]


def test_registered_backend_serves_eager_and_compiled_calls(results):
    for r in results:
        assert r["backend_calls"] == 2 and r["backend_calls_after"] == 2
        assert r["backend_equal"] == [True, True, True]


def test_deepspeed_row_parallel_forward_compiles_and_backward_matches(results):
    for r in results:
        assert r["row_equal"] == [True] * 4  # both outputs, the input gradient, the weight gradient
        assert r["row_calls"] == 4  # two calls per step, eager and compiled: counted at run time
        assert r["row_state"] == 2  # the forward state fed back once per call of the compiled pass


def test_drop_backend_removes_only_the_backend_registered_under_the_name():
    """EchoBuffer.close() unregisters by the name it kept (no process group needed at interpreter exit),
    and only itself: a later backend of the same group stays."""
    from echo_ds import collective

    class Backend:
        active, closed = True, False

    first, second = Backend(), Backend()
    name = "test-group-name"
    collective._backends[name] = second
    collective.drop_backend(name, first)  # not the registered one: nothing changes
    assert collective.backend_for(name) is second
    collective.drop_backend(name, second)
    assert collective.backend_for(name) is None
    collective.drop_backend(name, second)  # already gone: a no-op
