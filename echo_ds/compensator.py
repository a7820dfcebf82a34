"""Two-timescale error-feedback compensator (section 5.1, equations 10-11, algorithm 1).

At every call each rank i forms a correction from its two moving averages and adds it to its
contribution before the collective quantizes it::

    c   = gain * (blend * m1 + (1 - blend) * m2)          eta, a
    x'  = x + c

and afterwards refreshes the averages from a residual u::

    m1 = slow_decay * m1 + (1 - slow_decay) * u           beta1
    m2 = fast_decay * m2 + (1 - fast_decay) * u           beta2

Two residuals (``residual``):

``"output"``  u_i = x'_i - y / P, the paper's choice. Summed over the ranks it is -delta, the error the
    call injected. Each rank's u_i also holds its deviation from the mean contribution, (x'_i - sum/P),
    which is not an error at all; on a sequence of similar calls that part accumulates in the per-rank
    state without bound (it cancels only in the sum over ranks).
``"local"``   u_i = -e_i, the rounding error rank i itself added: the quantization errors of the
    segments it sent and the requantization error of the segment it owns. It sums to -delta as well,
    and each rank's state stays at the size of one rounding error (Theorem 1's bound holds per rank).

Both are computed by :func:`echo_ds.algorithm.output_residual` and :func:`echo_ds.algorithm.local_residual`.

With the Hadamard rotation on, the state lives in the rotated domain (the rotation is orthonormal and
linear, so the feedback is the same in either domain and no inverse rotation of the errors is needed).

The arithmetic order above is part of the numerics contract that the CUDA kernels reproduce: fp32, one
rounding per operation, no fused multiply-add; the coefficients are rounded to fp32 once, here.

Storage (``state_dtype``, one per direction; the default is ``"int4"``, below, and ``"bf16"`` stays
selectable). ``"bf16"``: m1 and m2 are *stored* as bfloat16 (``kStateDtype``) and computed with in fp32: a
stored value enters the arithmetic exactly (bf16 -> fp32 is exact), and each updated average is rounded
once, to nearest even, when it is stored (:func:`store_state`). A value that is not finite after that
rounding (a NaN or infinity carried by this call's residual, or a finite fp32 beyond bf16's range) is
stored as +0: a non-finite call poisons its own output, never the state that later calls read. Why bf16
(numbers in docs/kernels.md, "Compensator state dtype"): the state is an estimate of a rounding error, so
its own 2^-9 relative rounding is far below what it estimates (SmolLM2-135M at P = 4, 4-bit default, one
run: all-reduce error 0.09022 against 0.09016 with an fp32 state, perplexity within the noise band), and
bf16 has fp32's exponent range, so neither tiny gradients nor large activations leave it. With the update
fused into the passes that hold the residual, a call reads the state once and writes it once: 8 bytes per
element.

``"int8"`` and ``"int4"`` (:func:`encode_state`): m1 and m2 as b-bit signed integers q1, q2 in
[-(2^(b-1) - 1), 2^(b-1) - 1] and one exponent E per group of the collective (the state's last axis, g
elements), shared by both averages; the stored values are q * 2^E, exact in fp32. At every update the fp32
averages n1, n2 of a group are formed as above (non-finite -> +0), then

    a = max over the group of |n1| and |n2|
    e = the exponent of a's fp32 bits minus 126 (a = f 2^e, f in [0.5, 1); -126 for zero and subnormals)
    E = clamp(e - (b - 1), -126, 126)          (int8 per group)
    q = clamp(round_half_even(n * 2^-E), -(2^(b-1) - 1), 2^(b-1) - 1)

so the group's largest value lands in [2^(b-2), 2^(b-1)) steps: the step is 2^-(b-1) to 2^-(b-2) of the
group's largest value, every multiplication by 2^+-E is exact, and a value past the largest code
saturates (only the group's largest one can, by less than a step). The state stays bounded: a stored
value exceeds the largest unrounded one by at most half a step. Zero and subnormal groups store E = -126,
so equal states have equal bytes. The rounding is
per group, as the quantizer's, so the kernels can form a and E with the same lane reduction.

The tensors held (``Compensator.state_names``) are the bytes the kernels hold, so a transport hands them
over without conversion: "bf16" m1 and m2 (bf16); "int8" m1 and m2 (int8 codes) and ``exponent`` (int8
per group); "int4" ``q`` (uint8, one byte per element: q1 in the low nibble, q2 in the high,
:func:`pack_int4` / :func:`unpack_int4`; a nibble is never -8) and ``exponent``. Bytes per element stored
(:func:`state_bytes_per_element`): "int8" 2 + 1/g, "int4" 1 + 1/g, against 4 for "bf16"; a call moves
twice that. Measured in docs/kernels.md, "Compensator state dtype" (benchmarks/state_narrow_study.py).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from echo_ds.config import STATE_DTYPES, DirectionConfig
from echo_ds.quant import f32

# The stored format of m1 and m2 under state_dtype "bf16" (see "Storage" above); the kernels hold it as
# 16-bit patterns.
kStateDtype = torch.bfloat16
# Bits per value of the integer formats.
kStateBits = {"int8": 8, "int4": 4}
# The tensors each format holds, in order (Compensator attributes, state_dict keys, the custom op's state
# list), and their dtypes; every one has the state's shape except the exponents (one per group: its last
# axis dropped).
kStateTensorDtypes = {"bf16": {"m1": kStateDtype, "m2": kStateDtype},
                      "int8": {"m1": torch.int8, "m2": torch.int8, "exponent": torch.int8},
                      "int4": {"q": torch.uint8, "exponent": torch.int8}}
kStateNames = {state_dtype: tuple(dtypes) for state_dtype, dtypes in kStateTensorDtypes.items()}
# The exponent range of the integer formats: every 2^E and 2^-E is a normal fp32 (exact products).
kMinStateExp, kMaxStateExp = -126, 126


def store_state(v: torch.Tensor) -> torch.Tensor:
    """fp32 ``v`` as it is stored: bf16, rounded to nearest even; non-finite after rounding -> +0."""
    s = v.to(kStateDtype)
    return torch.where(torch.isfinite(s), s, torch.zeros((), dtype=kStateDtype, device=s.device))


def state_bytes_per_element(state_dtype: str, group_size: int) -> float:
    """Bytes of state (m1, m2 and exponents) stored per element; a call reads and writes them once each."""
    if state_dtype == "bf16":
        return 2 * kStateDtype.itemsize
    if state_dtype not in kStateBits:
        raise ValueError(f"state_dtype={state_dtype!r} must be one of {STATE_DTYPES}")
    return 2 * kStateBits[state_dtype] / 8 + 1 / group_size


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^E as fp32 for int E in [-126, 127], built from its bits (exact; the kernels' exp2_int)."""
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def encode_state(n1: torch.Tensor, n2: torch.Tensor, bits: int):
    """fp32 averages [..., g] (finite) -> (q1, q2 int8 [..., g], E int8 [...]) as "Storage" defines."""
    qmax = 2 ** (bits - 1) - 1
    a = torch.maximum(n1.abs().amax(-1), n2.abs().amax(-1))
    e = ((a.view(torch.int32) >> 23) & 0xFF) - 126  # a = f 2^e, f in [0.5, 1); -126 for 0 and subnormals
    exponent = (e - (bits - 1)).clamp(kMinStateExp, kMaxStateExp)
    down = _pow2(-exponent).unsqueeze(-1)
    q = [torch.round(n * down).clamp(-qmax, qmax).to(torch.int8) for n in (n1, n2)]
    return q[0], q[1], exponent.to(torch.int8)


