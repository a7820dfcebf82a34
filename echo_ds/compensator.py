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

Storage. m1 and m2 are *stored* as bfloat16 (``kStateDtype``) and computed with in fp32: a stored value
enters the arithmetic exactly (bf16 -> fp32 is exact), and each updated average is rounded once, to
nearest even, when it is stored (:func:`store_state`). A value that is not finite after that rounding
(a NaN or infinity carried by this call's residual, or a finite fp32 beyond bf16's range) is stored as
+0: a non-finite call poisons its own output, never the state that later calls read. Why bf16 (numbers
in docs/kernels.md, "Compensator state dtype"): the state is an estimate of a rounding error, so its own
2^-9 relative rounding is far below what it estimates (SmolLM2-135M at P = 4, 4-bit default, one run:
all-reduce error 0.09022 against 0.09016 with an fp32 state, perplexity within the noise band), and bf16
has fp32's exponent range, so neither tiny gradients nor large activations leave it. It halves the state's bytes:
with the update fused into the passes that hold the residual, a call reads the state once and writes it
once, 8 bytes per element (the fp32 state with a separate update pass moved about 32).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from echo_ds.config import DirectionConfig
from echo_ds.quant import f32

# The stored format of m1 and m2 (see "Storage" above); the kernels hold it as 16-bit patterns.
kStateDtype = torch.bfloat16


def store_state(v: torch.Tensor) -> torch.Tensor:
    """fp32 ``v`` as it is stored: bf16, rounded to nearest even; non-finite after rounding -> +0."""
    s = v.to(kStateDtype)
    return torch.where(torch.isfinite(s), s, torch.zeros((), dtype=kStateDtype, device=s.device))


class Compensator:
    """The (m1, m2) state of one pass direction on one rank (or on P emulated ranks).

    The state is ``kStateDtype`` (bf16) of the collective's padded, flattened length (shape
    ``batch_shape + (numel,)``, ``batch_shape = (P,)`` in the emulator). It is allocated as zeros at the
    first call after :meth:`reset`, and re-allocated (a warning-free reset) when a call's length differs
    from the state's: an error estimate of another shape cannot be fed back.
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
        self.m1: Optional[torch.Tensor] = None
        self.m2: Optional[torch.Tensor] = None
        self.num_calls = 0  # calls since the last reset
        self.num_resizes = 0
        self.revealed_error_norms: List[float] = []

    def reset(self) -> None:
        """Start a new pass: the averages restart from zero."""
        self.m1 = None
        self.m2 = None
        self.num_calls = 0

    def _ensure(self, shape, device) -> None:
        if self.m1 is None or self.m1.shape != shape or self.m1.device != torch.device(device):
            if self.m1 is not None:
                self.num_resizes += 1
            self.m1 = torch.zeros(shape, dtype=kStateDtype, device=device)
            self.m2 = torch.zeros(shape, dtype=kStateDtype, device=device)

    def correction(self, shape, device) -> torch.Tensor:
        """c = gain * (blend * m1 + (1 - blend) * m2), fp32 of ``shape``."""
        self._ensure(tuple(shape), device)
        t1 = self.m1.float() * self.blend
        t2 = self.m2.float() * self.one_minus_blend
        return (t1 + t2) * self.gain

    def update(self, u: torch.Tensor) -> None:
        """Fold the residual ``u`` (fp32, the state's shape) into both averages, in place.

        m = store_state((m * decay) + (u * (1 - decay))): fp32 arithmetic, one rounding when stored.
        """
        if self.m1 is None or u.shape != self.m1.shape:
            raise RuntimeError(f"Compensator.update: residual of shape {tuple(u.shape)} without a matching "
                               f"correction (state {None if self.m1 is None else tuple(self.m1.shape)})")
        u = u.detach()
        self.m1.copy_(store_state(self.m1.float() * self.slow_decay + u * self.one_minus_slow))
        self.m2.copy_(store_state(self.m2.float() * self.fast_decay + u * self.one_minus_fast))
        self.num_calls += 1

    def record(self, revealed_error_norm: float) -> None:
        self.revealed_error_norms.append(float(revealed_error_norm))

    def state_dict(self) -> dict:
        """A copy of the state (m1, m2: bf16 tensors or None; num_calls)."""
        copy = (lambda t: None if t is None else t.detach().clone())
        return {"m1": copy(self.m1), "m2": copy(self.m2), "num_calls": self.num_calls}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (copied in; validated: keys, dtype, matching shapes)."""
        missing = {"m1", "m2", "num_calls"} - set(state)
        unknown = set(state) - {"m1", "m2", "num_calls"}
        if missing or unknown:
            raise ValueError(f"Compensator.load_state_dict: missing keys {sorted(missing)}, "
                             f"unknown keys {sorted(unknown)} (expected m1, m2, num_calls)")
        m1, m2, num_calls = state["m1"], state["m2"], state["num_calls"]
        if not isinstance(num_calls, int) or isinstance(num_calls, bool) or num_calls < 0:
            raise ValueError(f"Compensator.load_state_dict: num_calls={num_calls!r} must be an int >= 0")
        if (m1 is None) != (m2 is None):
            raise ValueError("Compensator.load_state_dict: m1 and m2 must both be tensors or both None")
        if m1 is not None:
            for name, t in (("m1", m1), ("m2", m2)):
                if not isinstance(t, torch.Tensor) or t.dtype != kStateDtype:
                    raise ValueError(f"Compensator.load_state_dict: {name} must be a {kStateDtype} tensor, got "
                                     f"{getattr(t, 'dtype', type(t).__name__)}")
            if m1.shape != m2.shape or m1.device != m2.device:
                raise ValueError(f"Compensator.load_state_dict: m1 {tuple(m1.shape)} on {m1.device} and m2 "
                                 f"{tuple(m2.shape)} on {m2.device} must match")
            m1, m2 = m1.detach().clone(), m2.detach().clone()
        self.m1, self.m2, self.num_calls = m1, m2, num_calls


def make_compensator(cfg: DirectionConfig, telemetry: bool = False) -> Optional[Compensator]:
    """A compensator for ``cfg``, or None where the direction does not compensate."""
    return Compensator(cfg, telemetry) if cfg.compensate else None
