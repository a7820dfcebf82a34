"""The torch stages: the staged pipeline's stages through torch ops, the CPU oracle of its protocol.

TorchSchedule runs the very functions of echo_ds.algorithm per tile, in the order of echo_ds.reference, on
the stage streams EchoBuffer's staged pipeline (echo_ds.p2p.stages.StagedPipeline) provides: the codes are
staged locally and moved by the transport's puts, which publish the flag after the data. Every step is per
group or per element, so a tile's bits are the whole tensor's, and the result is the reference's bit for bit.

They left the package (issue 31): a production call the staged kernels do not run (a group size outside
echo_ds.ops.kernels.SUPPORTED_GROUP_SIZES) takes the reference path. Here they serve the host transport
(tests/host_transport.py, whose ``schedule`` they are): tiling, offsets, flags and the pipeline's order of
stages checked on the CPU against the reference, every group size included.
"""

from __future__ import annotations

from typing import Tuple

import torch

from echo_ds import algorithm as A
from echo_ds import quant as Q
from echo_ds.p2p import layout as L
from echo_ds.p2p import protocol as proto
from echo_ds.p2p.stages import Schedule
from echo_ds.quant import QuantSpec


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



class TorchSchedule(Schedule):
    """Stages through torch ops on the stage streams; codes staged locally and put by the transport."""

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
