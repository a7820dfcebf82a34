"""The reference Echo all-reduce over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

This is the specification: the CUDA path reproduces its numbers bit for bit. One call moves each
non-owned segment once to its owner as b-bit codes (``all_to_all_single``), the owner sums the P copies
in fp32 with its own copy unquantized, quantizes the sum once, and an ``all_gather`` of the codes gives
every rank the same values. Every element is quantized at most twice, for any P. The stages are in
:mod:`echo_ds.algorithm`.

Call agreement. Before any data is combined, the ranks agree on a call descriptor: one all_gather of
``kDescriptorLen`` int64 per rank (:data:`DESCRIPTOR_FIELDS`: element count, dtype, bits, group size,
quantizer, rotation, pow2 rescaling, compensator and its residual, the compensator's state format,
telemetry, the caller's direction and site, and the call number). Every rank sees every descriptor, so a
disagreement raises :class:`EchoCallMismatch` on every rank, naming each field that differs and each rank's
value, and no data has moved: the group stays usable. The call number counts this rank's Echo calls on the
group (1 for the first; :func:`call_count`); it is kept per process group, so calls on different groups do
not interfere.
With pow2 rescaling the descriptor also carries the rank's largest magnitude and replaces the scalar max
all-reduce, so such calls make no extra collective (and a NaN on any rank now gives k = 0 on every rank,
as in the emulator: gloo's MAX dropped a NaN that met a number from a lower rank).
Its cost is one small all_gather per call (the descriptor); pow2 calls make no collective more than before.

Bounded waits. Every collective of a call is issued asynchronously and waited for at most ``timeout_s``
(default: ``ECHO_P2P_TIMEOUT_S`` or the p2p transport's default, :data:`echo_ds.p2p.protocol.kDefaultTimeoutS`),
per stage: a peer that is dead, hung or further behind than that fails the call with
:class:`EchoTimeout`, a connection that gloo sees close with :class:`EchoPeerError`, both naming this
rank, the peer where known, the stage (:data:`STAGES`) and the call. After either, the group is unusable
(the abandoned collective is still pending inside the backend): tear it down.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
import time
import weakref
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from echo_ds import algorithm as A
from echo_ds import collective
from echo_ds import quant as Q
from echo_ds.compensator import Compensator
from echo_ds.config import STATE_DTYPES
from echo_ds.p2p import protocol as _p2p_protocol
from echo_ds.quant import QUANTIZERS, QuantSpec

__all__ = ["echo_all_reduce", "exact_all_reduce", "call_count", "default_timeout", "EchoCallMismatch",
           "EchoPeerError", "EchoTimeout", "DESCRIPTOR_FIELDS", "STAGES", "kDescriptorLen"]

# all_gather_single replaces all_gather_into_tensor in newer torch; both take (output, input, group).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# The same variable the p2p transport reads (echo_ds.p2p.buffer), with the same default.
kTimeoutEnv = "ECHO_P2P_TIMEOUT_S"

STAGES = ("descriptor", "all-to-all", "all-gather", "telemetry")
DIRECTIONS = ("forward", "backward", "eval")  # "eval": a forward that no backward follows

# The descriptor: one int64 per field, in this order, all compared; "magic" marks it as Echo's (version 2:
# version 1 had no state_dtype). One more int64 follows, not compared: the fp32 bits of the rank's largest
# magnitude (pow2 rescaling).
DESCRIPTOR_FIELDS = ("magic", "numel", "dtype", "bits", "group_size", "quantizer", "rotation", "pow2_rescale",
                     "compensator", "state_dtype", "telemetry", "direction", "site", "call")
kDescriptorLen = len(DESCRIPTOR_FIELDS) + 1
kDescriptorMagic = 0x4543484F_0002  # "ECHO", version 2
_kUnset = -1
_DTYPES = tuple(d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                            getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
                            getattr(torch, "float8_e4m3fnuz", None), getattr(torch, "float8_e5m2fnuz", None))
                if d is not None)
_RESIDUALS = ("output", "local")


class EchoCallMismatch(RuntimeError):
    """The ranks of a group called echo_all_reduce with different arguments (raised on every rank).

    fields: {field name: [value on rank 0, value on rank 1, ...]} for every field that differs (values
    as the message prints them). call: this rank's call number.
    """

    def __init__(self, message: str, fields: dict, call: int):
        super().__init__(message)
        self.fields = fields
        self.call = call


class EchoPeerError(RuntimeError):
    """A collective of echo_all_reduce failed: a peer closed its connection (it died) or the backend failed.

    rank, world_size, peer (None where unknown), stage (one of STAGES), call, site, direction.
    """

    def __init__(self, message: str, *, rank: int, world_size: int, peer: Optional[int], stage: str, call: int,
                 site: Optional[int], direction: Optional[str]):
        super().__init__(message)
        self.rank, self.world_size, self.peer, self.stage = rank, world_size, peer, stage
        self.call, self.site, self.direction = call, site, direction


class EchoTimeout(EchoPeerError):
    """A collective of echo_all_reduce did not complete within ``timeout_s``: a peer is dead, hung or behind."""


# Calls so far per process group (None: the default group), on this rank.
_call_counts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def check_differentiable_input(x: torch.Tensor, where: str) -> None:
    """Refuse an input that requires grad while autograd records: the call is not differentiable (its
    output would have no gradient, silently). Training goes through the DeepSpeed mode, whose
    all-reduces are autograd functions with Megatron's semantics (echo_ds.deepspeed.mappings)."""
    if x.requires_grad and torch.is_grad_enabled():
        raise TypeError(f"{where}: the input requires grad, but an Echo call records no autograd graph (the "
                        f"output would silently have no gradient). Train through echo_ds.initialize (its "
                        f"tensor-parallel all-reduces are autograd functions: forward all-reduce, backward "
                        f"identity, as Megatron's), or pass x.detach() / call under torch.no_grad().")


