"""The staged pipeline of a p2p call: its executor, its stages, and the schedule that prepares them once per shape.

``StagedPipeline`` runs the calls EchoBuffer (which owns the transport and routes the calls) sends to the
staged pipeline. It holds the schedule cache and the stage streams and events, and issues one call: the
caller's stream raises the device-resident flag base and records a start event; the push stream forms x'
(compensation, rotation, the pow2 max exchange) and puts the codes of each tile into its owner's buffer,
publishing a flag per tile; the reduce stream waits for a tile's flags, reduces and requantizes it into
every peer's buffer (the torch stages leave that put to the gather stream); the gather stream decodes this
rank's own segment; the tail stream waits for the owners' tiles and decodes them; the caller's stream waits
for the ends. The compensator's state is updated inside those stages (echo_ds.ops: by the entry and the
owner reduce for residual "local", by the dequantize for "output"; the torch stages: after the exit, on the
tail stream), so a call leaves no work behind it. The host never synchronises while tiles are in flight.

A schedule holds, for one key (dtype, bits, quantizer, group size, rotation, segment size: appendix
C's schedule cache), the tiling, the static workspace (so that a CUDA graph captured over a call keeps
valid addresses, and no tensor crosses streams through the caching allocator), the views of this
rank's and its peers' slots, and the prepared flag waits and puts of every tile.

Two implementations of the stages behind the same methods (entry, push, reduce, gather, tail, exit,
update; StagedPipeline runs them on the push, reduce, gather and tail streams, exit and update on the tail
stream):

``KernelSchedule``
    The fused kernels of echo_ds.ops (issue 4). push_quantize writes the codes of a tile straight into
    its owners' push slots, owner_reduce writes the reduced tile straight into every peer's gather
    slot; the transport only adds the flags (echo_p2p_signal_kernel) and the waits.
``TorchSchedule``
    The very functions of echo_ds.algorithm, per tile, in the order of echo_ds.reference; the codes are
    staged locally and moved by echo_p2p_put_kernel, which publishes the flag after the data. The
    fallback where the kernels are not built or do not support a configuration (group sizes outside
    64..256), and the CPU tests' stages.

Every step of either is per group or per element, so a tile's bits are the whole tensor's, and both
reproduce the reference bit for bit.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Tuple

import torch

from echo_ds import algorithm as A
from echo_ds import quant as Q
from echo_ds.p2p import layout as L
from echo_ds.p2p import protocol as proto
from echo_ds.quant import QuantSpec


@dataclass(frozen=True)
class ScheduleKey:
    dtype: torch.dtype
    bits: int
    quantizer: str
    group_size: int
    rotation: bool
    segment_numel: int


def schedule_key(dtype: torch.dtype, spec: QuantSpec, layout: A.Layout) -> ScheduleKey:
    return ScheduleKey(dtype, spec.bits, spec.quantizer, spec.group_size, spec.rotation, layout.segment_numel)


class Rotation:
    """echo_ds.quant's rotate / unrotate with the sign vector kept on the device.

    quant.hadamard_signs copies its CPU tensor to the device at every call, a host-to-device copy that
    a CUDA graph capture refuses; this holds one copy per schedule and runs the same operations in the
    same order (the same bits).
    """

    def __init__(self, spec: QuantSpec, device):
        self.on = spec.rotation
        if self.on:
            self.signs = Q.hadamard_signs(spec.group_size, device)
            self.norm = Q.hadamard_norm(spec.group_size)

    def rotate(self, seg: torch.Tensor) -> torch.Tensor:
        if not self.on:
            return seg
        groups = seg.reshape(-1, seg.shape[-1])
        return (Q._fwht(groups * self.signs) * self.norm).view(seg.shape)

    def unrotate(self, seg: torch.Tensor) -> torch.Tensor:
        if not self.on:
            return seg
        groups = seg.reshape(-1, seg.shape[-1])
        return ((Q._fwht(groups) * self.norm) * self.signs).view(seg.shape)


def pow2_factors(amax: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(2^k, 2^-k) as fp32 [1] tensors on amax's device, k = echo_ds.algorithm.pow2_exponent(amax).

    The same k as the reference's host-side frexp, computed on the device so that the call needs no
    host synchronisation (and can be captured in a CUDA graph); built from the exponent bits, exact.
    """
    a = amax.reshape(1).float()
    _, e = torch.frexp(a)
    k = torch.clamp(A.kPow2Target - e, -126, 126)
    k = torch.where(torch.isfinite(a) & (a != 0), k, torch.zeros_like(k))
    up = ((k + 127) << 23).view(torch.float32)
    down = ((127 - k) << 23).view(torch.float32)
    return up, down


