"""The one-launch call of a group: its plans and its launches (the call half of the p2p transport).

EchoBuffer (echo_ds.p2p.buffer) owns the group's resources: the handshake, the transport's memory and IPC
mappings, close(). Once they exist it builds a :class:`OneLaunch` over them, which holds echo_ds.ops'
``P2PRuntime`` (the C++ owner of the workspace pointers, peer tables, epochs and error record) and the plans
of the calls made so far; EchoBuffer routes each call (the reference path, the one-launch call or the staged
pipeline) and handles what the runtime hands back (a failed wait, range events, a missing state).

A call crosses into C++ once: ``OneLaunch.plan`` builds a call's plan in the runtime the first time (layout,
chunks, slot tables, flags, Hadamard table, coefficients and descriptor, checked once) and ``OneLaunch.call``
launches by it with the tensors of this call, or returns None without launching where Python must act first.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from echo_ds import algorithm as A
from echo_ds.ops.kernels import kernel_state, raw_stream
from echo_ds.p2p import layout as L
from echo_ds.p2p import protocol as proto
from echo_ds.quant import QuantSpec


def state_dtype(compensator) -> str:
    """The compensator's stored state format ("bf16" without a compensator)."""
    return "bf16" if compensator is None else getattr(compensator, "state_dtype", "bf16")


def call_descriptor(x: torch.Tensor, spec: QuantSpec, compensator, pow2, site, direction) -> int:
    """The 32-bit descriptor of an Echo call (echo_ds.p2p.protocol.call_descriptor): the one-launch call's
    flags and the staged calls' gate carry it."""
    return proto.call_descriptor(
        numel=x.numel(), dtype=str(x.dtype).replace("torch.", ""), bits=spec.bits, group_size=spec.group_size,
        quantizer=spec.quantizer, rotation=spec.rotation, pow2=pow2,
        residual="none" if compensator is None else compensator.residual, site=site, direction=direction,
        state_dtype=state_dtype(compensator))


class OneLaunchPlan(NamedTuple):
    """index: of the runtime's plan (P2PRuntime.plan); bits: for the range events' warning; state_shape: of the
    compensator's state; state_names: the compensator's tensors in the kernels' (m1, m2, exponent) places."""

    index: int
    bits: int
    state_shape: tuple
    state_names: tuple


kMaxPlans = 4096  # plans kept before the cache starts again (a plan is a few hundred bytes in C++)


