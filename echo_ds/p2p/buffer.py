"""EchoBuffer: the one owner of a tensor-parallel group's p2p resources (DeepEP's ``Buffer``).

It owns the transport (the handshake, close) and routes each call (the reference path, the one-launch call or
the staged pipeline). The one-launch call's plans and launches are echo_ds.p2p.call.OneLaunch (around the
extension's P2PRuntime) and the staged pipeline's executor (its schedules, stage streams and events) is
echo_ds.p2p.stages.StagedPipeline; it creates both over the transport once the handshake succeeded.

::

    buf = EchoBuffer(tp_group)                                  # collective: every rank of the group
    y = buf.all_reduce(x, cfg.quant_spec(), compensator=comp)          # pow2_rescale="auto"
    buf.close()                                                 # or leave it to interpreter exit

The constructor does the whole handshake, so that afterwards nothing is half set up: it loads
echo_ds.ops (the one extension: the transport's kernels, the Echo stages and the one-launch call),
allocates this rank's code buffer, parameter buffer and signal words, exchanges IPC handles over the
group, opens the peers', builds the 3P + 1 address table and proves peer writes with a write-and-verify
probe. Where any of it is missing (echo_ds.ops included) it logs one warning naming the setting to
change and every call takes the reference path (echo_ds.reference) instead; the results are the same
bits either way.

One call (stages "auto" or "fused"): ONE launch on the caller's stream (csrc/p2p_all_reduce.cu, through
the extension's P2PRuntime): every block quantizes its groups of the segments this rank sends straight
into the owners' buffers and raises a flag per owner, reduces its groups of the owned segment once its
peers' flags arrive and writes the result into every rank's buffer, then decodes every segment's groups
once the owners' flags arrive; the compensator's state is read and written in the same passes, and pow2
rescaling (True, or "auto") takes its max inside the launch. The host issues one binding call; flags,
epochs and pointer tables live in device memory, so the call replays from a CUDA graph like any kernel.

The staged pipeline (stages="kernels"; under "auto", calls above one_launch_max_bytes, which the policy sets
to 16 MiB where ranks share a GPU and leaves unlimited where each has its own): EchoBuffer gates the call by
its descriptor (_gate_staged) and hands it to StagedPipeline, which issues the stages on their streams
(echo_ds.p2p.stages says how). A call the kernels do not run (a group size outside
echo_ds.ops.kernels.SUPPORTED_GROUP_SIZES) takes the reference path, with one warning.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import weakref
from typing import List, Optional

import torch
import torch.distributed as dist

from echo_ds import algorithm as A
from echo_ds import collective
from echo_ds.p2p import layout as L
from echo_ds.p2p import policy
from echo_ds.p2p import protocol as proto
from echo_ds.p2p.call import OneLaunch, call_descriptor
from echo_ds.p2p.call import state_dtype as _state_dtype
from echo_ds.p2p.stages import StagedPipeline
from echo_ds.log import log_once
from echo_ds.ops.kernels import KERNEL_WORLD_SIZES
from echo_ds.quant import QuantSpec
from echo_ds.reference import check_differentiable_input, echo_all_reduce

logger = logging.getLogger("echo_ds.p2p")

# Wire bytes of one tile per peer of the staged pipeline: 16 MiB, from its tile sweep (benchmarks/RESULTS.md,
# "P2P transport", "Tile size"): every tile costs several launches of host time through Python, and on one GPU
# a "peer" write is a local HBM write with nothing to overlap, so fewer tiles won; 16 MiB tied with one tile
# per segment at 64 MiB and still pipelines the largest messages. Measured with ranks sharing one GPU only.
kDefaultTileBytes = 16 * 1024 * 1024
kDefaultMaxNumel = 1 << 26  # 64 Mi elements: a 128 MiB bf16 activation, 256 MiB in fp32
kOnFault = ("raise", "reference")  # EchoBuffer's on_fault

_live_buffers: "weakref.WeakSet[EchoBuffer]" = weakref.WeakSet()


def _warn_once(reason: str, rank: int) -> None:
    log_once("warning", f"echo p2p: using the reference path: {reason}", rank=rank)


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _default_timeout() -> float:
    return float(os.environ.get("ECHO_P2P_TIMEOUT_S", proto.kDefaultTimeoutS))


class EchoBuffer:
    """The p2p transport of one tensor-parallel group (collective constructor: call it on every rank).

    group: the process group (None: the default group). Its backend only carries the handshake.
    max_numel: sizes the workspace (about 2 bytes per element plus the parameters, per rank) for messages
        of up to this many elements in one launch. The one-launch call takes larger messages too, one
        launch per chunk of the workspace from one binding call; the staged pipeline cannot, so such a
        message goes to the one-launch call wherever its kernel supports the call (else the reference
        path, with one warning). Every rank of the group must pass the same value.
    tile_bytes: wire bytes of one tile per peer (0: one tile per segment).
    timeout_s: a cross-GPU wait longer than this fails the call with EchoP2PTimeout naming rank, peer,
        stage and call number (default ECHO_P2P_TIMEOUT_S or 5 s). Ranks must not drift further apart.
    device: this rank's GPU (default: torch's current device).
    transport: "cuda" (IPC + kernels), or for tests a class implementing the transport's interface on the
        CPU, built as ``transport(group, rank, world_size, capacity, timeout_s)`` (tests/host_transport.py:
        shared memory between CPU processes; it carries the staged pipeline only, with the stages it brings).
    stages: "auto" (the one-launch kernel of echo_ds.ops for messages up to ``one_launch_max_bytes``, the
        staged kernels above), "fused" (the one-launch kernel at every size) or "kernels" (the staged kernels
        at every size the workspace holds). Under each, a call the kernels do not run takes the reference
        path, with one warning.
    one_launch_max_bytes: see ``stages="auto"``; None (default): the policy's (echo_ds.p2p.policy.
        one_launch_max_bytes): every size where each rank has a GPU of its own, 16 MiB where ranks share one.
    on_fault: what follows a failed wait (a peer stopped, killed, or further behind than ``timeout_s``; ranks
        that called with different arguments). ``"raise"`` (default): the call, ``check()`` or
        ``synchronize()`` that finds it raises EchoP2PTimeout / EchoP2PMismatch, and so does every later
        one; the buffer is only good for ``close()``. ``"reference"``: that first one raises the same
        error, once, after moving the group to the reference path without any collective (a stopped peer
        would hold one): the waits are aborted, the group's custom-op registration dropped, the one-launch
        call retired, ``active`` false and ``reason`` naming the failure, one warning logged. From then on
        ``all_reduce`` is ``echo_all_reduce`` over the process group and ``plain_all_reduce`` is
        ``torch.distributed.all_reduce``; ``check()`` and ``synchronize()`` no longer raise that failure;
        the peers' mappings and this rank's memory stay until ``close()`` (a collective, as always) or
        interpreter exit, since freeing memory a peer still maps is undefined. What the caller must know:

        * the call that raised, and every earlier call of this rank whose result was not checked yet (the
          calls are asynchronous), returned undefined results; a compensator those calls updated holds an
          undefined state: ``Compensator.reset()`` it (the averages restart from zero) or replace it;
        * every rank must resume at the same call (redo the step, or skip it, on every rank): the reference
          path's descriptor check refuses calls that differ in their arguments, but cannot tell two
          identical calls of different steps apart;
        * each reference call waits for its peers at most the reference's own timeout (ECHO_P2P_TIMEOUT_S,
          default 5 s, per stage), the first one included: a peer that comes back later than that, or not
          at all (killed), fails it with EchoTimeout / EchoPeerError and the group is unusable;
        * CUDA graphs captured before the fault still replay the one-launch kernel, whose waits now give up
          at once and which ``check()`` no longer reports: capture them again.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *, max_numel: int = kDefaultMaxNumel,
                 tile_bytes: int = kDefaultTileBytes, timeout_s: Optional[float] = None,
                 device: Optional[torch.device] = None, transport="cuda", stages: str = "auto",
                 min_group_size: int = 16, one_launch_max_bytes: Optional[int] = None,
                 one_shot_max_bytes: Optional[int] = None, on_fault: str = "raise"):
        if stages == "torch":
            raise ValueError("stages='torch': the torch stages left the package; a call the kernels do not run takes "
                             "the reference path (the torch stages are the staged pipeline's CPU oracle, "
                             "tests/torch_stages.py, which the tests' host transport brings)")
        if stages not in ("auto", "fused", "kernels"):
            raise ValueError(f"stages={stages!r} must be 'auto', 'fused' or 'kernels'")
        if not (transport == "cuda" or isinstance(transport, type)):
            raise ValueError(f"transport={transport!r} must be 'cuda' or a transport class (the CPU's host "
                             f"transport is a test fixture: tests/host_transport.py)")
        if on_fault not in kOnFault:
            raise ValueError(f"on_fault={on_fault!r} must be one of {', '.join(map(repr, kOnFault))}")
        self.on_fault = on_fault
        self.stages = stages
        if one_launch_max_bytes is not None and (isinstance(one_launch_max_bytes, bool) or
                                                 not isinstance(one_launch_max_bytes, int) or one_launch_max_bytes < 0):
            raise ValueError(f"one_launch_max_bytes={one_launch_max_bytes!r} must be None or a non-negative int")
        # Until the handshake knows how many ranks share a GPU (_init_runtime), the shared GPU's limit.
        self._one_launch_max_bytes = one_launch_max_bytes
        self.one_launch_max_bytes = ((1 << 62) if stages == "fused" else one_launch_max_bytes
                                     if one_launch_max_bytes is not None else policy.kSharedGpuOneLaunchMaxBytes)
        if one_shot_max_bytes is not None and (isinstance(one_shot_max_bytes, bool) or
                                               not isinstance(one_shot_max_bytes, int) or one_shot_max_bytes < 0):
            raise ValueError(f"one_shot_max_bytes={one_shot_max_bytes!r} must be None or a non-negative int")
        self._ops = None
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = _default_timeout() if timeout_s is None else float(timeout_s)
        self.tile_bytes = tile_bytes
        # The one-launch call's one-shot variant (16-bit x up to one_shot_max_bytes; 0: two-shot only). Its
        # regions, part of the workspace, are sized here for the argument or for the policy's largest; the
        # handshake then sets the threshold (the policy's for the ranks per GPU, where the argument is None) and
        # checks that every rank has the same one.
        self._one_shot_arg = one_shot_max_bytes
        shot = policy.one_shot_max_bytes(self.world_size) if one_shot_max_bytes is None else (
            one_shot_max_bytes if self.world_size in policy.ONE_SHOT_WORLD_SIZES else 0)
        self.one_shot_max_bytes = shot
        self.capacity = L.Capacity(self.world_size, max_numel, min_group_size, shot_numel=min(max_numel, shot // 2))
        self.transport = None
        self.active = False
        self.reason = ""
        self.closed = False
        # The one-launch call (echo_ds.p2p.call.OneLaunch) where it serves calls (stages allowing), else None.
        self.one_launch: Optional[OneLaunch] = None
        # The same object whatever the stages: the staged calls' descriptor gate (_gate_staged); close() frees
        # it (also after on_fault="reference" retired the one-launch call).
        self._owned = None
        self._on_reference = False  # on_fault="reference" moved the group to the reference path
        self._decisions = {}  # call-policy key -> Decision (a pure function of the key)
        self._range_seen = (0, 0)  # the kernels' range counters as last folded (_note_range)
        self._range_bits = 4  # the bit width the range warning names: the last call's without rescaling
        self._pipeline = None  # echo_ds.p2p.stages.StagedPipeline, once the transport exists
        self._num_calls = 0
        self._fault = None  # tests: (call number, "exit_after_push")
        self._backend_name = None  # the group's name in echo_ds.collective's registry, while registered
        if transport == "cuda":
            self._init_cuda(device)
        else:
            self.device = torch.device("cpu")
            self._init_host(transport)
        if not self.active:
            _warn_once(self.reason, self.rank)
        _live_buffers.add(self)

    # ------------------------------------------------------------------------------------------------
    # Construction
    # ------------------------------------------------------------------------------------------------

    def _gather(self, obj) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _init_cuda(self, device) -> None:
        if not torch.cuda.is_available():
            self.device = torch.device("cpu")
            facts = policy.GroupFacts("cpu", self.world_size, True, False, False)
            self._gather(None)  # keep the ranks' collective calls matched
            self.reason = policy.group_decision(facts).reason
            return
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None
                                   else torch.device(device).index or 0)
        torch.cuda.set_device(self.device)
        torch.zeros(1, device=self.device)  # the primary context is current from here on
        kernels_error = ""
        try:
            import echo_ds.ops as ops
            from echo_ds.p2p import driver

            ext = ops.load()  # once per process; EchoKernelsUnavailable names what this machine lacks
            L.check_layout(ext)
            driver.init()
            uuid = driver.device_uuid(self.device.index)
        except Exception as e:  # noqa: BLE001 - any failure here means "no fast path", with the reason
            kernels_error = f"{type(e).__name__}: {e}"
            uuid = None
        me = {"host": _host_id(), "uuid": uuid, "ordinal": self.device.index, "kernels_error": kernels_error}
        everyone = self._gather(me)
        same_host = len({e["host"] for e in everyone}) == 1
        errors = [f"rank {j}: {e['kernels_error']}" for j, e in enumerate(everyone) if e["kernels_error"]]
        peer_access = True
        if same_host and not errors:
            from echo_ds.p2p import driver

            # Peers on one host: every distinct device of the group must reach mine. A device's ordinal
            # in another process can differ (CUDA_VISIBLE_DEVICES), so they are matched by UUID.
            ordinal_of = {driver.device_uuid(i): i for i in range(torch.cuda.device_count())}
            for e in everyone:
                peer = ordinal_of.get(e["uuid"])
                if peer is None or not driver.can_access_peer(self.device.index, peer):
                    peer_access = False
            peer_access = all(self._gather(peer_access))
        facts = policy.GroupFacts("cuda", self.world_size, same_host, peer_access, not errors, "; ".join(errors))
        decision = policy.group_decision(facts)
        if not decision:
            self.reason = decision.reason
            return
        from echo_ds.p2p.transport import CudaTransport

        self.transport = CudaTransport(self.group, self.rank, self.world_size, self.device, self.capacity,
                                       self.timeout_s, ext)
        self._ops = ops
        self._pipeline = StagedPipeline(self.transport, self.rank, self.world_size, self.capacity, self.device, ops)
        self._finish_handshake()
        if self.active:
            self._init_runtime(ext, everyone, uuid)

    def _init_runtime(self, ext, everyone, uuid) -> None:
        """The one-launch call (echo_ds.ops.P2PRuntime), on every rank or on none (collective).

        Ranks that share a device (same UUID; tests and benchmarks run so) must have all their blocks
        resident at once, or a block could spin for a peer block that never gets an SM: the grid is
        capped at the blocks resident per device divided by the ranks on it, the smallest over the group.
        """
        ok, cap, why = False, 0, ""
        sharing = sum(1 for e in everyone if e["uuid"] == uuid)
        # the group's most ranks on one device: the same on every rank, so all take the same path
        most = max(sum(1 for f in everyone if f["uuid"] == e["uuid"]) for e in everyone)
        if self.stages == "auto" and self._one_launch_max_bytes is None:
            self.one_launch_max_bytes = policy.one_launch_max_bytes(most)
        if self._one_shot_arg is None:
            self.one_shot_max_bytes = min(self.one_shot_max_bytes, policy.one_shot_max_bytes(self.world_size, most))
        if self.world_size not in KERNEL_WORLD_SIZES:
            why = f"the one-launch kernel is built for {KERNEL_WORLD_SIZES} ranks, not {self.world_size}"
        else:
            try:
                # Ranks sharing a device get half of their even share: at the full share (every SM slot
                # taken) P = 4 ranks under MPS hung once in 600 calls on the H200 (2026-12-04), a block
                # of one rank never scheduled while the others spun.
                resident = int(ext.p2p_resident_blocks())
                cap = min(L.kFusedMaxBlocks, resident if sharing == 1 else resident // (2 * sharing))
                # Experiments only (benchmarks/RESULTS.md): ECHO_P2P_MAX_BLOCKS replaces the cap; above what
                # is resident at once a call can hang until the timeout.
                cap = min(L.kFusedMaxBlocks, int(os.environ.get("ECHO_P2P_MAX_BLOCKS", cap)))
                ok = cap >= 1
                why = "" if ok else f"{sharing} ranks share one device: no block left for each"
            except Exception as e:  # noqa: BLE001 - the staged pipeline still works
                why = f"{type(e).__name__}: {e}"
        verdicts = self._gather((ok, cap, why, self.capacity.max_numel, self.one_shot_max_bytes))
        if len({v[4] for v in verdicts}) != 1:
            # NOTE: the one-shot regions are sized by it, and ranks must take the same variant for the same call.
            self.close()
            raise ValueError("EchoBuffer: every rank of the group must pass the same one_shot_max_bytes, got "
                             + ", ".join(f"rank {j}: {v[4]}" for j, v in enumerate(verdicts)))
        if len({v[3] for v in verdicts}) != 1:
            # NOTE: the workspace decides how many chunks (launches, epochs) a large message takes; ranks
            # with different workspaces would pair one rank's chunk with another's next call.
            self.close()  # collective: every rank sees the same verdicts
            raise ValueError("EchoBuffer: every rank of the group must pass the same max_numel, got "
                             + ", ".join(f"rank {j}: {v[3]}" for j, v in enumerate(verdicts)))
        if not all(v[0] for v in verdicts):
            bad = "; ".join(f"rank {j}: {v[2]}" for j, v in enumerate(verdicts) if not v[0])
            msg = f"the one-launch call is off ({bad}); calls run the staged pipeline"
            if self.stages == "fused":
                _warn_once(msg, self.rank)
            else:
                logger.info("echo p2p: %s", msg)
            return
        cap = min(v[1] for v in verdicts)
        self._owned = OneLaunch(ext, self.transport, self.rank, self.world_size, self.capacity, cap, self.device,
                                self.one_shot_max_bytes)
        # stages "kernels" keeps it for the staged calls' descriptor gate only
        self.one_launch = self._owned if self.stages in ("auto", "fused") else None
        if sharing > 1 and self.rank == 0:
            logger.info("echo p2p: %d ranks share one device: the one-launch kernel's grid is capped at %d blocks "
                        "per rank, so that every rank's blocks are resident at once", sharing, cap)

    def _init_host(self, transport_class) -> None:
        self.transport = transport_class(self.group, self.rank, self.world_size, self.capacity, self.timeout_s)
        self._pipeline = StagedPipeline(self.transport, self.rank, self.world_size, self.capacity, self.device, None)
        self._finish_handshake()

    def _finish_handshake(self) -> None:
        ok, why = self._probe()
        verdicts = self._gather((ok, why))
        bad = [f"rank {j}: {w}" for j, (o, w) in enumerate(verdicts) if not o]
        facts = policy.GroupFacts("cuda", self.world_size, True, True, True, "", not bad, "; ".join(bad))
        decision = policy.group_decision(facts)
        if decision:
            self.active = True
            # Every Echo call on this group (echo_ds.reference.echo_all_reduce, eager or compiled: the custom
            # op of echo_ds.collective) now runs here; close() takes it back to the reference.
            collective.register_backend(self.group, self)
            self._backend_name = collective.group_name(self.group)
            return
        self.reason = decision.reason
        self.transport.close()
        self.transport = None

    def _probe(self):
        """Write-and-verify: every rank puts four words into each peer's probe slot and signals it; each
        rank waits for all its peers' signals and checks the words. The driver's peer-access answer can
        be wrong on some hosts; this proves the path the calls will use (put kernel, flag, wait)."""
        t = self.transport
        me = self.rank
        if t.error:  # this rank could not map its peers: keep the collective calls matched, then decline
            dist.barrier(group=self.group)
            dist.barrier(group=self.group)
            return False, t.error
        nonce = (0x9E3779B9 * (me + 1) + 0x7F4A7C15 * self.world_size) & 0xFFFFFFFF
        words = torch.tensor([0xEC40, nonce & 0x7FFFFFFF, me, 0], dtype=torch.int32, device=self.device)
        others = [j for j in range(self.world_size) if j != me]
        put = t.prepare_put([(words, 0, 12, j, "signals", L.signal_offset("probe", me, 0)) for j in others],
                            [], 0, L.kLaneProbe)
        stream = torch.cuda.current_stream(self.device) if t.kind == "cuda" else None
        dist.barrier(group=self.group)
        try:
            t.put(put, stream)
            flag_value = 0x40000000 | me  # any value no call publishes before the first wrap
            t.signal(t.prepare_signal([(j, L.signal_offset("probe", me, 3)) for j in others], 0, flag_value), stream)
            for s in others:
                wait = t.prepare_wait([(s, L.signal_offset("probe", s, 3))], 0, proto.kWaitProbe, 0,
                                      value=0x40000000 | s)
                t.wait(wait, stream)
            if t.kind == "cuda":
                torch.cuda.synchronize(self.device)
            failure = t.failure()
            if failure is not None:
                t.clear_failure()
                return False, proto.describe_failure(failure, self.timeout_s, self.world_size)
            got = t.signals[L.signal_offset("probe", 0, 0):L.signal_offset("probe", self.world_size, 0)]
            got = got.view(torch.int32).view(self.world_size, 4).cpu()
            for s in others:
                want = [0xEC40, ((0x9E3779B9 * (s + 1) + 0x7F4A7C15 * self.world_size) & 0xFFFFFFFF) & 0x7FFFFFFF, s]
                if got[s, :3].tolist() != want:
                    return False, f"rank {me} read {got[s, :3].tolist()} from rank {s}'s probe, expected {want}"
            return True, ""
        except Exception as e:  # noqa: BLE001
            return False, f"rank {me}: {type(e).__name__}: {e}"
        finally:
            dist.barrier(group=self.group)

    # ------------------------------------------------------------------------------------------------
    # Public
    # ------------------------------------------------------------------------------------------------

    @property
    def table(self) -> List[int]:
        """The 3P + 1 addresses: P code buffers, P parameter buffers, P signal arrays, the flag base."""
        return self.transport.table_entries() if self.transport is not None else []

    @property
    def gates_staged(self) -> bool:
        """Whether the staged calls carry their descriptor: a launch of the one-launch family goes first
        (_gate_staged). False without a one-launch runtime (the host transport, or a group where it could not
        be built): callers then check the ranks' agreement themselves."""
        return self._owned is not None

    @property
    def num_calls(self) -> int:
        return self._num_calls

    @property
    def _schedules(self):
        """The staged pipeline's schedule cache (benchmarks/bench_p2p.py's tile sweep clears and reads it)."""
        return self._pipeline.schedules

    def failure(self) -> Optional[str]:
        """The message of this group's first failed wait, or None (reads pinned memory: no sync)."""
        if self.transport is None:
            return None
        f = self.transport.failure()
        return None if f is None else proto.describe_failure(f, self.timeout_s, self.world_size)

    def check(self) -> None:
        """Raise EchoP2PTimeout (a wait timed out or was abandoned) or EchoP2PMismatch (ranks made a call
        with different arguments) if any wait of this group has failed so far (no synchronisation)."""
        if self.closed:
            raise proto.EchoP2PError("echo p2p: the EchoBuffer is closed")
        if self.transport is None or self._on_reference:  # on_fault="reference": reported once, at the move
            return
        f = self.transport.failure()
        if f is not None:
            msg = proto.describe_failure(f, self.timeout_s, self.world_size)
            error = (proto.EchoP2PMismatch if f.code == proto.kErrorMismatch else proto.EchoP2PTimeout)(msg)
            if self.on_fault == "reference":
                self._move_to_reference(f, type(error).__name__)
            raise error

    def synchronize(self) -> None:
        """Wait for every call issued so far (bounded: waits give up after the timeout), then check()."""
        if self.transport is not None and self.transport.kind == "cuda":
            for s in self._pipeline.streams.values():
                s.synchronize()
            torch.cuda.current_stream(self.device).synchronize()
        self._note_range()
        self.check()

    def _note_range(self, bits: Optional[int] = None, transport=None) -> None:
        """Fold the kernels' range counters (one-launch calls without rescaling whose message the format could
        not express, csrc/p2p_all_reduce.cuh count_range) into algorithm.range_events and warn once per kind,
        as the reference path does. Reads mapped memory, no synchronisation: calls in flight count later
        (at the next call without rescaling, synchronize() or close())."""
        if bits is not None:
            self._range_bits = bits
        t = self.transport if transport is None else transport
        if t is None or t.kind != "cuda":
            return
        counts = t.range_counts()
        if counts != self._range_seen:
            (clipped, underflow), (seen_c, seen_u) = counts, self._range_seen
            self._range_seen = counts
            if self._owned is not None:
                self._owned.set_range_seen(*counts)  # its calls go on launching (P2PRuntime.call)
            A.note_range(clipped - seen_c, underflow - seen_u, self._range_bits, "EchoBuffer.all_reduce")

    def would_use_p2p(self, x: torch.Tensor, spec: QuantSpec, compensator=None) -> policy.Decision:
        """The call policy for ``x`` (a pure function of its size, dtype and the group's facts)."""
        if not self.active:
            return policy.Decision(False, self.reason)
        telemetry = bool(compensator is not None and compensator.telemetry)
        state_dtype = _state_dtype(compensator)
        device_matches = x.device == self.device
        key = (x.dtype, x.numel(), spec.bits, spec.group_size, telemetry, device_matches, state_dtype)
        decision = self._decisions.get(key)
        if decision is None:
            if len(self._decisions) >= 4096:
                self._decisions.clear()
            decision = self._decisions[key] = policy.call_decision(
                dtype=x.dtype, numel=x.numel(), element_size=x.element_size(), world_size=self.world_size,
                bits=spec.bits, group_size=spec.group_size, capacity=self.capacity, telemetry=telemetry,
                device_matches=device_matches, chunked=self._one_launch_serves(spec, x.dtype), state_dtype=state_dtype,
                staged_unsupported=self._pipeline.unsupported_reason(spec, x.dtype) or "")
        return decision

    def _one_launch_serves(self, spec: QuantSpec, dtype: torch.dtype) -> bool:
        """The one-launch call runs calls of this spec and dtype (at any size: chunk by chunk beyond its
        workspace)."""
        from echo_ds.ops import kernels as K

        return self.one_launch is not None and K.unsupported_reason(self.world_size, spec, dtype) is None

    def _fits_staged(self, x: torch.Tensor, spec: QuantSpec) -> bool:
        """The whole message fits the workspace, as the staged pipeline needs."""
        return L.make_tiling(x.numel(), self.world_size, spec.bits, spec.group_size, 0, self.capacity).fits()

    def all_reduce(self, x: torch.Tensor, spec: QuantSpec, compensator=None, pow2_rescale="auto", *,
                   site: Optional[int] = None, direction: Optional[str] = None) -> torch.Tensor:
        """The Echo all-reduce of ``x`` over the group: a new tensor of ``x``'s shape and dtype.

        Same contract and same bits as :func:`echo_ds.reference.echo_all_reduce` (x: any shape, fp32 /
        bf16 / fp16, left untouched; compensator: this direction's state, updated in place; all ranks
        return bit-identical tensors). Asynchronous like a NCCL call: the result is ordered on the
        current stream; a failed wait surfaces at the next call, ``synchronize()`` or ``check()``.
        site, direction: the caller's (as for echo_all_reduce): ranks that disagree on them, or on any
        argument, raise EchoP2PMismatch (EchoCallMismatch on the reference path).
        """
        one = self.one_launch
        if one is not None:  # the one-launch fast path: one dict lookup, then the call
            key = (x.dtype, x.numel(), x.device, spec, pow2_rescale,
                   None if compensator is None else compensator.kernel_key, site, direction)
            plan = one.plans.get(key)
            if plan is not None and not self.closed and not (x.requires_grad and torch.is_grad_enabled()):
                return self._one_launch(x, plan, compensator)  # checks the error record in C++
        if not x.is_floating_point():
            raise TypeError(f"all_reduce expects a floating-point tensor, got {x.dtype}")
        check_differentiable_input(x, "EchoBuffer.all_reduce")
        A.check_pow2_mode(pow2_rescale, "EchoBuffer.all_reduce")
        if self.closed:
            raise proto.EchoP2PError("echo p2p: all_reduce on a closed EchoBuffer")
        if self.world_size == 1:
            return x.clone()
        decision = self.would_use_p2p(x, spec, compensator)
        if not decision:
            if self.active:
                _warn_once(decision.reason, self.rank)
            return echo_all_reduce(x, spec, group=self.group, compensator=compensator, pow2_rescale=pow2_rescale,
                                   site=site, direction=direction)
        self.check()
        # Without rescaling, the one-launch call at any size: its kernel counts the range events (issue 35).
        if self._one_launch_serves(spec, x.dtype) and (x.numel() * x.element_size() <= self.one_launch_max_bytes
                                                       or pow2_rescale is False or not self._fits_staged(x, spec)):
            plan = one.plan(x, spec, compensator, pow2_rescale, site, direction)
            one.remember(key, plan)
            return self._one_launch(x, plan, compensator)
        if pow2_rescale is False and not self._pipeline.counts_range:
            # NOTE: the staged kernels do not check what the format can express; the one launch and the
            # reference do (the choice is the same on every rank: the runtime exists on all or none, the
            # kernels' support is a function of the call's arguments).
            _warn_once("pow2_rescale=False runs on the one-launch kernel or the reference path, which count "
                       "messages the format cannot express; the staged kernels do not, and this call's one-launch "
                       "kernel is not available", self.rank)
            return echo_all_reduce(x, spec, group=self.group, compensator=compensator, pow2_rescale=pow2_rescale,
                                   site=site, direction=direction)
        self._gate_staged(x, spec, compensator, pow2_rescale, site, direction)
        return self._pipeline.all_reduce(x, spec, compensator, pow2_rescale, tile_bytes=self.tile_bytes,
                                         count_call=self._count_call, check=self.check, fault=self._fault)

    def _count_call(self) -> int:
        self._num_calls += 1
        return self._num_calls

    def _gate_staged(self, x, spec, compensator, pow2, site, direction) -> None:
        """The staged pipeline's flags carry no call descriptor; a launch of the one-launch family's plain
        kernel on one element, whose flags carry this call's descriptor, goes first on the caller's stream
        (the staged streams start behind it). Ranks that made different calls fail it with EchoP2PMismatch,
        and its failure poisons the staged transport too (P2PRuntime's staged_poisoned), so the staged
        kernels behind it publish no flag and wait for none: the mismatch is named, and no data of the two
        calls mixes. Costs one launch and one flag round trip per staged call (tens of microseconds, against
        their hundreds of host time). Without a runtime (the host transport, or a group whose one-launch
        runtime could not be built) there is no gate: docs/errors.md."""
        if self._owned is not None:
            self._owned.gate(call_descriptor(x, spec, compensator, pow2, site, direction))

    def plain_serves(self, x: torch.Tensor) -> bool:
        """Whether ``plain_all_reduce(x)`` runs on the one-launch call (its flags carry the call's descriptor),
        rather than on torch.distributed.all_reduce."""
        return (self.one_launch is not None and not self.closed and x.device == self.device and x.numel() > 0
                and str(x.dtype).replace("torch.", "") in proto.DESCRIPTOR_DTYPES)

    def plain_all_reduce(self, x: torch.Tensor, *, site: Optional[int] = None,
                         direction: Optional[str] = None) -> torch.Tensor:
        """The sum of ``x`` over the group without quantization: a new tensor of x's shape and dtype.

        The 16-bit baseline of the benchmarks, through the same one-launch protocol (flags, epochs,
        chunks, timeout, the descriptor check): the owner of each segment sums the P copies in fp32 in
        rank order and rounds once to x's dtype (saturated to its largest finite value, nearest even), so
        every rank returns the same bits. Not differentiable. Where the one-launch call cannot run (no
        kernels, a CPU tensor, another device, an unsupported dtype) it is torch.distributed.all_reduce,
        whose summation order is the backend's.
        """
        if not x.is_floating_point():
            raise TypeError(f"plain_all_reduce expects a floating-point tensor, got {x.dtype}")
        if self.closed:
            raise proto.EchoP2PError("echo p2p: plain_all_reduce on a closed EchoBuffer")
        if not self.plain_serves(x):
            y = x.detach().clone()
            dist.all_reduce(y, group=self.group)
            return y
        self.check()
        x = x.detach().contiguous()
        y = torch.empty_like(x)
        descriptor = proto.plain_call_descriptor(numel=x.numel(), dtype=str(x.dtype).replace("torch.", ""), site=site,
                                                 direction=direction)
        self._num_calls += 1
        self.one_launch.plain(x, y, descriptor)
        return y

    # ------------------------------------------------------------------------------------------------
    # The one-launch call
    # ------------------------------------------------------------------------------------------------

    def _one_launch(self, x, plan, compensator):
        """The one-launch call by ``plan``: one crossing into the runtime, which checks the error record, allocates
        y and launches on the current stream, or returns None without launching (_attend)."""
        if not x.is_contiguous():
            x = x.contiguous()
        self._num_calls += 1
        if self._fault is not None and self._fault == (self._num_calls, "exit_after_push"):
            torch.cuda.synchronize(self.device)
            os._exit(17)  # tests: a rank dies in the middle of the group's call (its peers wait for it)
        c = compensator
        y = self.one_launch.call(x, plan, c)
        if y is None:
            y = self._attend(x, plan, c)
        if c is not None:
            c.num_calls += 1  # as Compensator.update does; the kernel updated the state
        return y

    def _attend(self, x, plan, c) -> torch.Tensor:
        """The runtime returned None without launching: a wait of this group failed (check() raises it), the
        kernels counted range events not folded yet (_note_range folds them), or the compensator's state is
        missing or of another shape or device (allocated again, as Compensator does). Then the call again;
        range events of calls still in flight may land in between, hence the bounded loop."""
        for _ in range(1024):
            self._note_range(plan.bits)
            self.check()
            if c is not None:
                c._ensure(plan.state_shape, self.device)  # the device too (the runtime refuses another)
            y = self.one_launch.call(x, plan, c)
            if y is not None:
                return y
        raise proto.EchoP2PError("echo p2p: the one-launch call was refused 1024 times with no failure recorded "
                                 "and no range event left to fold")

    # ------------------------------------------------------------------------------------------------
    # Teardown
    # ------------------------------------------------------------------------------------------------

    def _move_to_reference(self, f: proto.WaitFailure, error: str) -> None:
        """on_fault="reference", at the first failed wait ``f`` (raised as ``error``): every later call of this
        rank takes the reference path, at once and without any collective (a stopped peer would hold it;
        every rank gets here through its own failed wait).

        The peers' mappings and this rank's memory stay until close() or interpreter exit: a peer may still
        map them, and freeing exported memory that a peer maps is undefined (see close)."""
        if f.code == proto.kErrorMismatch:
            failure = f"rank {f.rank} and rank {f.peer} made call {f.call_index} with different arguments"
        else:
            failure = (f"rank {f.rank} of {self.world_size} "
                       f"{'abandoned its wait' if f.code == proto.kErrorAborted else 'timed out waiting'} for rank "
                       f"{f.peer} at stage {proto.WAIT_STAGE_NAMES.get(f.stage, f.stage)}, call {f.call_index}")
        self._on_reference = True
        self.transport.abort()  # every wait of a call still in flight gives up at once
        if self._backend_name is not None:  # the group's Echo calls (the custom op) go to the reference
            collective.drop_backend(self._backend_name, self)
            self._backend_name = None
        # The one-launch fast path tests one_launch first; the runtime itself stays alive for close().
        self.one_launch = None  # close() frees it (_owned)
        if self._owned is not None:
            self._owned.clear()  # its plans, here and in the runtime
        self.active = False
        self.reason = f"a failed wait moved the group to the reference path (on_fault='reference'): {error}: {failure}"
        logger.warning("echo p2p: rank %d of %d: %s; the calls that raised or were not checked yet returned "
                       "undefined results: every rank must resume at the same call, with reset compensators",
                       self.rank, self.world_size, self.reason)

    def close(self, *, abort: bool = False, barrier: bool = True) -> None:
        """Free everything. Idempotent.

        The calls issued so far finish first (bounded: a wait gives up after the timeout, or at once
        with ``abort=True``); then this rank unmaps its peers' memory and, with ``barrier`` (a
        collective over the group: every rank must call close), waits for every rank to have done the
        same before freeing its own, since the driver leaves freeing exported memory that a peer still
        maps undefined. Interpreter exit closes without the barrier (the peers may be gone).
        """
        if self.closed:
            return
        self.closed = True
        _live_buffers.discard(self)
        if self._backend_name is not None:  # the name kept at registration: the group may be gone by now
            collective.drop_backend(self._backend_name, self)
            self._backend_name = None
        t, self.transport = self.transport, None
        if self._pipeline is not None:
            self._pipeline.schedules.clear()
        if t is None:
            return
        try:
            if abort:
                t.abort()
            if t.kind == "cuda":
                for s in self._pipeline.streams.values():
                    s.synchronize()
                torch.cuda.synchronize(self.device)
                self._note_range(transport=t)  # the last calls' range events
        finally:
            t.abort()
            owned, self.one_launch, self._owned = self._owned, None, None
            if owned is not None:
                owned.close()  # the runtime's control block (no call is in flight any more)
            try:
                t.close_peers()
                if barrier and dist.is_initialized():
                    dist.barrier(group=self.group)
            finally:
                t.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(abort=exc[0] is not None, barrier=exc[0] is None)


@atexit.register
def _close_all_at_exit() -> None:
    # At exit the peers may be gone: abort every wait instead of letting it run into its timeout.
    for buf in list(_live_buffers):
        try:
            buf.close(abort=True, barrier=False)
        except Exception:  # noqa: BLE001 - never block or fail interpreter exit
            pass