class Schedule:
    """What both stage implementations share: tiling, flags, the pow2 max exchange, slot views."""

    def __init__(self, key: ScheduleKey, spec: QuantSpec, layout: A.Layout, rank: int, world_size: int,
                 transport, tile_bytes: int, capacity: L.Capacity, device):
        self.key = key
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.transport = transport
        self.device = device
        self.pinned = False  # captured in a CUDA graph: never evicted
        P, g = world_size, spec.group_size
        self.tiling = L.make_tiling(layout.numel, P, spec.bits, g, tile_bytes, capacity)
        assert self.tiling.groups_per_segment == layout.groups_per_segment and self.tiling.fits()
        self.G = self.tiling.groups_per_segment
        self.cb = self.tiling.code_bytes_per_group
        self.others = [j for j in range(P) if j != rank]
        f32 = dict(dtype=torch.float32, device=device)
        self.amax = torch.zeros((1,), **f32)  # this rank's max |x'|
        self.amax_all = torch.zeros((1,), **f32)  # the group's
        self._prepare_flags()
        self.stream = {}  # name -> torch stream (None on the host transport), set by StagedPipeline

    # -- slots ----------------------------------------------------------------------------------------

    def slot_views(self, owner_rank: int, slot: int):
        """(codes [G, cb] uint8, scales [G] fp16, zeros [G] fp16): slot ``slot`` in ``owner_rank``'s buffers."""
        t, views = self.tiling, self.transport.peer[owner_rank]
        codes = views["codes"][t.code_offset(slot):t.code_offset(slot) + self.G * self.cb].view(self.G, self.cb)
        scales = views["params"][t.scale_offset(slot):t.scale_offset(slot) + 2 * self.G].view(torch.float16)
        zeros = views["params"][t.zero_offset(slot):t.zero_offset(slot) + 2 * self.G].view(torch.float16)
        return codes, scales, zeros

    def _prepare_flags(self) -> None:
        t, tr, me = self.tiling, self.transport, self.rank
        self.push_flags = [[(j, L.signal_offset("push", me, tile)) for j in self.others] for tile in range(t.num_tiles)]
        self.gather_flags = [[(j, L.signal_offset("gather", me, tile)) for j in self.others]
                             for tile in range(t.num_tiles)]
        self.push_signals = [tr.prepare_signal(f, proto.kStagePush) for f in self.push_flags]
        self.gather_signals = [tr.prepare_signal(f, proto.kStageGather) for f in self.gather_flags]
        self.reduce_waits = [tr.prepare_wait([(s, L.signal_offset("push", s, tile)) for s in self.others],
                                             proto.kStagePush, proto.kWaitReduce, tile) for tile in range(t.num_tiles)]
        self.tail_waits = [tr.prepare_wait([(o, L.signal_offset("gather", o, tile)) for o in self.others],
                                           proto.kStageGather, proto.kWaitTail, tile) for tile in range(t.num_tiles)]
        self.amax_put = tr.prepare_put(
            [(self.amax, 0, 4, j, "signals", L.signal_offset("amax", me)) for j in self.others],
            [(j, L.signal_offset("amax_flag", me)) for j in self.others], proto.kStagePush, L.kLaneAmax)
        self.amax_wait = tr.prepare_wait([(s, L.signal_offset("amax_flag", s)) for s in self.others],
                                         proto.kStagePush, proto.kWaitAmax, 0)
        off = L.signal_offset("amax", 0)
        self.peer_amax = tr.signals[off:off + 4 * self.world_size].view(torch.float32)

    def exchange_amax(self) -> None:
        """self.amax_all = max over the group of every rank's self.amax (P - 1 puts, one wait)."""
        self.transport.put(self.amax_put, self.stream.get("push"))
        self.transport.wait(self.amax_wait, self.stream.get("push"))
        everyone = self.peer_amax.clone()
        everyone[self.rank] = self.amax[0]
        torch.amax(everyone, dim=0, keepdim=True, out=self.amax_all)
        if self.pow2 == "auto":  # inside the window: 0, whose exponent is k = 0 (algorithm.pow2_exponent)
            self.amax_all.masked_fill_((self.amax_all >= A.kAutoLow) & (self.amax_all < A.kAutoHigh), 0.0)

    def wait_push(self, tile: int) -> None:
        self.transport.wait(self.reduce_waits[tile], self.stream.get("reduce"))

    def wait_gather(self, tile: int) -> None:
        self.transport.wait(self.tail_waits[tile], self.stream.get("tail"))


