"""The staged pipeline of a p2p call: its executor, its stages, and the schedule that prepares them once per shape.

``StagedPipeline`` runs the calls EchoBuffer (which owns the transport and routes the calls) sends to the
staged pipeline. It holds the schedule cache and the stage streams and events, and issues one call: the
caller's stream raises the device-resident flag base and records a start event; the push stream forms x'
(compensation, rotation, the pow2 max exchange) and puts the codes of each tile into its owner's buffer,
publishing a flag per tile; the reduce stream waits for a tile's flags, reduces and requantizes it into
every peer's buffer; the gather stream decodes this rank's own segment; the tail stream waits for the owners'
tiles and decodes them; the caller's stream waits for the ends. The compensator's state is updated inside
those stages (by the entry and the owner reduce for residual "local", by the dequantize for "output"), so a
call leaves no work behind it. The host never synchronises while tiles are in flight.

A schedule holds, for one key (dtype, bits, quantizer, group size, rotation, segment size: appendix
C's schedule cache), the tiling, the static workspace (so that a CUDA graph captured over a call keeps
valid addresses, and no tensor crosses streams through the caching allocator), the views of this
rank's and its peers' slots, and the prepared flag waits and puts of every tile.

The stages (entry, push, reduce, gather, tail, exit, update; StagedPipeline runs them on the push, reduce,
gather and tail streams, exit and update on the tail stream) are ``KernelSchedule``'s: the fused kernels of
echo_ds.ops (issue 4). push_quantize writes the codes of a tile straight into its owners' push slots,
owner_reduce writes the reduced tile straight into every peer's gather slot; the transport only adds the
flags (echo_p2p_signal_kernel) and the waits. A transport may bring stages of its own behind the same methods
(its class attribute ``schedule``): the tests' host transport brings the torch stages (tests/torch_stages.py),
the CPU oracle of this pipeline. Every step is per group or per element, so a tile's bits are the whole
tensor's, and the stages reproduce the reference bit for bit.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from echo_ds import algorithm as A
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


class Schedule:
    """What every implementation of the stages shares: tiling, flags, the pow2 max exchange, slot views."""

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
# The executor: schedules, stage streams and events, one call
# ----------------------------------------------------------------------------------------------------

kScheduleCacheSize = 32
kStreams = ("push", "reduce", "gather", "tail")


class StagedPipeline:
    """The staged pipeline of one transport: the schedule cache, the stage streams and their events, and the
    call that issues the stages. EchoBuffer owns the transport and decides which calls come here: on the
    CUDA transport, only calls the staged kernels run (``runs``).

    transport: the buffer's (its kind decides streams and events: none on the host transport); its class
        attribute ``schedule``, where it has one, is the stages it brings (the tests' torch stages), else
        the kernels of ``ops`` run them (KernelSchedule).
    ops: echo_ds.ops (None: the transport brings its stages).
    """

    def __init__(self, transport, rank: int, world_size: int, capacity: L.Capacity, device, ops):
        self.transport = transport
        self.rank = rank
        self.world_size = world_size
        self.capacity = capacity
        self.device = device
        self.ops = ops
        self.own_schedule = getattr(transport, "schedule", None)
        self.schedules: "OrderedDict[object, Schedule]" = OrderedDict()
        cuda = transport.kind == "cuda"
        self.streams = {name: torch.cuda.Stream(device) for name in kStreams} if cuda else {}
        self._events = self._new_events() if cuda else {}
        self._graph_events = []  # the events of captured calls, kept with the pipeline

    @staticmethod
    def _new_events() -> dict:
        return {name: torch.cuda.Event() for name in
                ("start", "pushed0", "pushed1", "reduced0", "reduced1", "gather_end", "tail_end")}

    def unsupported_reason(self, spec: QuantSpec, dtype: torch.dtype):
        """Why this pipeline's stages cannot run calls of ``spec`` and ``dtype`` (None: they can): the staged
        kernels' support, or None where the transport brings its own stages (they take every configuration)."""
        if self.own_schedule is not None:
            return None
        if self.ops is None:
            return "the kernels of echo_ds.ops are not loaded"
        return self.ops.unsupported_reason(self.world_size, spec, dtype)

    @property
    def counts_range(self) -> bool:
        """Whether the stages count a call's range events without rescaling (the staged kernels do not)."""
        return self.own_schedule is not None

    def _schedule(self, x: torch.Tensor, spec: QuantSpec, layout: A.Layout, caller, tile_bytes: int) -> Schedule:
        key = schedule_key(x.dtype, spec, layout)
        sched = self.schedules.get(key)
        if sched is not None:
            self.schedules.move_to_end(key)
            return sched
        if len(self.schedules) >= kScheduleCacheSize:
            victim = next((k for k, s in self.schedules.items() if not s.pinned), None)
            if victim is not None:
                del self.schedules[victim]  # every stream of its last call has joined the caller's
        args = (key, spec, layout, self.rank, self.world_size, self.transport, tile_bytes, self.capacity,
                self.device)
        sched = self.own_schedule(*args) if self.own_schedule is not None else KernelSchedule(*args, ops=self.ops)
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
                self._wait("reduce", pushed)  # stages may reduce what their push formed (the torch stages)
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
                sched.update()  # the kernels updated the state in their stages (the torch stages do it here)
            self._record("tail_end", "tail")
        if cuda:
            caller.wait_event(self._events["pushed" + str((num_tiles - 1) % 2)])
            caller.wait_event(self._events["tail_end"])
        else:
            check()
        return y