def decode_state(q: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """The stored values q * 2^E, fp32 [..., g] (exact)."""
    return q.float() * _pow2(exponent).unsqueeze(-1)


def pack_int4(q1: torch.Tensor, q2: torch.Tensor) -> torch.Tensor:
    """Codes q1, q2 (int8 in [-7, 7]) -> the "int4" state's bytes: q1 in the low nibble, q2 in the high (uint8)."""
    return ((q1.to(torch.int32) & 0xF) | ((q2.to(torch.int32) & 0xF) << 4)).to(torch.uint8)


def unpack_int4(q: torch.Tensor):
    """The "int4" state's bytes (uint8) -> (q1, q2): its low and high nibbles, sign-extended to int8."""
    b = q.to(torch.int32)
    nibbles = (b & 0xF, b >> 4)
    return tuple((n - ((n & 0x8) << 1)).to(torch.int8) for n in nibbles)  # two's complement: 8..15 -> -8..-1


class Compensator:
    """The (m1, m2) state of one pass direction on one rank (or on P emulated ranks).

    The state has the shape of the collective's padded segments (``batch_shape + (P, G, g)``,
    ``batch_shape = (P,)`` in the emulator) and is held as the tensors named by :attr:`state_names`
    (module docstring, "Storage"): under ``state_dtype`` "bf16" ``m1`` and ``m2``, ``kStateDtype`` of that
    shape; under "int8" ``m1`` and ``m2``, int8 codes of that shape; under "int4" ``q``, uint8 of that
    shape (both codes of an element in one byte, :func:`pack_int4`), with ``m1`` and ``m2`` None; under
    either integer format ``exponent``, int8 of shape ``batch_shape + (P, G)``, the groups' steps.
    :meth:`values` decodes. The state is allocated as zeros at the first call after :meth:`reset`, and
    re-allocated (a warning-free reset) when a call's length differs from the state's: an error estimate
    of another shape cannot be fed back.
    """

    def __init__(self, cfg: DirectionConfig, telemetry: bool = False):
        if not cfg.compensate:
            raise ValueError("Compensator built from a direction with compensate=false")
        self.cfg = cfg
        self.gain = f32(cfg.gain)
        self.blend = f32(cfg.blend)
        self.one_minus_blend = f32(1.0 - cfg.blend)
        self.slow_decay = f32(cfg.slow_decay)
        self.one_minus_slow = f32(1.0 - cfg.slow_decay)
        self.fast_decay = f32(cfg.fast_decay)
        self.one_minus_fast = f32(1.0 - cfg.fast_decay)
        self.residual = cfg.residual
        self.state_dtype = cfg.state_dtype
        self.telemetry = telemetry
        self.m1: Optional[torch.Tensor] = None  # "bf16" / "int8"
        self.m2: Optional[torch.Tensor] = None  # "bf16" / "int8"
        self.q: Optional[torch.Tensor] = None  # "int4"
        self.exponent: Optional[torch.Tensor] = None  # "int8" / "int4"
        self.num_calls = 0  # calls since the last reset
        self.num_resizes = 0
        self.revealed_error_norms: List[float] = []

    @property
    def kernel_key(self) -> tuple:
        """What a kernel's plan of calls with this compensator fixes (echo_ds.p2p.EchoBuffer keys its plans by it):
        residual, telemetry, state_dtype, then the seven coefficients in the kernels' order."""
        return (self.residual, self.telemetry, self.state_dtype, self.gain, self.blend, self.one_minus_blend,
                self.slow_decay, self.one_minus_slow, self.fast_decay, self.one_minus_fast)

    @property
    def state_names(self) -> tuple:
        """The attributes holding the state under this ``state_dtype``, in the custom op's order."""
        return kStateNames[self.state_dtype]

    def _held(self) -> Optional[torch.Tensor]:
        """The first state tensor (it has the state's shape), or None before the first call."""
        return getattr(self, self.state_names[0])

    def reset(self) -> None:
        """Start a new pass: the averages restart from zero."""
        for name in self.state_names:
            setattr(self, name, None)
        self.num_calls = 0

    def _ensure(self, shape, device) -> None:
        held = self._held()
        if held is None or held.shape != shape or held.device != torch.device(device):
            if held is not None:
                self.num_resizes += 1
            for name, dtype in kStateTensorDtypes[self.state_dtype].items():
                if name == "exponent":
                    setattr(self, name, torch.full(tuple(shape)[:-1], kMinStateExp, dtype=dtype, device=device))
                else:  # zero codes (both nibbles of a zero byte too)
                    setattr(self, name, torch.zeros(shape, dtype=dtype, device=device))

    def values(self):
        """(m1, m2) as the arithmetic reads them: fp32, exact (bf16 widened, or integers times 2^E)."""
        if self.state_dtype == "bf16":
            return self.m1.float(), self.m2.float()
        q1, q2 = unpack_int4(self.q) if self.state_dtype == "int4" else (self.m1, self.m2)
        return decode_state(q1, self.exponent), decode_state(q2, self.exponent)

    def correction(self, shape, device) -> torch.Tensor:
        """c = gain * (blend * m1 + (1 - blend) * m2), fp32 of ``shape``."""
        self._ensure(tuple(shape), device)
        m1, m2 = self.values()
        t1 = m1 * self.blend
        t2 = m2 * self.one_minus_blend
        return (t1 + t2) * self.gain

    def update(self, u: torch.Tensor) -> None:
        """Fold the residual ``u`` (fp32, the state's shape) into both averages, in place.

        m = store((m * decay) + (u * (1 - decay))): fp32 arithmetic, one rounding when stored (bf16:
        :func:`store_state`; "int8" / "int4": non-finite -> +0, then :func:`encode_state` per group).
        """
        held = self._held()
        if held is None or u.shape != held.shape:
            raise RuntimeError(f"Compensator.update: residual of shape {tuple(u.shape)} without a matching "
                               f"correction (state {None if held is None else tuple(held.shape)})")
        u = u.detach()
        m1, m2 = self.values()
        n1 = m1 * self.slow_decay + u * self.one_minus_slow
        n2 = m2 * self.fast_decay + u * self.one_minus_fast
        if self.state_dtype == "bf16":
            self.m1.copy_(store_state(n1))
            self.m2.copy_(store_state(n2))
        else:
            finite = (lambda n: torch.where(torch.isfinite(n), n, torch.zeros((), device=n.device)))
            q1, q2, exponent = encode_state(finite(n1), finite(n2), kStateBits[self.state_dtype])
            if self.state_dtype == "int4":
                self.q.copy_(pack_int4(q1, q2))
            else:
                self.m1.copy_(q1)
                self.m2.copy_(q2)
            self.exponent.copy_(exponent)
        self.num_calls += 1

    def record(self, revealed_error_norm: float) -> None:
        self.revealed_error_norms.append(float(revealed_error_norm))

    def state_dict(self) -> dict:
        """A copy of the state: the tensors of :attr:`state_names` (each a tensor, or all None before the
        first call) and num_calls."""
        sd = {}
        for name in self.state_names:
            t = getattr(self, name)
            sd[name] = None if t is None else t.detach().clone()
        sd["num_calls"] = self.num_calls
        return sd

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (copied in; validated: keys, dtypes, shapes, devices,
        codes and exponents in range)."""
        names = self.state_names
        keys = names + ("num_calls",)
        missing = set(keys) - set(state)
        unknown = set(state) - set(keys)
        if missing or unknown:
            raise ValueError(f"Compensator.load_state_dict: missing keys {sorted(missing)}, "
                             f"unknown keys {sorted(unknown)} (expected {', '.join(keys)} for state_dtype "
                             f"{self.state_dtype!r})")
        num_calls = state["num_calls"]
        if not isinstance(num_calls, int) or isinstance(num_calls, bool) or num_calls < 0:
            raise ValueError(f"Compensator.load_state_dict: num_calls={num_calls!r} must be an int >= 0")
        tensors = {name: state[name] for name in names}
        num_none = sum(t is None for t in tensors.values())
        if 0 < num_none < len(names):
            listed = f"{', '.join(names[:-1])} and {names[-1]}"
            both = "both" if len(names) == 2 else "all"
            raise ValueError(f"Compensator.load_state_dict: {listed} must {both} be tensors or {both} None")
        if num_none == 0:
            self._check_tensors(tensors)
            tensors = {name: t.detach().clone() for name, t in tensors.items()}
        for name, t in tensors.items():
            setattr(self, name, t)
        self.num_calls = num_calls

    def _check_tensors(self, tensors: dict) -> None:
        """load_state_dict's checks of the state tensors (all present): dtypes, shapes, devices, ranges."""
        for name, dtype in kStateTensorDtypes[self.state_dtype].items():
            t = tensors[name]
            if not isinstance(t, torch.Tensor) or t.dtype != dtype:
                raise ValueError(f"Compensator.load_state_dict: {name} must be a {dtype} tensor, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)}")
        first = self.state_names[0]
        lead = tensors[first]
        m2 = tensors.get("m2")
        if m2 is not None and (m2.shape != lead.shape or m2.device != lead.device):
            raise ValueError(f"Compensator.load_state_dict: m1 {tuple(lead.shape)} on {lead.device} and m2 "
                             f"{tuple(m2.shape)} on {m2.device} must match")
        if self.state_dtype == "bf16":
            return
        exponent = tensors["exponent"]
        if exponent.shape != lead.shape[:-1] or exponent.device != lead.device:
            raise ValueError(f"Compensator.load_state_dict: exponent {tuple(exponent.shape)} on {exponent.device} "
                             f"must have {first}'s shape without its last axis, {tuple(lead.shape[:-1])}, on "
                             f"{lead.device}")
        qmax = 2 ** (kStateBits[self.state_dtype] - 1) - 1
        codes = unpack_int4(tensors["q"]) if self.state_dtype == "int4" else (tensors["m1"], tensors["m2"])
        in_range = (lambda t, lo, hi: bool(((t >= lo) & (t <= hi)).all()))
        if not all(in_range(c, -qmax, qmax) for c in codes) or \
                not in_range(exponent, kMinStateExp, kMaxStateExp):
            where = " (both nibbles of q; a nibble of -8 is no code)" if self.state_dtype == "int4" else ""
            raise ValueError(f"Compensator.load_state_dict: codes must lie in [-{qmax}, {qmax}]{where} and "
                             f"exponents in [{kMinStateExp}, {kMaxStateExp}] for {self.state_dtype!r}")


def make_compensator(cfg: DirectionConfig, telemetry: bool = False) -> Optional[Compensator]:
    """A compensator for ``cfg``, or None where the direction does not compensate."""
    return Compensator(cfg, telemetry) if cfg.compensate else None
