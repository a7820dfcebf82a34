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

With the Hadamard rotation on, the state lives in the rotated domain (the rotation is orthonormal and
linear, so the feedback is the same in either domain and no inverse rotation of the errors is needed).

The arithmetic order above is part of the numerics contract that the CUDA kernels reproduce: fp32, one
rounding per operation, no fused multiply-add; the coefficients are rounded to fp32 once, here.

Storage. m1 and m2 are computed with in fp32 and *stored* in 8 bits: per group of g elements (the
collective's own groups, the last dimension of the state) an fp32 scale s and one signed code q in
[-127, 127] per element, the value being q * s (one fp32 product). :func:`store_state` is the one place
that rounds, once per update:

    v   = v if finite else 0                 a non-finite residual poisons its call, not the state
    a   = max |v| over the group
    s   = a * fp32(1/127)                    0 where s < kStateMinScale (2^-120: below, the state is 0)
    q   = clip(rint(v * (1 / s)), -127, 127)     (rint: to nearest even; 1 / s one fp32 division)

Why 8-bit codes (numbers in docs/kernels.md, "Compensator state"): the state is an estimate of a rounding
error, and its own rounding (at most s / 2, a / 254 of the group's largest value) is far below what it
estimates: on SmolLM2-135M at P = 4 the all-reduce error and perplexity with 8-bit state match the fp32
state's within the noise. The fp32 scale keeps fp32's range, so neither tiny gradients (the backward
state is in gradient units) nor large activations leave it. Bytes: with the update fused into the pass
that holds the residual, a call reads the state once and writes it once, about 4 bytes per element
(two averages of 1 byte plus 4 bytes per group of 128, each way), against about 32 for the fp32 state
with a separate update pass and 8 for bf16.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch

from echo_ds.config import DirectionConfig
from echo_ds.quant import f32

# The stored format (see "Storage" above): codes of kStateCodeDtype, one fp32 scale per group.
kStateCodeDtype = torch.int8
kStateCodeMax = 127
kStateInvCodeMax = f32(1.0 / 127)
kStateMinScale = 2.0**-120  # exact in fp32; 1 / s stays finite


class StoredAverage(NamedTuple):
    """One moving average as stored: ``codes`` int8 [..., g] and ``scale`` float32 [...] (per group)."""

    codes: torch.Tensor
    scale: torch.Tensor

    def value(self) -> torch.Tensor:
        """The fp32 values q * s, of the codes' shape."""
        return self.codes.float() * self.scale.unsqueeze(-1)

    def clone(self) -> "StoredAverage":
        return StoredAverage(self.codes.detach().clone(), self.scale.detach().clone())

    def copy_(self, other: "StoredAverage") -> None:
        self.codes.copy_(other.codes)
        self.scale.copy_(other.scale)

    def equal(self, other: "StoredAverage") -> bool:
        """Bitwise equality of codes and scales."""
        return (torch.equal(self.codes, other.codes)
                and torch.equal(self.scale.view(torch.int32), other.scale.view(torch.int32)))


def store_state(v: torch.Tensor) -> StoredAverage:
    """fp32 ``v`` [..., g] as it is stored (see "Storage" above)."""
    v = torch.where(torch.isfinite(v), v, torch.zeros((), dtype=v.dtype, device=v.device))
    scale = v.abs().amax(dim=-1) * kStateInvCodeMax
    tiny = ~(scale >= kStateMinScale)
    scale = torch.where(tiny, torch.zeros_like(scale), scale)
    inv = torch.where(tiny, torch.zeros_like(scale), torch.reciprocal(torch.where(tiny, torch.ones_like(scale), scale)))
    codes = torch.round(v * inv.unsqueeze(-1)).clamp_(-kStateCodeMax, kStateCodeMax).to(kStateCodeDtype)
    return StoredAverage(codes, scale)


def zero_state(shape, device) -> StoredAverage:
    return StoredAverage(torch.zeros(shape, dtype=kStateCodeDtype, device=device),
                         torch.zeros(tuple(shape)[:-1], dtype=torch.float32, device=device))


class Compensator:
    """The (m1, m2) state of one pass direction on one rank (or on P emulated ranks).

    Each average is a :class:`StoredAverage` of the collective's padded layout: codes of shape
    ``batch_shape + (..., g)`` with the group last (``[P, G, g]`` on one rank, ``[P, P, G, g]`` in the
    emulator) and one scale per group. It is allocated as zeros at the first call after :meth:`reset`,
    and re-allocated (a warning-free reset) when a call's shape differs from the state's: an error
    estimate of another shape cannot be fed back.
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
        self.telemetry = telemetry
        self.m1: Optional[StoredAverage] = None
        self.m2: Optional[StoredAverage] = None
        self.num_calls = 0  # calls since the last reset
        self.num_resizes = 0
        self.revealed_error_norms: List[float] = []

    def reset(self) -> None:
        """Start a new pass: the averages restart from zero."""
        self.m1 = None
        self.m2 = None
        self.num_calls = 0

    def _ensure(self, shape, device) -> None:
        shape = tuple(shape)
        if self.m1 is None or tuple(self.m1.codes.shape) != shape or self.m1.codes.device != torch.device(device):
            if self.m1 is not None:
                self.num_resizes += 1
            self.m1 = zero_state(shape, device)
            self.m2 = zero_state(shape, device)

    def correction(self, shape, device) -> torch.Tensor:
        """c = gain * (blend * m1 + (1 - blend) * m2), fp32 of ``shape`` (the group last)."""
        self._ensure(shape, device)
        t1 = self.m1.value() * self.blend
        t2 = self.m2.value() * self.one_minus_blend
        return (t1 + t2) * self.gain

    def update(self, u: torch.Tensor) -> None:
        """Fold the residual ``u`` (fp32, the state's shape) into both averages, in place.

        m = store_state((m * decay) + (u * (1 - decay))): fp32 arithmetic, one rounding when stored.
        """
        if self.m1 is None or u.shape != self.m1.codes.shape:
            raise RuntimeError(f"Compensator.update: residual of shape {tuple(u.shape)} without a matching "
                               f"correction (state {None if self.m1 is None else tuple(self.m1.codes.shape)})")
        u = u.detach()
        self.m1.copy_(store_state(self.m1.value() * self.slow_decay + u * self.one_minus_slow))
        self.m2.copy_(store_state(self.m2.value() * self.fast_decay + u * self.one_minus_fast))
        self.num_calls += 1

    def record(self, revealed_error_norm: float) -> None:
        self.revealed_error_norms.append(float(revealed_error_norm))

    _KEYS = ("m1_codes", "m1_scale", "m2_codes", "m2_scale", "num_calls")

    def state_dict(self) -> dict:
        """A copy of the state: m1_codes, m1_scale, m2_codes, m2_scale (tensors, or None before the first
        call) and num_calls."""
        out = {"num_calls": self.num_calls}
        for name in ("m1", "m2"):
            avg = getattr(self, name)
            out[name + "_codes"] = None if avg is None else avg.codes.detach().clone()
            out[name + "_scale"] = None if avg is None else avg.scale.detach().clone()
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (copied in; validated: keys, dtypes, matching shapes)."""
        where = "Compensator.load_state_dict"
        missing = set(self._KEYS) - set(state)
        unknown = set(state) - set(self._KEYS)
        if missing or unknown:
            raise ValueError(f"{where}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)} "
                             f"(expected {', '.join(self._KEYS)})")
        num_calls = state["num_calls"]
        if not isinstance(num_calls, int) or isinstance(num_calls, bool) or num_calls < 0:
            raise ValueError(f"{where}: num_calls={num_calls!r} must be an int >= 0")
        tensors = [state[k] for k in self._KEYS[:4]]
        if any(t is None for t in tensors):
            if not all(t is None for t in tensors):
                raise ValueError(f"{where}: m1_codes, m1_scale, m2_codes and m2_scale must all be tensors or "
                                 f"all None")
            self.m1 = self.m2 = None
            self.num_calls = num_calls
            return
        for key, t, dtype in zip(self._KEYS[:4], tensors, (kStateCodeDtype, torch.float32) * 2):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype:
                raise ValueError(f"{where}: {key} must be a {dtype} tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        c1, s1, c2, s2 = tensors
        if (c1.shape != c2.shape or c1.dim() < 1 or s1.shape != c1.shape[:-1] or s2.shape != c1.shape[:-1]
                or len({c1.device, s1.device, c2.device, s2.device}) != 1):
            raise ValueError(f"{where}: shapes must match (codes [..., g], scales [...], on one device): "
                             f"m1 {tuple(c1.shape)} / {tuple(s1.shape)}, m2 {tuple(c2.shape)} / {tuple(s2.shape)}")
        self.m1 = StoredAverage(c1, s1).clone()
        self.m2 = StoredAverage(c2, s2).clone()
        self.num_calls = num_calls


def make_compensator(cfg: DirectionConfig, telemetry: bool = False) -> Optional[Compensator]:
    """A compensator for ``cfg``, or None where the direction does not compensate."""
    return Compensator(cfg, telemetry) if cfg.compensate else None
