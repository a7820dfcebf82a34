"""echo_ds.p2p.call.OneLaunch, the one-launch call's Python half, against a recording stand-in for the extension's
P2PRuntime (CPU; the real runtime runs in tests/test_p2p_gpu.py's suites): what reaches the binding's plan and call
(the descriptor, the one-shot choice, the compensator's state tensors and coefficients in the kernels' places),
a state of another length allocated again rather than fed back, and the plan cache's bound."""

from __future__ import annotations

import torch

from echo_ds.compensator import make_compensator
from echo_ds.config import DirectionConfig
from echo_ds.ops import kernels as K
from echo_ds.p2p import call as C
from echo_ds.p2p import layout as L
from echo_ds.quant import QuantSpec
from host_transport import HostTransport
from utils import run_distributed

kSpec = QuantSpec(4, 64, "zero_aware_int", rotation=True)


class _Runtime:
    """Records the binding calls; plan returns consecutive indices, call returns a tensor like x."""

    def __init__(self, *args):
        self.ctor, self.plans, self.calls, self.cleared, self.closed = args, [], [], 0, False
        self.plain_calls, self.refuse = [], 0  # refuse: how many of the next calls return None

    def plan(self, *args):
        self.plans.append(args)
        return len(self.plans) - 1

    def call(self, index, x):  # P2PRuntime.call: a call without state
        return self._record(index, x, ())

    def call_compensated(self, index, x, m1, m2, exponent):
        return self._record(index, x, (m1, m2, exponent))

    def _record(self, index, x, state):
        self.calls.append((index, state))
        if self.refuse:
            self.refuse -= 1
            return None
        return torch.empty_like(x)

    def plain_all_reduce(self, x, y, descriptor, stream):
        self.plain_calls.append((x.numel(), descriptor))

    def clear_plans(self):
        self.cleared += 1

    def close(self):
        self.closed = True


class _Ext:
    P2PRuntime = _Runtime


class _Transport:
    def __init__(self, P):
        self.peer_ptr = [{"codes": 1 << 20 * (j + 1), "params": 2 << 20 * (j + 1), "signals": 3 << 20 * (j + 1)}
                         for j in range(P)]
        self.error_dev_ptr, self.error_host_ptr, self.timeout_ns, self.control_ptr = 11, 12, 13, 14
        self.layout = {"control.poisoned": 8}


