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
"""

from __future__ import annotations

from typing import List, Optional

import torch

from echo_ds.config import DirectionConfig
from echo_ds.quant import f32


class Compensator:
    """The (m1, m2) state of one pass direction on one rank (or on P emulated ranks).

    The state is fp32 of the collective's padded, flattened length (shape ``batch_shape + (numel,)``,
    ``batch_shape = (P,)`` in the emulator). It is allocated as zeros at the first call after
    :meth:`reset`, and re-allocated (a warning-free reset) when a call's length differs from the
    state's: an error estimate of another shape cannot be fed back.
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
            self.m1 = torch.zeros(shape, dtype=torch.float32, device=device)
            self.m2 = torch.zeros(shape, dtype=torch.float32, device=device)

    def correction(self, shape, device) -> torch.Tensor:
        """c = gain * (blend * m1 + (1 - blend) * m2), fp32 of ``shape``."""
        self._ensure(tuple(shape), device)
        t1 = self.m1 * self.blend
        t2 = self.m2 * self.one_minus_blend
        return (t1 + t2) * self.gain

    def update(self, u: torch.Tensor) -> None:
        """Fold the residual ``u`` (fp32, the state's shape) into both averages, in place."""
        assert self.m1 is not None and u.shape == self.m1.shape, "update without a matching correction"
        self.m1.mul_(self.slow_decay).add_(u * self.one_minus_slow)
        self.m2.mul_(self.fast_decay).add_(u * self.one_minus_fast)
        self.num_calls += 1

    def record(self, revealed_error_norm: float) -> None:
        self.revealed_error_norms.append(float(revealed_error_norm))

    def state_dict(self) -> dict:
        return {"m1": self.m1, "m2": self.m2, "num_calls": self.num_calls}

    def load_state_dict(self, state: dict) -> None:
        self.m1, self.m2, self.num_calls = state["m1"], state["m2"], state["num_calls"]


def make_compensator(cfg: DirectionConfig, telemetry: bool = False) -> Optional[Compensator]:
    """A compensator for ``cfg``, or None where the direction does not compensate."""
    return Compensator(cfg, telemetry) if cfg.compensate else None