# ----------------------------------------------------------------------------------------------------
# Stages through the fused kernels of echo_ds.ops
# ----------------------------------------------------------------------------------------------------

class KernelSchedule(Schedule):
    """Stages through echo_ds.ops: codes go straight into the peers' slots; flags follow."""

    kind = "kernels"

    def __init__(self, *args, ops, **kw):
        super().__init__(*args, **kw)
        self.ops = ops
        P, G, me = self.world_size, self.G, self.rank
        local = (torch.empty((G, self.cb), dtype=torch.uint8, device=self.device),
                 torch.empty((G,), dtype=torch.float16, device=self.device),
                 torch.empty((G,), dtype=torch.float16, device=self.device))
        t = self.tiling
        # Push: segment j goes to owner j's push slot for me. Reduce in: my push slot of each sender.
        # Reduce out: every peer's gather slot for me, and my own copy. Gathered: my gather slot of each
        # owner, and my own copy.
        self.push_out = ops.SegmentTable.of([None if j == me else self.slot_views(j, t.push_slot(me))
                                             for j in range(P)])
        self.reduce_in = ops.SegmentTable.of([None if r == me else self.slot_views(me, t.push_slot(r))
                                              for r in range(P)])
        self.reduce_out = ops.SegmentTable.of([local if d == me else self.slot_views(d, t.gather_slot(me))
                                               for d in range(P)])
        self.gathered = ops.SegmentTable.of([local if o == me else self.slot_views(me, t.gather_slot(o))
                                             for o in range(P)])
        self.tail_ranges = [(a, b - a) for a, b in ((0, me), (me + 1, P)) if b > a]

    def begin(self, x, y, compensator, pow2) -> None:
        self.x, self.y, self.comp, self.pow2 = x, y, compensator, pow2
        # Where the state is updated (echo_ds.ops): by the entry and the owner reduce from the rounding
        # error they hold (residual "local"), or by the dequantize from s_hat (residual "output").
        self.local_residual = compensator is not None and compensator.residual == "local"
        self.output_residual = compensator is not None and compensator.residual == "output"

    def _state(self):
        c = self.comp
        return dict(**self.ops.kernel_state(c), coeffs=c) if c is not None else {}

    def _output_update(self):
        """The dequantize's arguments for the update of residual "output" (none otherwise)."""
        return dict(x=self.x, **self._state()) if self.output_residual else {}

    def entry(self) -> None:
        if self.pow2:
            self.ops.pow2_amax(self.x, self.amax, world_size=self.world_size, spec=self.spec, **self._state())
            self.exchange_amax()

    def push(self, tile: int) -> None:
        g0, g1 = self.tiling.tile(tile)
        self.ops.push_quantize(self.x, rank=self.rank, world_size=self.world_size, spec=self.spec,
                               out=self.push_out, update_state=self.local_residual,
                               pow2_amax=self.amax_all if self.pow2 else None, group_begin=g0,
                               num_groups=g1 - g0, **self._state())
        self.transport.signal(self.push_signals[tile], self.stream.get("push"))

    def reduce(self, tile: int) -> None:
        g0, g1 = self.tiling.tile(tile)
        self.wait_push(tile)
        self.ops.owner_reduce(self.x, rank=self.rank, world_size=self.world_size, spec=self.spec,
                              copies=self.reduce_in, out=self.reduce_out, update_state=self.local_residual,
                              pow2_amax=self.amax_all if self.pow2 else None, group_begin=g0, num_groups=g1 - g0,
                              **self._state())
        self.transport.signal(self.gather_signals[tile], self.stream.get("reduce"))

    def gather(self, tile: int) -> None:
        g0, g1 = self.tiling.tile(tile)
        self.ops.dequantize(self.y, world_size=self.world_size, spec=self.spec, gathered=self.gathered,
                            pow2_amax=self.amax_all if self.pow2 else None, segment_begin=self.rank,
                            num_segments=1, group_begin=g0, num_groups=g1 - g0, **self._output_update())

    def tail(self, tile: int) -> None:
        g0, g1 = self.tiling.tile(tile)
        self.wait_gather(tile)
        for first, count in self.tail_ranges:
            self.ops.dequantize(self.y, world_size=self.world_size, spec=self.spec, gathered=self.gathered,
                                pow2_amax=self.amax_all if self.pow2 else None, segment_begin=first,
                                num_segments=count, group_begin=g0, num_groups=g1 - g0, **self._output_update())

    def exit(self) -> None:
        pass  # dequantize wrote y

    def update(self) -> None:
        self.comp.num_calls += 1  # as Compensator.update does; the stages updated the state