def _group_key(group: Optional[dist.ProcessGroup]):
    return dist.group.WORLD if group is None else group


def call_count(group: Optional[dist.ProcessGroup] = None) -> int:
    """How many echo_all_reduce calls this rank has made on ``group`` (the last call's number)."""
    return _call_counts.get(_group_key(group), 0)


def _next_call(group: Optional[dist.ProcessGroup]) -> int:
    key = _group_key(group)
    n = _call_counts.get(key, 0) + 1
    _call_counts[key] = n
    return n


def default_timeout() -> float:
    """``ECHO_P2P_TIMEOUT_S`` when set, else the p2p transport's default (seconds)."""
    return float(os.environ.get(kTimeoutEnv, _p2p_protocol.kDefaultTimeoutS))


def _context(call, site, direction) -> str:
    """'call 7 (site 3, forward)'; parts that are None are left out."""
    head = "" if call is None else f"call {call}"
    extra = ", ".join(p for p in (None if site is None else f"site {site}", direction) if p is not None)
    if extra:
        head = f"{head} ({extra})" if head else f"({extra})"
    return head


# A gloo collective that Echo's wait abandons at its timeout keeps the group's worker thread until gloo's
# own timeout (the group's, 30 minutes by default), and the process group's destructor joins that thread
# at interpreter exit: a survivor of a stopped peer hung at exit (docs/errors.md; ProcessGroupGloo.abort()
# and shutdown() do not end it, seen with torch 2.13 on the CPU). So Echo's collectives on a gloo group are
# issued with gloo's own timeout at Echo's bound plus this margin, then the group's is put back.
kGlooMarginS = 1.0


@contextlib.contextmanager
def _gloo_op_timeout(group, timeout_s: float):
    """Collectives issued inside run on ``group``'s gloo backend with gloo's timeout timeout_s + kGlooMarginS
    (nothing where the group has no gloo backend, or where timeout_s is infinite)."""
    backend = None
    if not math.isinf(timeout_s):
        try:
            backend = group._get_backend(torch.device("cpu"))
        except (RuntimeError, AttributeError):
            backend = None
    # NOTE: private torch API (present in 2.13); a torch without it keeps the group's timeout (the old hang).
    before = getattr(getattr(backend, "options", None), "_timeout", None)
    if (not isinstance(backend, getattr(dist, "ProcessGroupGloo", ())) or not hasattr(backend, "_set_default_timeout")
            or not isinstance(before, datetime.timedelta)):
        yield
        return
    backend._set_default_timeout(datetime.timedelta(seconds=timeout_s + kGlooMarginS))
    try:
        yield
    finally:
        backend._set_default_timeout(before)