def _one_launch(P=2, one_shot=256 << 10):
    cap = L.Capacity(P, 1 << 16, 16, shot_numel=one_shot // 2)
    return C.OneLaunch(_Ext, _Transport(P), 1, P, cap, 66, torch.device("cpu"), one_shot)


def test_the_runtime_gets_the_transport_tables_and_the_grid_cap():
    one = _one_launch(P=4)
    rank, P, codes, params, flags = one.runtime.ctor[:5]
    assert (rank, P) == (1, 4) and codes == [1 << 20 * (j + 1) for j in range(4)]
    assert flags == [(3 << 20 * (j + 1)) + L.kFusedFlagsOffset for j in range(4)]
    assert one.runtime.ctor[10] == 66 and one.runtime.ctor[11] == 14 + 8  # grid cap; the poison word
    assert one.runtime.ctor[13] == [c + one.capacity.code_bytes for c in codes]  # the one-shot regions


def test_plan_passes_the_descriptor_the_one_shot_choice_and_the_state():
    one = _one_launch()
    small = torch.zeros(1000, dtype=torch.bfloat16)
    plan = one.plan(small, kSpec, None, "auto", 3, "forward")
    args = one.runtime.plans[0]
    assert args[1:4] == (None, None, None) and args[-1] is True  # no state; 2000 bytes: one-shot
    assert args[-2] == C.call_descriptor(small, kSpec, None, "auto", 3, "forward")
    assert plan.state_names == (None, None, None) and plan.bits == 4
    large = torch.zeros(200_000, dtype=torch.bfloat16)
    one.plan(large, kSpec, None, "auto", 3, "forward")
    assert one.runtime.plans[1][-1] is False  # above one_shot_max_bytes: two-shot
    assert one.plan(small.float(), kSpec, None, "auto", 3, "forward") and one.runtime.plans[2][-1] is False  # fp32

    for state_dtype in ("bf16", "int8", "int4"):
        comp = make_compensator(DirectionConfig(state_dtype=state_dtype))
        plan = one.plan(small, kSpec, comp, False, 3, "forward")
        args = one.runtime.plans[-1]
        names = K.kernel_state_names(state_dtype)
        assert plan.state_names == names and plan.state_shape == (2, 8, 64)  # 1000 elements, P = 2, g = 64
        for got, name in zip(args[1:4], names):
            assert (got is None) if name is None else (got is getattr(comp, name))
        assert args[4] == list(comp.kernel_key[3:])  # the seven coefficients


def test_call_feeds_the_planned_state_and_reallocates_one_of_another_length():
    one = _one_launch()
    comp = make_compensator(DirectionConfig(state_dtype="bf16"))
    x = torch.zeros(1000, dtype=torch.bfloat16)
    plan = one.plan(x, kSpec, comp, False, None, None)
    one.call(x, plan, comp)
    assert one.runtime.calls[-1][1] == (comp.m1, comp.m2, None)
    comp._ensure((2, 80, 64), torch.device("cpu"))  # a longer call's state since
    assert comp.m1.shape == (2, 80, 64)
    one.call(x, plan, comp)
    assert comp.m1.shape == plan.state_shape and one.runtime.calls[-1][1][0] is comp.m1
    assert one.call(x, one.plan(x, kSpec, None, False, None, None), None) is not None
    assert one.runtime.calls[-1][1] == ()


def test_the_plan_cache_starts_again_at_its_bound():
    one = _one_launch()
    for i in range(C.kMaxPlans):
        one.remember(i, i)
    assert len(one.plans) == C.kMaxPlans and one.runtime.cleared == 0
    one.remember("next", 0)
    assert list(one.plans) == ["next"] and one.runtime.cleared == 1
    one.close()
    assert one.runtime.closed and not one.plans


def _routes_body(rank, world_size):
    """EchoBuffer on the host transport with the stand-in as its one-launch call: which calls reach it."""
    from echo_ds.p2p import EchoBuffer

    C.raw_stream = lambda device: 0  # no CUDA stream on the CPU
    buf = EchoBuffer(transport=HostTransport, max_numel=1 << 14, timeout_s=30.0)
    assert buf.active, buf.reason
    one = C.OneLaunch(_Ext, _Transport(world_size), rank, world_size, buf.capacity, 66, buf.device, 0)
    buf._owned = buf.one_launch = one
    rt = one.runtime
    comp = make_compensator(DirectionConfig(state_dtype="bf16"))
    x = torch.randn(3000, generator=torch.Generator().manual_seed(rank)).bfloat16()
    out = {}
    for _ in range(2):  # the plan once, then the fast path
        y = buf.all_reduce(x, kSpec, compensator=comp, pow2_rescale=False, site=1, direction="forward")
    out["twice"] = (len(rt.plans), len(rt.calls), buf.num_calls, comp.num_calls, tuple(y.shape))
    rt.refuse = 2  # the runtime launches nothing twice: EchoBuffer attends (folds, checks) and calls again
    buf.all_reduce(x, kSpec, compensator=comp, pow2_rescale=False, site=1, direction="forward")
    out["refused"] = (len(rt.calls), buf.num_calls, comp.num_calls)
    buf.plain_all_reduce(x, site=2, direction="backward")
    out["plain"] = rt.plain_calls[-1][0]
    # g = 16: not the kernels' group size: the staged pipeline with the host transport's own (torch) stages, behind
    # the gate's plain launch
    spec16 = QuantSpec(4, 16, "zero_aware_int", rotation=True)
    y16 = buf.all_reduce(x, spec16, pow2_rescale=True, site=3, direction="forward")
    out["gate"] = (rt.plain_calls[-1][0], len(rt.plain_calls), len(rt.calls))
    parts = [torch.randn(3000, generator=torch.Generator().manual_seed(r)).bfloat16() for r in range(world_size)]
    from echo_ds.emulate import emulated_echo_all_reduce

    out["staged_exact"] = torch.equal(y16, emulated_echo_all_reduce(torch.stack(parts), spec16, pow2_rescale=True))
    buf.close()
    out["closed"] = rt.closed and buf.one_launch is None
    return out


def test_echo_buffer_routes_calls_through_its_one_launch_call():
    for r in run_distributed(_routes_body, 2, timeout=120):
        assert r["twice"] == (1, 2, 2, 2, (3000,)), r  # one plan, two launches
        assert r["refused"] == (5, 3, 3), r  # two refusals and the launch: one call, counted once
        assert r["plain"] == 3000, r
        assert r["gate"] == (1, 2, 5), r  # a one-element gate, no one-launch call
        assert r["staged_exact"] and r["closed"], r