# ----------------------------------------------------------------------------------------------------
# Stages through torch (echo_ds.algorithm's functions, per tile)
# ----------------------------------------------------------------------------------------------------

class TorchSchedule(Schedule):
    """Stages through torch ops on the stage streams; codes staged locally and put by the transport."""

    kind = "torch"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        P, G, g, cb, dev = self.world_size, self.G, self.spec.group_size, self.cb, self.device
        self.rotation = Rotation(self.spec, dev)
        self.others_index = torch.tensor(self.others, device=dev, dtype=torch.long)
        f32 = dict(dtype=torch.float32, device=dev)
        self.r = torch.empty((P, G, g), **f32)  # x' = rotate(x) + c
        self.rs = torch.empty((P, G, g), **f32)  # x' * 2^k
        self.sent_codes = torch.empty((P - 1, G, cb), dtype=torch.uint8, device=dev)
        self.sent_scale = torch.empty((P - 1, G), dtype=torch.float16, device=dev)
        self.sent_zero = torch.empty((P - 1, G), dtype=torch.float16, device=dev)
        self.acc = torch.empty((G, g), **f32)
        self.red_codes = torch.empty((G, cb), dtype=torch.uint8, device=dev)
        self.red_scale = torch.empty((G,), dtype=torch.float16, device=dev)
        self.red_zero = torch.empty((G,), dtype=torch.float16, device=dev)
        self.s_hat_scaled = torch.empty((P, G, g), **f32)
        self.s_hat = torch.empty((P, G, g), **f32)
        self.up = torch.ones((1,), **f32)
        self.down = torch.ones((1,), **f32)
        self._prepare_puts()

    def _prepare_puts(self) -> None:
        t, me, cb, tr = self.tiling, self.rank, self.cb, self.transport
        self.push_puts, self.gather_puts, self.push_recv, self.gather_recv = [], [], [], []
        mine = {slot: self.slot_views(me, slot) for slot in range(2 * self.world_size)}
        for tile in range(t.num_tiles):
            g0, g1 = t.tile(tile)
            n = g1 - g0
            push, gather = [], []
            for i, j in enumerate(self.others):
                push += [(self.sent_codes[i], g0 * cb, n * cb, j, "codes", t.code_offset(t.push_slot(me), g0)),
                         (self.sent_scale[i], 2 * g0, 2 * n, j, "params", t.scale_offset(t.push_slot(me), g0)),
                         (self.sent_zero[i], 2 * g0, 2 * n, j, "params", t.zero_offset(t.push_slot(me), g0))]
                gather += [(self.red_codes, g0 * cb, n * cb, j, "codes", t.code_offset(t.gather_slot(me), g0)),
                           (self.red_scale, 2 * g0, 2 * n, j, "params", t.scale_offset(t.gather_slot(me), g0)),
                           (self.red_zero, 2 * g0, 2 * n, j, "params", t.zero_offset(t.gather_slot(me), g0))]
            self.push_puts.append(tr.prepare_put(push, self.push_flags[tile], proto.kStagePush, L.kLanePush))
            self.gather_puts.append(tr.prepare_put(gather, self.gather_flags[tile], proto.kStageGather,
                                                   L.kLaneGather))
            self.push_recv.append({s: tuple(v[g0:g1] for v in mine[t.push_slot(s)]) for s in self.others})
            self.gather_recv.append({o: tuple(v[g0:g1] for v in mine[t.gather_slot(o)]) for o in self.others})

    def begin(self, x, y, compensator, pow2) -> None:
        self.x, self.y, self.comp, self.pow2 = x, y, compensator, pow2
        self.layout = A.Layout(x.numel(), self.world_size, self.spec.group_size)

    def entry(self) -> None:
        """x' = rotate(x) + c, the pow2 max exchange and scaling, and the codes of the segments this rank
        sends (into its staging; the push puts move them)."""
        r = self.rotation.rotate(A.to_segments(self.x.reshape(1, -1), self.layout))[0]
        if self.comp is not None:
            r = r + self.comp.correction(r.shape, r.device)
        self.r.copy_(r)
        if self.pow2:
            torch.amax(self.r.abs().reshape(-1), dim=0, keepdim=True, out=self.amax)
            self.exchange_amax()
            up, down = pow2_factors(self.amax_all)
            self.up.copy_(up)
            self.down.copy_(down)
            torch.mul(self.r, self.up, out=self.rs)
        else:
            self.rs.copy_(self.r)
        codes, scale, zero = A.quantize_segments(self.rs[self.others_index], self.spec)
        self.sent_codes.copy_(codes)
        self.sent_scale.copy_(scale)
        self.sent_zero.copy_(zero)

    def push(self, tile: int) -> None:
        self.transport.put(self.push_puts[tile], self.stream.get("push"))

    def reduce(self, tile: int) -> None:
        """The owner's fp32 sum of tile ``tile`` in rank order (its own copy unquantized), requantized once."""
        self.wait_push(tile)
        g0, g1 = self.tiling.tile(tile)
        terms = []
        for r in range(self.world_size):
            if r == self.rank:
                terms.append(self.rs[self.rank, g0:g1])
            else:
                terms.append(A.dequantize_segments(*self.push_recv[tile][r], self.spec))
        acc = terms[0].clone()
        for term in terms[1:]:
            acc = acc + term
        self.acc[g0:g1].copy_(acc)
        codes, scale, zero = A.quantize_segments(acc[None], self.spec)
        self.red_codes[g0:g1].copy_(codes[0])
        self.red_scale[g0:g1].copy_(scale[0])
        self.red_zero[g0:g1].copy_(zero[0])

    def gather(self, tile: int) -> None:
        """Put the reduced tile to every peer; decode it for this rank's own portion of the output."""
        self.transport.put(self.gather_puts[tile], self.stream.get("gather"))
        g0, g1 = self.tiling.tile(tile)
        self.s_hat_scaled[self.rank, g0:g1].copy_(
            A.dequantize_segments(self.red_codes[g0:g1], self.red_scale[g0:g1], self.red_zero[g0:g1], self.spec))

    def tail(self, tile: int) -> None:
        self.wait_gather(tile)
        g0, g1 = self.tiling.tile(tile)
        for o in self.others:
            self.s_hat_scaled[o, g0:g1].copy_(A.dequantize_segments(*self.gather_recv[tile][o], self.spec))

    def exit(self) -> None:
        """y = unrotate(s_hat) in the caller's dtype and shape, s_hat = s_hat_scaled * 2^-k; without rescaling,
        the range events of what this rank quantized (its sent segments and the one it reduced), counted and
        warned about as the reference does (algorithm.range_flags: a host synchronisation, on this path only)."""
        if self.pow2 is False:
            A.note_rank_range((self.rs[self.others_index], self.acc), (self.sent_scale, self.red_scale),
                              (self.sent_zero, self.red_zero), self.spec, "EchoBuffer.all_reduce (torch stages)")
        if self.pow2:
            torch.mul(self.s_hat_scaled, self.down, out=self.s_hat)
            s_hat = self.s_hat
        else:
            s_hat = self.s_hat_scaled
        y = self.y
        y.copy_(A.from_segments(self.rotation.unrotate(s_hat), self.layout, y.shape, y.dtype))

    def update(self) -> None:
        """The compensator's averages from this call's residual (algorithm.output_residual or
        algorithm.local_residual, as echo_ds.reference takes them)."""
        comp = self.comp
        s_hat = self.s_hat if self.pow2 else self.s_hat_scaled
        if comp.residual == "output":
            u = A.output_residual(self.r, s_hat, self.world_size)
        else:
            sent = A.dequantize_segments(self.sent_codes, self.sent_scale, self.sent_zero, self.spec)
            u = A.local_residual(self.rs, sent, self.rank, self.s_hat_scaled[self.rank], self.acc,
                                 sent_index=self.others_index, down=self.down if self.pow2 else None)
        comp.update(u)