class _Call:
    """What the messages of one call name, and its bounded wait."""

    __slots__ = ("rank", "world_size", "call", "site", "direction", "timeout_s", "group")

    def __init__(self, rank, world_size, call, site, direction, timeout_s, group):
        self.rank, self.world_size, self.call = rank, world_size, call
        self.site, self.direction, self.timeout_s = site, direction, timeout_s
        self.group = group

    def run(self, stage: str, issue: Callable[[], "dist.Work"]) -> None:
        """Issue one collective asynchronously and wait for it, at most timeout_s (on gloo, the collective
        itself ends kGlooMarginS later: _gloo_op_timeout)."""
        start = time.monotonic()
        try:
            with _gloo_op_timeout(self.group, self.timeout_s):
                work = issue()
            if math.isinf(self.timeout_s):
                work.wait()
            elif work.wait(datetime.timedelta(seconds=self.timeout_s)) is False:
                raise RuntimeError("Operation timed out! (wait returned False)")
        except RuntimeError as e:
            raise self._failure(stage, e, time.monotonic() - start) from e

    def _failure(self, stage: str, e: RuntimeError, waited: float) -> EchoPeerError:
        # gloo prefixes its source location ("[.../pair.cc:553] ") and appends advice: keep one sentence.
        detail = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip()).split(". ")[0].rstrip(".")
        peer = 1 - self.rank if self.world_size == 2 else None
        who = "a peer" if peer is None else f"rank {peer}"
        where = f"at stage {stage!r} of echo all-reduce {_context(self.call, self.site, self.direction)}"
        info = dict(rank=self.rank, world_size=self.world_size, peer=peer, stage=stage, call=self.call,
                    site=self.site, direction=self.direction)
        if "timed out" in str(e).lower():
            return EchoTimeout(
                f"echo all-reduce: rank {self.rank} of {self.world_size} timed out after {waited:.2f} s "
                f"(timeout {self.timeout_s:g} s) waiting for {who} {where}: {who} is dead, hung, or more than "
                f"{self.timeout_s:g} s behind; pass timeout_s= or set {kTimeoutEnv} if ranks legitimately "
                f"drift apart that far. The group is unusable now. ({detail})", **info)
        return EchoPeerError(
            f"echo all-reduce: rank {self.rank} of {self.world_size} lost {who} {where} after {waited:.2f} s: "
            f"{detail}. {who[0].upper() + who[1:]} most likely died (see its log); the group is unusable "
            f"now.", **info)


def _descriptor(x: torch.Tensor, spec: QuantSpec, compensator: Optional[Compensator], pow2_rescale,
                direction: Optional[str], site: Optional[int], call: int) -> List[int]:
    if compensator is None:
        comp, state = 0, _kUnset
    else:
        comp = 1 + _RESIDUALS.index(compensator.residual) if compensator.residual in _RESIDUALS else 99
        # The stored format changes the numbers a call returns (the correction reads the stored state), so
        # ranks of one group must hold the same one, as the p2p descriptor's state_dtype field requires.
        state = STATE_DTYPES.index(compensator.state_dtype) if compensator.state_dtype in STATE_DTYPES else 99
    return [kDescriptorMagic, x.numel(), _DTYPES.index(x.dtype) if x.dtype in _DTYPES else 99, spec.bits,
            spec.group_size, QUANTIZERS.index(spec.quantizer), int(spec.rotation), A.pow2_code(pow2_rescale), comp,
            state, int(compensator is not None and bool(compensator.telemetry)),
            _kUnset if direction is None else DIRECTIONS.index(direction), _kUnset if site is None else site, call]


