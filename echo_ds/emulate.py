"""The Echo all-reduce of P emulated ranks inside one process, for accuracy work on one device.

``parts`` holds the P ranks' contributions stacked on dim 0; the result is what every rank of the
distributed reference (:func:`echo_ds.reference.echo_all_reduce`) would hold for the same partials,
bit for bit (tests/test_reference.py checks it on gloo).
"""

from __future__ import annotations

from typing import Optional

import torch

from echo_ds import algorithm as A
from echo_ds.compensator import Compensator, make_compensator
from echo_ds.config import EchoConfig
from echo_ds.quant import QuantSpec


def emulated_echo_all_reduce(parts: torch.Tensor, spec: QuantSpec, compensator: Optional[Compensator] = None,
                             pow2_rescale="auto") -> torch.Tensor:
    """Echo all-reduce of ``parts`` ([P, ...] float) -> [...] in ``parts``' dtype.

    ``compensator`` carries the P ranks' states (shape [P, padded]); see echo_all_reduce for the rest.
    """
    if not parts.is_floating_point():
        raise TypeError(f"parts must be floating point, got {parts.dtype}")
    A.check_pow2_mode(pow2_rescale, "emulated_echo_all_reduce")
    P = parts.shape[0]
    out_shape = parts.shape[1:]
    if P == 1:
        return parts[0].clone()
    layout = A.Layout(parts[0].numel(), P, spec.group_size)
    r = A.rotate_if(A.to_segments(parts, layout), spec)  # [P rank, P segment, G, g]
    if compensator is not None:
        r = r + compensator.correction(r.shape, r.device)
    k = A.pow2_exponent(r.abs().amax(), pow2_rescale) if pow2_rescale else 0
    rs = r * 2.0**k if k else r

    # Every rank quantizes every segment; the diagonal (a rank's own segment) is never sent.
    sent = A.quantize_segments(rs, spec)
    copies = A.dequantize_segments(*sent, spec)
    diag = torch.arange(P, device=parts.device)
    terms = copies.clone()
    terms[diag, diag] = rs[diag, diag]
    acc = A.ordered_sum(terms)  # [P owner, G, g]
    reduced = A.quantize_segments(acc, spec)
    s_hat_scaled = A.dequantize_segments(*reduced, spec)
    if pow2_rescale is False:  # per rank: its sent segments and, at its own index, the one it reduced
        seen = [t.clone() for t in (rs, sent[1], sent[2])]
        for t, own in zip(seen, (acc,) + reduced[1:]):
            t[diag, diag] = own
        clipped, underflow = A.range_flags(*seen, spec)
        A.note_range(bool(clipped.any()), bool(underflow.any()), spec.bits, "emulated_echo_all_reduce")
    s_hat = s_hat_scaled * 2.0**-k if k else s_hat_scaled
    y = A.from_segments(A.unrotate_if(s_hat, spec), layout, out_shape, parts.dtype)

    if compensator is not None:
        if compensator.residual == "output":
            u = A.output_residual(r, s_hat, P)
        else:
            u = A.local_residual(rs, copies, (diag, diag), s_hat_scaled, acc, down=2.0**-k if k else None)
        if compensator.telemetry:
            exact = A.ordered_sum(r)
            compensator.record(torch.linalg.vector_norm(s_hat - exact))
        compensator.update(u)
    return y


def quantized_all_reduce(parts: torch.Tensor, config: EchoConfig, bits: Optional[int] = None,
                         direction: str = "forward") -> torch.Tensor:
    """One uncompensated Echo all-reduce of ``parts`` [P, ...] under ``config``'s quantizer."""
    pow2 = config.direction(direction).pow2_rescale
    return emulated_echo_all_reduce(parts, config.quant_spec(bits), None, pow2)


class CompensatedAllReduce:
    """The compensated Echo all-reduce of P emulated ranks along one pass direction.

    ``op(parts, bits=None)`` reduces ``parts`` [P, ...] and advances the per-rank compensator state;
    ``op.reset()`` starts a new pass (call it per sequence / per forward). With ``compensate: false``
    in the direction's config it is the plain quantized all-reduce.
    """

    def __init__(self, world_size: int, config: EchoConfig, direction: str = "forward"):
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        self.world_size = world_size
        self.config = config
        self.direction = direction
        dcfg = config.direction(direction)
        self.pow2_rescale = dcfg.pow2_rescale
        self.compensator = make_compensator(dcfg, telemetry=config.telemetry)
        self.num_calls = 0

    def reset(self) -> None:
        if self.compensator is not None:
            self.compensator.reset()
        self.num_calls = 0

    def __call__(self, parts: torch.Tensor, bits: Optional[int] = None) -> torch.Tensor:
        if parts.shape[0] != self.world_size:
            raise ValueError(f"parts has {parts.shape[0]} ranks on dim 0, expected {self.world_size}")
        self.num_calls += 1
        return emulated_echo_all_reduce(parts, self.config.quant_spec(bits), self.compensator, self.pow2_rescale)
