"""The per-model state of Echo under DeepSpeed: sites, passes, compensator states, counters.

One ``EchoRuntime`` serves one tensor-parallel group of one model. It owns

* the table of *sites*: every tensor-parallel all-reduce that Echo replaced, one ``Site`` per layer
  (per coalesced group on the backward pass), numbered in module order, so every rank numbers them
  the same way;
* two compensator states, one per direction (section 5.4: residuals of the two directions have
  different coordinates and magnitudes, so one pair fed by both would match neither). Each is reset at
  the start of its pass: a forward pass starts when the root module's forward is called, a backward
  pass at the first backward site reached after a forward pass started;
* the site-order checks (``_gated`` on the step's path, ``check_site_order`` on demand);
* the counters (``EchoStats``) and the optional telemetry.

The decisions (which backend, compressed or not, whether to keep outputs for a recompute) are the pure
functions of ``policy.py``; this module only carries them out.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import deepspeed.comm as ds_dist
import torch
import torch.distributed as dist
from deepspeed.module_inject.layers import is_autotp_training_mode

from echo_ds import algorithm as A
from echo_ds.log import log_once, logger
from echo_ds.quant import wire_bytes

from . import policy

FORWARD = "forward"
BACKWARD = "backward"

# Site-order digest: a polynomial hash kept below 2^31 so that it travels exactly in a float64 next to
# the call count (both are compared with one MAX all-reduce of [d, -d, n, -n]).
kDigestModulus = 2**31 - 1
kDigestBase = 1_000_003
# Entries of the per-window trace kept for the error message (the digest covers every call regardless).
kMaxTraceEntries = 65536

def _in_backward() -> bool:
    """True inside the autograd engine, i.e. while a backward pass (or a recompute inside it) runs."""
    return torch._C._current_graph_task_id() != -1


class Site:
    """One tensor-parallel all-reduce that goes through Echo.

    site_id: index in module order (identical on every rank of the group).
    name: the module path of the layer ("model.layers.3.mlp.down_proj").
    direction: FORWARD (row-parallel output) or BACKWARD (column-parallel input gradient).
    checkpoint_modules: modules whose ``gradient_checkpointing`` flag means this site may be recomputed.
    """

    __slots__ = ("site_id", "name", "direction", "group", "world_size", "runtime", "checkpoint_modules", "cache")

    def __init__(self, site_id: int, name: str, direction: str, group, world_size: int, runtime: "EchoRuntime",
                 checkpoint_modules: Tuple[torch.nn.Module, ...] = ()):
        self.site_id = site_id
        self.name = name
        self.direction = direction
        self.group = group
        self.world_size = world_size
        self.runtime = runtime
        self.checkpoint_modules = checkpoint_modules
        self.cache: List[torch.Tensor] = []  # forward outputs kept for an activation-checkpoint recompute

    def checkpointed(self) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) for m in self.checkpoint_modules)

    def __repr__(self) -> str:
        return f"Site({self.site_id}, {self.name!r}, {self.direction})"


@dataclass
class SiteTelemetry:
    """Revealed error of one site: the error delta_k its calls injected (``y - exact``), summed as squares.

    relative_rms: sqrt(sum ||delta||^2 / sum ||y||^2) over the site's calls.
    """

    num_calls: int = 0
    error_sq: float = 0.0
    output_sq: float = 0.0
    max_error_norm: float = 0.0

    @property
    def relative_rms(self) -> float:
        return (self.error_sq / self.output_sq) ** 0.5 if self.output_sq > 0 else 0.0


@dataclass
class EchoStats:
    """Counters a user can read (``runtime.stats``) and log.

    forward_calls / backward_calls: compressed all-reduces at forward / backward sites.
    forward_plain_calls / backward_plain_calls: all-reduces at Echo sites that took the exact path
        (message below ``min_message_bytes``).
    recomputed_calls: forward sites reached again during an activation-checkpointing recompute; they
        replay the kept output (no communication, no state change)...
    recompute_fallbacks: ... or, where no output was kept, take the exact all-reduce.
    coalesced_layers: column-parallel layers whose backward all-reduce joined a sibling's call.
    bytes_sent: bytes of the compressed messages (codes plus fp16 scale and zero per group), summed over
        calls; bytes_16bit: what the same calls would have sent as 16-bit values. Both count the message
        once per call; the all-reduce moves each of them the same number of times.
    plain_bytes: bytes of the exact all-reduces at Echo sites, in their own dtype.
    clipped_calls / underflow_calls: compressed calls of a direction with ``pow2_rescale: false`` whose
        message its group scales could not express (echo_ds.algorithm.RangeEvents: values clipped, or a
        scale below fp16's normal range), as this rank saw them (reference backend); a warning names the
        setting once.
    """

    forward_calls: int = 0
    backward_calls: int = 0
    forward_plain_calls: int = 0
    backward_plain_calls: int = 0
    recomputed_calls: int = 0
    recompute_fallbacks: int = 0
    coalesced_layers: int = 0
    forward_passes: int = 0
    backward_passes: int = 0
    bytes_sent: int = 0
    bytes_16bit: int = 0
    plain_bytes: int = 0
    clipped_calls: int = 0
    underflow_calls: int = 0
    sites: Dict[str, SiteTelemetry] = field(default_factory=dict)

    def summary(self) -> Dict[str, int]:
        """The four numbers of examples/train.py's final JSON line."""
        return {
            "forward_calls": self.forward_calls,
            "backward_calls": self.backward_calls,
            "bytes_sent": self.bytes_sent,
            "bytes_16bit": self.bytes_16bit,
        }

    def as_dict(self) -> Dict[str, object]:
        out = {k: v for k, v in self.__dict__.items() if k != "sites"}
        out["sites"] = {name: {"num_calls": t.num_calls, "relative_rms": t.relative_rms,
                               "max_error_norm": t.max_error_norm} for name, t in self.sites.items()}
        return out


class EchoRuntime:
    """Echo state of one model's tensor-parallel group. Built by ``echo_ds.deepspeed.enable``.

    config: ``echo_ds.config.EchoConfig``.
    group: the tensor-parallel process group (torch.distributed).
    device: where the group's tensors live (the site-order check allocates its 4 scalars there).
    telemetry: record the error every compressed call reveals, per site (costs one
        extra exact all-reduce per call; for diagnosis, not for production runs).
    coalesce: make column-parallel layers that consume the same input share one backward all-reduce.
    site_check_interval: every this many forward passes, read the count of refused exact calls (below)
        without waiting for the device, and raise if any (0: never). The full site-order comparison
        (``check_site_order``, one all-reduce and a host copy) runs only when called.
    recompute_cache: force (True/False) or leave to policy (None) keeping forward outputs for replay.
    monitor: a DeepSpeed ``MonitorMaster`` (TensorBoard/CSV/W&B) to write counters to, or None.
    log_interval: log counters every this many optimizer steps, as read from ``step_fn`` (0: never).
    """

    def __init__(self, config, group, device: torch.device, *, telemetry: bool = False, coalesce: bool = True,
                 site_check_interval: int = 1, recompute_cache: Optional[bool] = None, monitor=None,
                 log_interval: int = 0, step_fn: Optional[Callable[[], int]] = None):
        from echo_ds.compensator import make_compensator
        from echo_ds.config import EchoConfig, check_count, check_flag

        # Arguments first, before any collective call: bool("no") is True, and a negative interval means nothing.
        if not isinstance(config, EchoConfig):
            raise TypeError(f"EchoRuntime: config must be an EchoConfig, got {type(config).__name__}")
        if step_fn is not None and not callable(step_fn):
            raise TypeError(f"EchoRuntime: step_fn={step_fn!r} must be None or a callable")
        self.telemetry = check_flag("EchoRuntime", "telemetry", telemetry)
        self.coalesce = check_flag("EchoRuntime", "coalesce", coalesce)
        self.site_check_interval = check_count("EchoRuntime", "site_check_interval", site_check_interval)
        self.recompute_cache = check_flag("EchoRuntime", "recompute_cache", recompute_cache, optional=True)
        self.log_interval = check_count("EchoRuntime", "log_interval", log_interval)
        self.config = config
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = torch.device(device)
        self.monitor = monitor
        self.step_fn = step_fn

        p2p_status = None
        if config.backend != "reference" and self.device.type == "cuda":
            from echo_ds import ops

            p2p_status = policy.p2p_transport_status(
                self.device.type, self.world_size, ops.unavailable_reason(),
                state_dtypes={d: config.direction(d).state_dtype for d in (FORWARD, BACKWARD)
                              if config.direction(d).compensate}, group_size=config.group_size)
        choice = policy.select_backend(config.backend, self.device.type, self.world_size, p2p_status)
        log_once(choice.level, "echo: " + choice.reason)
        self.backend = choice.name
        self.backend_reason = choice.reason
        self.buffer = None
        if self.backend == "p2p":
            # The group's transport (a collective constructor: every rank of the group gets here). It
            # checks the hosts and peer writes itself and, where they fail, says why once and stays off.
            from echo_ds.p2p import EchoBuffer

            self.buffer = EchoBuffer(group, device=self.device, on_fault=config.on_fault)
            if not self.buffer.active:
                self.backend, self.backend_reason = "reference", self.buffer.reason
                self.buffer.close()
                self.buffer = None

        # One state per direction (section 5.4). With telemetry the compensator records the norm of the
        # error each call reveals (one extra exact all-reduce per call).
        self.forward_state = make_compensator(config.forward, telemetry=self.telemetry)
        self.backward_state = make_compensator(config.backward, telemetry=self.telemetry)
        self.pow2_rescale = {FORWARD: config.forward.pow2_rescale, BACKWARD: config.backward.pow2_rescale}

        self.sites: List[Site] = []
        self.num_forward_sites = 0  # for the early-sites policy
        self.stats = EchoStats()
        self._specs = {}

        self._training_pass = False
        self._forward_index = 0
        self._backward_pending = False
        self._coalesce_slot = None

        self._digest = 0
        self._num_traced = 0
        self._trace: List[Tuple[str, int, int, int]] = []
        self._passes_since_check = 0
        # Calls without a call descriptor carry a code of their site (see _gated): the codes per
        # (site, kind, numel, dtype, bits), built once on the device, and the device-side count of refusals,
        # read at a pass start through a pinned copy (CUDA) that the next read picks up when it is done.
        self._plain_codes: Dict[tuple, torch.Tensor] = {}
        self._plain_refused: Optional[torch.Tensor] = None
        self._refused_read = None  # (pinned copy, event) of the last read still in flight
        self._last_logged_step = None

    def close(self) -> None:
        """Release the group's resources: the p2p buffer (a collective: every rank of the group together)
        and the references to the process group, so that it can be destroyed (echo_ds.deepspeed.teardown).
        Calls through this runtime fail afterwards."""
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
        self.group = None
        for site in self.sites:
            site.group = None
            site.cache.clear()

    # ------------------------------------------------------------------------------------------------
    # Sites
    # ------------------------------------------------------------------------------------------------

    def add_site(self, name: str, direction: str, checkpoint_modules: Tuple[torch.nn.Module, ...] = ()) -> Site:
        site = Site(len(self.sites), name, direction, self.group, self.world_size, self, checkpoint_modules)
        self.sites.append(site)
        if direction == FORWARD:
            self.num_forward_sites += 1
        return site

    def _spec(self, bits: int):
        spec = self._specs.get(bits)
        if spec is None:
            spec = self._specs[bits] = self.config.quant_spec(bits)
        return spec

    # ------------------------------------------------------------------------------------------------
    # Passes
    # ------------------------------------------------------------------------------------------------

    def begin_forward_pass(self, training: bool) -> None:
        """Start of a forward pass of the root module: reset the forward state (and check, log)."""
        if self.site_check_interval > 0:
            self._passes_since_check += 1
            if self._passes_since_check >= self.site_check_interval:
                self._passes_since_check = 0
                self._poll_refused()
        self._training_pass = training and torch.is_grad_enabled()
        if self._training_pass:
            # Outputs kept for the previous pass's recompute are no longer needed. An eval pass in
            # between (no grad) keeps them, so a backward that follows it can still replay.
            for site in self.sites:
                site.cache.clear()
        if self.forward_state is not None:
            self.forward_state.reset()
        self._forward_index = 0
        self._backward_pending = True
        self._coalesce_slot = None
        self.stats.forward_passes += 1
        self._maybe_log()

    def end_forward_pass(self) -> None:
        # Siblings consume a shared input within one forward; drop the reference now.
        self._coalesce_slot = None

    def _begin_backward_pass(self) -> None:
        if self.backward_state is not None:
            self.backward_state.reset()
        self._backward_pending = False
        self.stats.backward_passes += 1

    # ------------------------------------------------------------------------------------------------
    # Backward coalescing
    # ------------------------------------------------------------------------------------------------

    def coalesced(self, x: torch.Tensor, site: Site, wrap: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The wrapped ``x`` for a column-parallel layer: the sibling's wrapper when one already wrapped
        this very tensor in this forward, else ``wrap()`` (which creates the backward site's node).

        One slot suffices: siblings (q, k, v; gate, up) consume their input one after another.
        """
        slot = self._coalesce_slot
        if (self.coalesce and slot is not None and slot[0] is x and slot[1] == x._version
                and slot[2] is site.group):
            self.stats.coalesced_layers += 1
            return slot[3]
        y = wrap()
        if self.coalesce:
            self._coalesce_slot = (x, x._version, site.group, y)
        return y

    # ------------------------------------------------------------------------------------------------
    # The reduction
    # ------------------------------------------------------------------------------------------------

    def reduce(self, x: torch.Tensor, site: Site) -> torch.Tensor:
        """All-reduce ``x`` (this rank's contribution, any shape, fp32/bf16/fp16) at ``site``.

        Returns a new tensor of x's shape and dtype, identical on every rank of the group.
        """
        if site.direction == FORWARD:
            if _in_backward():
                return self._replay(x, site)
            bits = self.config.bits_for_site(self._forward_index, self.num_forward_sites)
            self._forward_index += 1
            compensator, pow2 = self.forward_state, self.pow2_rescale[FORWARD]
        else:
            if self._backward_pending:
                self._begin_backward_pass()
            bits = self.config.bits
            compensator, pow2 = self.backward_state, self.pow2_rescale[BACKWARD]

        numel = x.numel()
        compressed = policy.use_compressed(numel, x.element_size(), bits, self.config.min_message_bytes)
        self._record_visit(site, numel, bits if compressed else 16)

        if compressed:
            events = A.range_events
            before = (events.clipped_calls, events.underflow_calls)
            y = self._echo(x, site, bits, compensator, pow2)
            self.stats.clipped_calls += events.clipped_calls - before[0]
            self.stats.underflow_calls += events.underflow_calls - before[1]
            if site.direction == FORWARD:
                self.stats.forward_calls += 1
            else:
                self.stats.backward_calls += 1
            self.stats.bytes_sent += wire_bytes(numel, bits, self.config.group_size, self.config.quantizer)
            self.stats.bytes_16bit += 2 * numel
            if self.telemetry:
                self._measure(x, y, site, compensator)
        else:
            y = self._plain_checked(x, site)
            if site.direction == FORWARD:
                self.stats.forward_plain_calls += 1
            else:
                self.stats.backward_plain_calls += 1
            self.stats.plain_bytes += numel * x.element_size()

        # NOTE: x.requires_grad, not torch.is_grad_enabled(): this runs inside an autograd Function's
        # forward, where grad mode is always off; the message's own flag says whether the caller had it.
        if site.direction == FORWARD and policy.cache_for_recompute(
                self._training_pass, x.requires_grad, site.checkpointed(), self.recompute_cache):
            # A copy, not a view: the model may modify the output in place after this returns.
            site.cache.append(y.detach().clone())
        return y

    def _echo(self, x: torch.Tensor, site: Site, bits: int, compensator, pow2) -> torch.Tensor:
        # The call's kind, for the ranks' agreement: a forward that no backward will follow (eval, no_grad,
        # inference) is "eval", so a rank evaluating while its peer trains is stopped at the first call.
        kind = site.direction if site.direction == BACKWARD or self._training_pass else "eval"
        # A buffer that a fault moved to the reference path (echo.on_fault "reference") is no longer active:
        # its calls are the reference's, made here so that a mismatch gets the sites' names.
        if self.buffer is not None and self.buffer.active:
            if self._p2p_ungated():  # no descriptor in the staged pipeline's flags: the site's code instead
                x = self._gated(x, site, kind, bits)
            # Asynchronous on the current stream: every read of x is ordered before later work on it.
            return self.buffer.all_reduce(x, self._spec(bits), compensator=compensator, pow2_rescale=pow2,
                                          site=site.site_id, direction=kind)
        from echo_ds.reference import EchoCallMismatch, echo_all_reduce

        try:
            return echo_all_reduce(x, self._spec(bits), group=site.group, compensator=compensator,
                                   pow2_rescale=pow2, direction=kind, site=site.site_id)
        except EchoCallMismatch as e:
            hints = []
            if "site" in e.fields:
                # The descriptor names sites by number; the ranks share the site table, so name them too.
                names = [self.sites[int(v)].name if str(v).isdigit() and int(v) < len(self.sites) else str(v)
                         for v in e.fields["site"]]
                shown = ", ".join(f"rank {r}: {n}" for r, n in enumerate(names))
                hints.append(f"The ranks reached different Echo sites ({shown}): every rank must run the same "
                             f"layers in the same order.")
            if "direction" in e.fields and "eval" in e.fields["direction"]:
                hints.append("Some ranks run a training forward and others a forward without backward (eval "
                             "mode or no_grad): every rank of the tensor-parallel group must run the same pass.")
            if not hints:
                raise
            raise EchoCallMismatch(f"{e} " + " ".join(hints), e.fields, e.call) from None

    def _plain_checked(self, x: torch.Tensor, site: Site) -> torch.Tensor:
        """The exact all-reduce of an Echo site (a message below ``min_message_bytes``), refused when the ranks
        are not at the same call.

        On a p2p buffer whose one-launch call serves x: that family's 16-bit call (EchoBuffer.plain_all_reduce,
        the owner's fp32 sum in rank order, rounded once), whose flags carry the site's descriptor, so that
        ranks at different calls raise EchoP2PMismatch (vLLM serves small messages with such a custom all-reduce
        rather than NCCL; this project has not compared the two).
        Otherwise DeepSpeed's all-reduce behind the device-side site check (``_gated``)."""
        if self.world_size == 1:
            return plain_all_reduce(x, site.group)
        kind = site.direction if site.direction == BACKWARD or self._training_pass else "eval"
        if self.buffer is not None and self.buffer.plain_serves(x):
            return self.buffer.plain_all_reduce(x, site=site.site_id, direction=kind)
        return plain_all_reduce(self._gated(x, site, kind, 16), site.group)

    def _p2p_ungated(self) -> bool:
        """Whether the p2p buffer may run this call with no call descriptor in its flags: only where it has
        no one-launch runtime (the one launch carries the descriptor in its flags, and EchoBuffer puts a
        launch of the same family carrying it in front of every staged call, EchoBuffer._gate_staged)."""
        return not self.buffer.gates_staged

    def _gated(self, x: torch.Tensor, site: Site, kind: str, bits: int) -> torch.Tensor:
        """``x``, or NaN in its place on every rank where the ranks are not at the same call.

        Compressed calls carry the call descriptor (reference: all-gathered before data moves; p2p's one
        launch: in its flags). The others (exact calls, the p2p staged pipeline) carry a 62-bit code of
        (site, kind, numel, dtype, bits), built once per site on the device: one MAX all-reduce of
        [code, -code] (int64) before the data; where the ranks' codes differ (max != min), every rank
        replaces its contribution by NaN, so no value of another site is combined into a finite result,
        and adds one to a device counter that ``begin_forward_pass`` reads without waiting
        (``_poll_refused``). No host synchronisation on the call's path, and nothing that changes from
        pass to pass (a CUDA graph can capture it).
        """
        key = (site.site_id, kind, x.numel(), str(x.dtype), bits)
        code = self._plain_codes.get(key)
        if code is None:
            value = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") >> 2
            code = self._plain_codes[key] = torch.tensor([value, -value], dtype=torch.int64, device=x.device)
        t = code.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=site.group)
        agree = t[0] == -t[1]
        if self._plain_refused is None:
            self._plain_refused = torch.zeros((), dtype=torch.int64, device=x.device)
        self._plain_refused += (~agree).to(torch.int64)
        return torch.where(agree, x, torch.full_like(x, float("nan")))

    def _poll_refused(self) -> None:
        """Raise when a call was refused (``_gated``): on the CPU at once; on a GPU from a
        non-blocking copy to pinned memory, read once its event has completed (a later pass)."""
        count = self._plain_refused
        if count is None:
            return
        if count.device.type == "cpu":
            refused = int(count)
        else:
            refused = 0
            if self._refused_read is not None and self._refused_read[1].query():
                refused = int(self._refused_read[0])
                self._refused_read = None
            if self._refused_read is None:
                host = torch.empty((), dtype=torch.int64, pin_memory=True)
                host.copy_(count, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._refused_read = (host, event)
        if refused:
            self._plain_refused.zero_()
            cause = (f"{refused} exact or staged all-reduce(s) at Echo sites were refused: the ranks were at "
                     f"different sites, directions or message sizes (their outputs are NaN; no values of different "
                     f"sites were combined)")
            if count.device.type == "cpu":  # every rank reads the same count at the same pass: compare traces
                self._raise_site_mismatch(cause)
            # A GPU rank reads it when its copy is done, not with its peers: no collective here.
            raise RuntimeError(f"echo: tensor-parallel ranks visited different Echo sites: {cause}. Every rank of a "
                               f"tensor-parallel group must run the same layers in the same order with the same "
                               f"shapes; runtime.check_site_order() on every rank names the first difference.")

    def _replay(self, x: torch.Tensor, site: Site) -> torch.Tensor:
        """A forward site reached again inside backward: an activation-checkpointing recompute.

        It must reproduce the original forward without advancing or touching the forward state (which
        was reset or belongs to another pass by now), so it returns the output kept for it.
        """
        self.stats.recomputed_calls += 1
        if site.cache:
            y = site.cache.pop()  # LIFO: the backward recomputes the last use of a layer first
            if y.shape != x.shape or y.dtype != x.dtype:
                raise RuntimeError(
                    f"echo: the recompute of {site.name} produced a {tuple(x.shape)} {x.dtype} message but the "
                    f"forward kept a {tuple(y.shape)} {y.dtype} one: forward passes of this model overlap in a "
                    f"way the replay cannot pair (run each backward before the next training forward)")
            return y
        self.stats.recompute_fallbacks += 1
        log_once("warning",
                 f"echo: forward sites are recomputed (activation checkpointing) without a kept output (the "
                 f"first: {site.name}), so they take the exact all-reduce and the recomputed activations differ "
                 f"from the original forward by the Echo error. Pass recompute_cache=True to "
                 f"echo_ds.deepspeed.enable(...) when the checkpointing is not visible to Echo (it sees Hugging "
                 f"Face gradient_checkpointing and reentrant checkpoints).", key="recompute_fallback")
        return plain_all_reduce(x, site.group)

    def _measure(self, x: torch.Tensor, y: torch.Tensor, site: Site, compensator) -> None:
        """Telemetry: the norm of the error this call injected, attributed to its site.

        With a compensator, that is the error the call revealed (the compensator measured it against an
        exact all-reduce of the compensated contribution); without one, the output's deviation from the
        exact all-reduce of ``x``, which is then the same quantity.
        """
        if compensator is not None and compensator.revealed_error_norms:
            error_norm = compensator.revealed_error_norms.pop()
        else:
            error_norm = float(torch.linalg.vector_norm(y.float() - plain_all_reduce(x, site.group).float()))
        t = self.stats.sites.setdefault(f"{site.direction}/{site.name}", SiteTelemetry())
        t.num_calls += 1
        t.error_sq += error_norm**2
        t.output_sq += float(y.float().square().sum())
        t.max_error_norm = max(t.max_error_norm, error_norm)

    # ------------------------------------------------------------------------------------------------
    # Site order
    # ------------------------------------------------------------------------------------------------

    def _record_visit(self, site: Site, numel: int, bits: int) -> None:
        code = ((site.site_id * 2 + (site.direction == BACKWARD)) * 64 + bits) * 1_000_033 + numel
        self._digest = (self._digest * kDigestBase + code) % kDigestModulus
        self._num_traced += 1
        if len(self._trace) < kMaxTraceEntries:
            self._trace.append((site.direction, site.site_id, numel, bits))

    def check_site_order(self) -> None:
        """Verify that every rank visited the same sites, in the same order, with the same message sizes
        and bit widths, since the last check. Raises RuntimeError naming the first difference.

        Design: each rank folds every visit (direction, site id, numel, bits) into a running polynomial
        digest; this compares the digests (and the visit counts) with one MAX all-reduce of four float64
        scalars ``[d, -d, n, -n]``: all ranks agree iff max(d) == -max(-d), i.e. max == min. Only on a
        mismatch are the traces all-gathered, to say where the ranks parted. It waits for the device (a host
        copy), so it runs only when called (examples/train.py: once, at the end). On the step's path every
        call carries its own check instead, before data moves: compressed calls the call descriptor
        (reference: all-gathered; p2p's one launch: in its flags), exact calls and the p2p staged pipeline
        a code of their site (``_gated``), refused on device; ``begin_forward_pass`` reads the refusals
        without waiting (``_poll_refused``).
        """
        self._passes_since_check = 0
        if self.world_size == 1:
            return
        t = torch.tensor([self._digest, -self._digest, self._num_traced, -self._num_traced],
                         dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        d_max, d_neg_min, n_max, n_neg_min = t.tolist()
        agree = d_max == -d_neg_min and n_max == -n_neg_min
        if not agree:
            self._raise_site_mismatch()
        self._digest = 0
        self._num_traced = 0
        self._trace = []

    def _raise_site_mismatch(self, cause: Optional[str] = None) -> None:
        traces = [None] * self.world_size
        dist.all_gather_object(traces, (self._num_traced, self._trace), group=self.group)
        names = {s.site_id: s.name for s in self.sites}

        def describe(entry):
            if entry is None:
                return "no site (its sequence had ended)"
            direction, site_id, numel, bits = entry
            how = f"{bits}-bit" if bits < 16 else "exact"
            return f"{names.get(site_id, site_id)} ({direction}, {numel} elements, {how})"

        counts = [n for n, _ in traces]
        seqs = [tr for _, tr in traces]
        detail = "the traces kept agree but the full sequences do not (the difference lies beyond " \
                 f"{kMaxTraceEntries} calls)"
        for i in range(max(len(s) for s in seqs)):
            entries = [s[i] if i < len(s) else None for s in seqs]
            if any(e != entries[0] for e in entries):
                detail = f"at call {i} of the window, " + "; ".join(
                    f"rank {r} visited {describe(e)}" for r, e in enumerate(entries))
                break
        raise RuntimeError(
            f"echo: tensor-parallel ranks visited different Echo sites ({detail}; calls per rank: {counts}). "
            + (f"{cause}. " if cause else "") +
            "Every rank of a tensor-parallel group must run the same layers in the same order with the "
            "same shapes; check for rank-dependent control flow, different batch shapes across ranks, or "
            "layers skipped on some ranks.")

    # ------------------------------------------------------------------------------------------------
    # Logging
    # ------------------------------------------------------------------------------------------------

    def events(self, step: int) -> List[Tuple[str, float, int]]:
        """Counters as DeepSpeed monitor events ``(name, value, step)``."""
        s = self.stats
        ev = [("Echo/forward_calls", s.forward_calls, step), ("Echo/backward_calls", s.backward_calls, step),
              ("Echo/bytes_sent", s.bytes_sent, step), ("Echo/bytes_16bit", s.bytes_16bit, step)]
        if s.bytes_16bit:
            ev.append(("Echo/bytes_ratio", s.bytes_sent / s.bytes_16bit, step))
        for name, t in s.sites.items():
            ev.append((f"Echo/relative_rms_error/{name}", t.relative_rms, step))
        return ev

    def log(self, step: int = 0) -> None:
        """Write the counters to the DeepSpeed monitor (if enabled) and one line to the console (rank 0)."""
        if self.monitor is not None and getattr(self.monitor, "enabled", False):
            self.monitor.write_events(self.events(step))
        if dist.get_rank() != 0:
            return
        s = self.stats
        ratio = f"{s.bytes_sent / s.bytes_16bit:.3f}" if s.bytes_16bit else "n/a"
        line = (f"echo step {step}: forward_calls={s.forward_calls} backward_calls={s.backward_calls} "
                f"plain_calls={s.forward_plain_calls + s.backward_plain_calls} recomputed={s.recomputed_calls} "
                f"bytes_sent/bytes_16bit={ratio}")
        if s.sites:
            worst = max(s.sites.items(), key=lambda kv: kv[1].relative_rms)
            line += f" worst_site={worst[0]} relative_rms_error={worst[1].relative_rms:.2e}"
        logger.info(line)

    def _maybe_log(self) -> None:
        if self.log_interval <= 0 or self.step_fn is None:
            return
        step = self.step_fn()
        if step > 0 and step % self.log_interval == 0 and step != self._last_logged_step:
            self._last_logged_step = step
            self.log(step)


def plain_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The uncompressed all-reduce DeepSpeed would have run, into a new tensor (x untouched)."""
    y = x.contiguous().clone()
    if ds_dist.is_initialized():
        if is_autotp_training_mode():
            ds_dist.all_reduce(y, group=group)
        else:
            ds_dist.inference_all_reduce(y, group=group)
    else:
        dist.all_reduce(y, group=group)
    return y