def _show(field: str, v: int) -> str:
    """A descriptor value as the messages print it."""
    def pick(table: Sequence, i: int) -> str:
        return str(table[i]) if 0 <= i < len(table) else f"code {i}"

    if field == "dtype":
        return pick([str(d).replace("torch.", "") for d in _DTYPES], v)
    if field == "quantizer":
        return pick(QUANTIZERS, v)
    if field in ("rotation", "telemetry"):
        return str(bool(v))
    if field == "pow2_rescale":
        return pick([str(m) for m in A.POW2_MODES], v)
    if field == "compensator":
        return "none" if v == 0 else f"residual={pick(_RESIDUALS, v - 1)}"
    if field == "state_dtype":
        return "none" if v == _kUnset else pick(STATE_DTYPES, v)
    if field == "direction":
        return "unset" if v == _kUnset else pick(DIRECTIONS, v)
    if field == "site":
        return "unset" if v == _kUnset else str(v)
    if field == "magic":
        return "echo" if v == kDescriptorMagic else f"{v & 0xFFFFFFFFFFFFFFFF:#x} (not an echo descriptor)"
    return str(v)


def _check_agreement(rows: List[List[int]], call: int) -> None:
    """Raise EchoCallMismatch (the same message on every rank) when the gathered descriptors differ."""
    P = len(rows)
    rows = [row[:len(DESCRIPTOR_FIELDS)] for row in rows]
    differ = [f for i, f in enumerate(DESCRIPTOR_FIELDS) if any(r[i] != rows[0][i] for r in rows[1:])]
    if not differ:
        return
    if "magic" in differ:  # another collective is interleaved: its other "fields" are meaningless
        differ = ["magic"]
    fields = {f: [_show(f, r[DESCRIPTOR_FIELDS.index(f)]) for r in rows] for f in differ}
    agreed = {f: rows[0][DESCRIPTOR_FIELDS.index(f)] for f in ("call", "site", "direction") if f not in differ}
    ctx = _context(agreed.get("call"),
                   None if agreed.get("site", _kUnset) == _kUnset else agreed["site"],
                   None if agreed.get("direction", _kUnset) == _kUnset else DIRECTIONS[agreed["direction"]])
    parts = "; ".join(f"{f}: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(vals))
                      for f, vals in fields.items())
    head = f"echo all-reduce {ctx}" if ctx else "echo all-reduce"
    raise EchoCallMismatch(f"{head}: ranks disagree on {parts} (every rank of the {P} raises this; no data "
                           f"was exchanged)", fields, call)