class OneLaunch:
    """The one-launch call over a group's transport (built by EchoBuffer once its handshake succeeded).

    ext: echo_ds.ops; transport: the group's CudaTransport (peer pointers, error record, control block);
    capacity: the workspace (echo_ds.p2p.layout.Capacity); max_blocks: each launch's grid cap;
    one_shot_max_bytes: the largest 16-bit message run one-shot (0: none).
    """

    def __init__(self, ext, transport, rank: int, world_size: int, capacity: L.Capacity, max_blocks: int,
                 device: torch.device, one_shot_max_bytes: int):
        t, P = transport, world_size
        self.world_size = world_size
        self.device = device
        self.capacity = capacity
        self.one_shot_max_bytes = one_shot_max_bytes
        self.runtime = ext.P2PRuntime(
            rank, P, [t.peer_ptr[j]["codes"] for j in range(P)], [t.peer_ptr[j]["params"] for j in range(P)],
            [t.peer_ptr[j]["signals"] + L.kFusedFlagsOffset for j in range(P)], capacity.code_bytes // 2,
            capacity.param_bytes // 2, t.error_dev_ptr, t.error_host_ptr, t.timeout_ns, max_blocks,
            t.control_ptr + t.layout["control.poisoned"], device.index,
            [t.peer_ptr[j]["codes"] + capacity.code_bytes for j in range(P)] if capacity.shot_bytes else [],
            capacity.shot_sender_bytes)
        self.plans = {}  # a call's key (EchoBuffer.all_reduce) -> OneLaunchPlan
        self._gate_x = torch.zeros(1, dtype=torch.float32, device=device)
        self._gate_y = torch.empty_like(self._gate_x)

    @property
    def max_blocks(self) -> int:
        return self.runtime.max_blocks

    def plan(self, x: torch.Tensor, spec: QuantSpec, compensator, pow2, site, direction) -> OneLaunchPlan:
        """The plan for calls like this one, built once in the runtime (only calls the policy accepted and the
        kernel supports get here: echo_ds.ops.kernels.unsupported_reason is None). The caller caches it by a
        key that holds everything the plan fixed (the compensator's coefficients included:
        Compensator.kernel_key), through ``remember``."""
        from echo_ds.ops import kernels as K

        signs, norm = K._hadamard_args(spec)
        residual = "none" if compensator is None else compensator.residual
        descriptor = call_descriptor(x, spec, compensator, pow2, site, direction)
        layout = A.Layout(x.numel(), self.world_size, spec.group_size)
        state_shape = (self.world_size, layout.groups_per_segment, spec.group_size)
        x = x.contiguous()
        one_shot = (x.element_size() == 2 and x.numel() <= self.capacity.shot_numel
                    and x.numel() * 2 <= self.one_shot_max_bytes)
        if compensator is None:
            index = self.runtime.plan(x, None, None, None, [], 0, A.pow2_code(pow2), spec.group_size, spec.bits,
                                      K.QUANTIZER_CODES[spec.quantizer], signs, norm, descriptor, one_shot)
            return OneLaunchPlan(index, spec.bits, state_shape, (None, None, None))
        c = compensator
        c._ensure(state_shape, self.device)
        state = kernel_state(c)
        index = self.runtime.plan(x, state["m1"], state["m2"], state["exponent"], list(c.kernel_key[3:]),
                                  proto.DESCRIPTOR_RESIDUALS.index(residual), A.pow2_code(pow2), spec.group_size,
                                  spec.bits, K.QUANTIZER_CODES[spec.quantizer], signs, norm, descriptor, one_shot)
        return OneLaunchPlan(index, spec.bits, state_shape, K.kernel_state_names(c.state_dtype))

    def remember(self, key, plan: OneLaunchPlan) -> None:
        if len(self.plans) >= kMaxPlans:
            self.clear()
        self.plans[key] = plan

    def clear(self) -> None:
        """Forget every plan (here and in the runtime)."""
        self.plans.clear()
        self.runtime.clear_plans()

    def call(self, x: torch.Tensor, plan: OneLaunchPlan, c) -> Optional[torch.Tensor]:
        """One launch by ``plan`` on the current stream, with the compensator's state in the kernels' (m1, m2,
        exponent) places: y, or None where the runtime launched nothing (a failed wait recorded, range events not
        folded yet, a state missing or not as planned: the caller attends to it and calls again)."""
        if c is None:
            return self.runtime.call(plan.index, x)
        m1, m2, exponent = plan.state_names
        held = getattr(c, m1)
        if held is None or held.shape != plan.state_shape:
            # a state of another call's length is not fed back: allocated again, as Compensator does (the
            # runtime checks only that the arrays cover the call; their device too)
            c._ensure(plan.state_shape, self.device)
            held = getattr(c, m1)
        return self.runtime.call_compensated(plan.index, x, held, m2 and getattr(c, m2),
                                             exponent and getattr(c, exponent))

    def plain(self, x: torch.Tensor, y: torch.Tensor, descriptor: int) -> None:
        """The unquantized call of the same family: y = the sum of x over the group (one launch)."""
        self.runtime.plain_all_reduce(x, y, descriptor, raw_stream(self.device))

    def gate(self, descriptor: int) -> None:
        """A plain launch on one element whose flags carry ``descriptor``: the staged calls' gate
        (EchoBuffer._gate_staged)."""
        self.plain(self._gate_x, self._gate_y, descriptor)

    def set_range_seen(self, clipped: int, underflow: int) -> None:
        self.runtime.set_range_seen(clipped, underflow)

    def close(self) -> None:
        """Free the runtime's control block (no call may be in flight)."""
        self.plans.clear()
        self.runtime.close()