# ----------------------------------------------------------------------------------------------------
# The executor: schedules, stage streams and events, one call
# ----------------------------------------------------------------------------------------------------

kScheduleCacheSize = 32
kStreams = ("push", "reduce", "gather", "tail")


class StagedPipeline:
    """The staged pipeline of one transport: the schedule cache, the stage streams and their events, and the
    call that issues the stages. EchoBuffer owns the transport and decides which calls come here.

    transport: the buffer's (its kind decides streams and events: none on the host transport).
    ops: echo_ds.ops where the staged kernels may run (None: stages "torch", or no kernels).
    stages: the buffer's setting ("kernels" warns where the kernels cannot run a call).
    warn: ``warn(reason, rank)``, the buffer's one warning per reason.
    """

    def __init__(self, transport, rank: int, world_size: int, capacity: L.Capacity, device, ops, stages: str,
                 warn: Callable[[str, int], None]):
        self.transport = transport
        self.rank = rank
        self.world_size = world_size
        self.capacity = capacity
        self.device = device
        self.ops = ops
        self.stages = stages
        self._warn = warn
        self.schedules: "OrderedDict[object, Schedule]" = OrderedDict()
        cuda = transport.kind == "cuda"
        self.streams = {name: torch.cuda.Stream(device) for name in kStreams} if cuda else {}
        self._events = self._new_events() if cuda else {}
        self._graph_events = []  # the events of captured calls, kept with the pipeline

    @staticmethod
    def _new_events() -> dict:
        return {name: torch.cuda.Event() for name in
                ("start", "pushed0", "pushed1", "reduced0", "reduced1", "gather_end", "tail_end")}

    def stages_for(self, x: torch.Tensor, spec: QuantSpec) -> str:
        """"kernels" where the stage kernels of echo_ds.ops support the call (and stages is not "torch"),
        else "torch" (same bits)."""
        if self.ops is None:
            return "torch"
        why = self.ops.unsupported_reason(self.world_size, spec, x.dtype)
        if why is not None:
            if self.stages == "kernels":
                self._warn(f"the fused kernels do not support this call ({why}); its stages run through torch",
                           self.rank)
            return "torch"
        return "kernels"

    def _schedule(self, x: torch.Tensor, spec: QuantSpec, layout: A.Layout, caller, tile_bytes: int) -> Schedule:
        kind = self.stages_for(x, spec)
        key = (schedule_key(x.dtype, spec, layout), kind)
        sched = self.schedules.get(key)
        if sched is not None:
            self.schedules.move_to_end(key)
            return sched
        if len(self.schedules) >= kScheduleCacheSize:
            victim = next((k for k, s in self.schedules.items() if not s.pinned), None)
            if victim is not None:
                del self.schedules[victim]  # every stream of its last call has joined the caller's
        args = (key[0], spec, layout, self.rank, self.world_size, self.transport, tile_bytes, self.capacity,
                self.device)
        sched = KernelSchedule(*args, ops=self.ops) if kind == "kernels" else TorchSchedule(*args)
        sched.stream = self.streams
        self.schedules[key] = sched
        return sched

    def _on(self, name: str):
        s = self.streams.get(name)
        return torch.cuda.stream(s) if s is not None else contextlib.nullcontext()

    def _record(self, event: str, stream: str) -> None:
        if self.streams:
            self._events[event].record(self.streams[stream])

    def _wait(self, stream: str, event: str) -> None:
        if self.streams:
            self.streams[stream].wait_event(self._events[event])

    def all_reduce(self, x, spec, compensator, pow2, *, tile_bytes: int, count_call: Callable[[], int],
                   check: Callable[[], None], fault=None):
        """One call of EchoBuffer.all_reduce that its policy sent here (EchoBuffer's contract).

        count_call: counts the call with the buffer and returns its number (once its schedule and output
        exist: a call that fails before that counts nothing); check: the buffer's check() (the host
        transport's end of call); fault: the buffer's test hook, (call number, "exit_after_push")."""
        if self.transport.kind == "cuda" and torch.cuda.is_current_stream_capturing():
            # NOTE: an event recorded inside a capture must never be waited on outside it (CUDA answers
            # "invalid argument", seen on the H200 at the first eager call after a replay), so a captured
            # call records its own events.
            eager_events, self._events = self._events, self._new_events()
            self._graph_events.append(self._events)
            try:
                return self._all_reduce(x, spec, compensator, pow2, tile_bytes, count_call, check, fault)
            finally:
                self._events = eager_events
        return self._all_reduce(x, spec, compensator, pow2, tile_bytes, count_call, check, fault)

    def _all_reduce(self, x, spec, compensator, pow2, tile_bytes, count_call, check, fault):
        t = self.transport
        cuda = t.kind == "cuda"
        capturing = cuda and torch.cuda.is_current_stream_capturing()
        caller = torch.cuda.current_stream(self.device) if cuda else None
        layout = A.Layout(x.numel(), self.world_size, spec.group_size)
        if not x.is_contiguous():
            x = x.contiguous()
        if compensator is not None:
            # Allocated on the caller's stream and kept across calls; every stage stream that reads or
            # writes it joins the caller's stream before the call returns, so no record_stream is needed.
            compensator._ensure((self.world_size, layout.groups_per_segment, spec.group_size), self.device)
        sched = self._schedule(x, spec, layout, caller, tile_bytes)
        if capturing:
            sched.pinned = True
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        num_call = count_call()
        num_tiles = sched.tiling.num_tiles
        sched.begin(x, y, compensator, pow2)

        t.begin_call(caller)
        if cuda:
            self._events["start"].record(caller)
        with self._on("push"):
            self._wait("push", "start")
            sched.entry()
        if fault == (num_call, "exit_after_push"):
            with self._on("push"):
                for tile in range(num_tiles):
                    sched.push(tile)
            if cuda:
                torch.cuda.synchronize(self.device)
            os._exit(17)  # tests: a rank dies in the middle of a call, its codes sent
        # Tile-major issue order, so that the two event slots of each stage boundary alternate (appendix C).
        for tile in range(num_tiles):
            pushed, reduced = f"pushed{tile % 2}", f"reduced{tile % 2}"
            with self._on("push"):
                sched.push(tile)
                self._record(pushed, "push")
            with self._on("reduce"):
                self._wait("reduce", pushed)  # the torch stages reduce the rs their push formed
                sched.reduce(tile)
                self._record(reduced, "reduce")
            with self._on("gather"):
                self._wait("gather", reduced)
                sched.gather(tile)
            with self._on("tail"):
                if tile == 0:
                    self._wait("tail", "start")
                sched.tail(tile)
        with self._on("gather"):
            self._record("gather_end", "gather")
        with self._on("tail"):
            self._wait("tail", "gather_end")
            sched.exit()
            if compensator is not None:
                sched.update()  # the kernels updated the state in their stages; the torch stages do it here
            self._record("tail_end", "tail")
        if cuda:
            caller.wait_event(self._events["pushed" + str((num_tiles - 1) % 2)])
            caller.wait_event(self._events["tail_end"])
        else:
            check()
        return y