def _packet(spec: QuantSpec, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """[S, G, c] codes and [S, G] fp16 parameters -> [S, G * quant.group_wire_bytes] bytes on the wire:
    the codes, then the scales, then the zero-points (a packed quantizer: then its 16-bit words)."""
    S = codes.shape[0]
    if spec.quantizer in Q.PACKED_QUANTIZERS:
        params = (Q.pack_params(scale, zero, spec.bits).to(torch.int16).reshape(S, -1).view(torch.uint8),)
    else:
        params = (scale.reshape(S, -1).view(torch.uint8), zero.reshape(S, -1).view(torch.uint8))
    return torch.cat((codes.reshape(S, -1),) + params, dim=1)


def _unpacket(spec: QuantSpec, buf: torch.Tensor, num_groups: int):
    S = buf.shape[0]
    n_codes = num_groups * Q.group_code_bytes(spec.bits, spec.group_size)
    codes = buf[:, :n_codes].reshape(S, num_groups, -1)
    params = buf[:, n_codes:].contiguous()
    if spec.quantizer in Q.PACKED_QUANTIZERS:
        scale, zero = Q.unpack_params(params.view(torch.int16), spec.bits)
        return codes, scale, zero
    return codes, params[:, :2 * num_groups].view(torch.float16), params[:, 2 * num_groups:].view(torch.float16)


def _agree(x: torch.Tensor, spec: QuantSpec, compensator: Optional[Compensator], pow2_rescale,
           amax: Optional[torch.Tensor], call: _Call, group) -> Optional[torch.Tensor]:
    """Stage "descriptor": all-gather every rank's descriptor, check that they agree; with pow2 rescaling
    the group's largest magnitude (fp32, NaN when any rank's is), else None."""
    desc = _descriptor(x, spec, compensator, pow2_rescale, call.direction, call.site, call.call)
    desc.append(0 if amax is None else int(amax.float().reshape(1).cpu().view(torch.int32)))
    mine = torch.tensor(desc, dtype=torch.int64, device=x.device)
    gathered = torch.empty(call.world_size * kDescriptorLen, dtype=torch.int64, device=x.device)
    call.run("descriptor", lambda: _all_gather(gathered, mine, group=group, async_op=True))
    flat = gathered.tolist()
    rows = [flat[r * kDescriptorLen:(r + 1) * kDescriptorLen] for r in range(call.world_size)]
    _check_agreement(rows, call.call)
    if amax is None:
        return None
    # torch's max, as the emulator takes it: a NaN on any rank gives NaN (gloo's MAX drops a NaN that
    # meets a number on an earlier rank, and the ranks' exponent then followed the number).
    return torch.tensor([row[-1] for row in rows], dtype=torch.int32).view(torch.float32).amax()


def echo_all_reduce(x: torch.Tensor, spec: QuantSpec, group: Optional[dist.ProcessGroup] = None,
                    compensator: Optional[Compensator] = None, pow2_rescale="auto", *,
                    direction: Optional[str] = None, site: Optional[int] = None,
                    timeout_s: Optional[float] = None) -> torch.Tensor:
    """The Echo all-reduce of ``x`` over ``group``: a new tensor of ``x``'s shape and dtype.

    x: this rank's contribution, any shape, fp32 / bf16 / fp16 (left untouched).
    spec: bits, group size, quantizer and rotation.
    compensator: when given, its correction is added before quantizing and its state updated with this
        call's residual (the same object must be passed at every site of the pass, in the same order on
        every rank).
    pow2_rescale: True: multiply by a power of two chosen from the group's largest magnitude before
        quantizing and divide after (exact); "auto" (the default): only when that magnitude lies outside
        [2^-6, 2^15), where a fixed fp16 group scale would clip or flush to zero (algorithm.POW2_MODES);
        False: never. Each rank's largest magnitude travels in the descriptor all-gather (no extra
        collective); the compensator stays outside the scaling.
    direction, site: what the caller's call is ("forward", "backward" or "eval": a forward that no backward
        follows; a site index >= 0), for the agreement check and the error messages; None: not checked,
        not named.
    timeout_s: the longest wait of one stage, seconds (default: see ``default_timeout``; inf: unbounded).

    All ranks return bit-identical tensors. Non-finite inputs propagate as NaN over their groups.
    The call goes through the custom op ``torch.ops.echo_ds.all_reduce`` (echo_ds.collective), which runs
    the backend registered for the group, else the reference below; ``torch.compile(fullgraph=True)``
    traces it as one node.
    Raises EchoCallMismatch (on every rank) when the ranks' calls disagree, EchoTimeout / EchoPeerError
    when a peer does not answer in time or dies.
    """
    if not x.is_floating_point():
        raise TypeError(f"echo_all_reduce expects a floating-point tensor, got {x.dtype}")
    check_differentiable_input(x, "echo_all_reduce")
    A.check_pow2_mode(pow2_rescale, "echo_all_reduce")
    if direction is not None and direction not in DIRECTIONS:
        raise ValueError(f"echo_all_reduce: direction={direction!r} must be None or one of {DIRECTIONS}")
    if site is not None and (isinstance(site, bool) or not isinstance(site, int) or site < 0):
        raise ValueError(f"echo_all_reduce: site={site!r} must be None or an int >= 0")
    if timeout_s is not None and not timeout_s > 0:  # also refuses NaN
        raise ValueError(f"echo_all_reduce: timeout_s={timeout_s!r} must be > 0")
    if dist.get_world_size(group) == 1:
        return x.clone()
    return collective.all_reduce(x, spec, group, compensator, pow2_rescale, direction=direction, site=site,
                                 timeout_s=None if timeout_s is None else float(timeout_s))


def _echo_all_reduce(x: torch.Tensor, spec: QuantSpec, group: Optional[dist.ProcessGroup],
                     compensator: Optional[Compensator], pow2_rescale, *, direction: Optional[str],
                     site: Optional[int], timeout_s: Optional[float]) -> torch.Tensor:
    """The reference behind ``torch.ops.echo_ds.all_reduce`` (echo_ds.collective), run eagerly by the
    op: echo_all_reduce's arguments, checked, on a group of more than one rank."""
    if timeout_s is None:
        timeout_s = default_timeout()
        if not timeout_s > 0:
            raise ValueError(f"echo_all_reduce: {kTimeoutEnv}={timeout_s!r} must be > 0")
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    call = _Call(rank, world_size, _next_call(group), site, direction, float(timeout_s),
                 dist.group.WORLD if group is None else group)

    layout = A.Layout(x.numel(), world_size, spec.group_size)
    G = layout.groups_per_segment
    others = [j for j in range(world_size) if j != rank]

    # Entry: rotate, compensate; the descriptor exchange (with the pow2 max); rescale; quantize the
    # segments this rank sends. Only the correction's state allocation precedes the check.
    r = A.rotate_if(A.to_segments(x.reshape(1, -1), layout), spec)[0]  # [P, G, g]
    if compensator is not None:
        r = r + compensator.correction(r.shape, r.device)
    amax = _agree(x, spec, compensator, pow2_rescale, r.abs().amax() if pow2_rescale else None, call, group)
    k = A.pow2_exponent(amax, pow2_rescale) if pow2_rescale else 0
    rs = r * 2.0**k if k else r
    sent = A.quantize_segments(rs[others], spec)

    # All-to-all: segment j to its owner j (nothing to self).
    packet_bytes = G * Q.group_wire_bytes(spec.bits, spec.group_size, spec.quantizer)
    send = _packet(spec, *sent).reshape(-1)
    recv = torch.empty((world_size - 1) * packet_bytes, dtype=torch.uint8, device=x.device)
    splits = [0 if j == rank else packet_bytes for j in range(world_size)]
    call.run("all-to-all", lambda: dist.all_to_all_single(recv, send, output_split_sizes=splits,
                                                          input_split_sizes=splits, group=group, async_op=True))

    # Owner reduce: fp32 sum in rank order, own copy unquantized; requantize once.
    copies = A.dequantize_segments(*_unpacket(spec, recv.view(world_size - 1, -1), G), spec)
    terms = torch.empty((world_size, G, spec.group_size), dtype=torch.float32, device=x.device)
    terms[others] = copies
    terms[rank] = rs[rank]
    acc = A.ordered_sum(terms)
    reduced = A.quantize_segments(acc[None], spec)
    if pow2_rescale is False:  # what this rank quantized: its sent segments and the one it reduced
        A.note_rank_range((rs[others], acc), (sent[1], reduced[1]), (sent[2], reduced[2]), spec, "echo_all_reduce")

    # All-gather of the reduced codes; every rank dequantizes the same codes.
    gathered = torch.empty(world_size * packet_bytes, dtype=torch.uint8, device=x.device)
    mine = _packet(spec, *reduced).reshape(-1)
    call.run("all-gather", lambda: _all_gather(gathered, mine, group=group, async_op=True))
    s_hat_scaled = A.dequantize_segments(*_unpacket(spec, gathered.view(world_size, -1), G), spec)
    s_hat = s_hat_scaled * 2.0**-k if k else s_hat_scaled
    y = A.from_segments(A.unrotate_if(s_hat, spec), layout, x.shape, x.dtype)

    if compensator is not None:
        if compensator.residual == "output":
            u = A.output_residual(r, s_hat, world_size)
        else:
            u = A.local_residual(rs, A.dequantize_segments(*sent, spec), rank, s_hat_scaled[rank], acc,
                                 sent_index=others, down=2.0**-k if k else None)
        if compensator.telemetry:
            exact = r.clone()
            call.run("telemetry", lambda: dist.all_reduce(exact, group=group, async_op=True))
            compensator.record(torch.linalg.vector_norm(s_hat - exact))
        compensator.update(u)
    return y


def exact_all_reduce(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The uncompressed all-reduce of ``x`` (a new tensor), for comparisons and small messages."""
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out
