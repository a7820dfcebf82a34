"""The reference Echo all-reduce over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

This is the specification: the CUDA path reproduces its numbers bit for bit. One call moves each
non-owned segment once to its owner as b-bit codes (``all_to_all_single``), the owner sums the P copies
in fp32 with its own copy unquantized, quantizes the sum once, and an ``all_gather`` of the codes gives
every rank the same values. Every element is quantized at most twice, for any P. The stages are in
:mod:`echo_ds.collective`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from echo_ds import collective as C
from echo_ds.compensator import Compensator
from echo_ds.quant import QuantSpec, reciprocal

# all_gather_single replaces all_gather_into_tensor in newer torch; both take (output, input, group).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _packet(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """[S, G, c] codes and [S, G] fp16 parameters -> [S, G * (c + 4)] bytes on the wire."""
    S = codes.shape[0]
    return torch.cat((codes.reshape(S, -1), scale.reshape(S, -1).view(torch.uint8),
                      zero.reshape(S, -1).view(torch.uint8)), dim=1)


def _unpacket(buf: torch.Tensor, num_groups: int, code_bytes: int):
    S = buf.shape[0]
    n_codes = num_groups * code_bytes
    codes = buf[:, :n_codes].reshape(S, num_groups, code_bytes)
    scale = buf[:, n_codes:n_codes + 2 * num_groups].contiguous().view(torch.float16)
    zero = buf[:, n_codes + 2 * num_groups:].contiguous().view(torch.float16)
    return codes, scale, zero


def echo_all_reduce(x: torch.Tensor, spec: QuantSpec, group: Optional[dist.ProcessGroup] = None,
                    compensator: Optional[Compensator] = None, pow2_rescale: bool = False) -> torch.Tensor:
    """The Echo all-reduce of ``x`` over ``group``: a new tensor of ``x``'s shape and dtype.

    x: this rank's contribution, any shape, fp32 / bf16 / fp16 (left untouched).
    spec: bits, group size, quantizer policy and rotation.
    compensator: when given, its correction is added before quantizing and its state updated with this
        call's residual (the same object must be passed at every site of the pass, in the same order on
        every rank).
    pow2_rescale: multiply by a power of two chosen from the group's largest magnitude (one scalar max
        all-reduce) before quantizing and divide after; the compensator stays outside the scaling.

    All ranks return bit-identical tensors. Non-finite inputs propagate as NaN over their groups.
    """
    if not x.is_floating_point():
        raise TypeError(f"echo_all_reduce expects a floating-point tensor, got {x.dtype}")
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return x.clone()
    rank = dist.get_rank(group)
    layout = C.Layout(x.numel(), world_size, spec.group_size)
    G = layout.groups_per_segment
    code_bytes = spec.group_size * spec.bits // 8
    others = [j for j in range(world_size) if j != rank]

    # Entry: rotate, compensate, rescale; quantize the segments this rank sends.
    r = C.rotate_if(C.to_segments(x.reshape(1, -1), layout), spec)[0]  # [P, G, g]
    if compensator is not None:
        r = r + compensator.correction(r.shape, r.device)
    k = 0
    if pow2_rescale:
        amax = r.abs().amax().reshape(1)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        k = C.pow2_exponent(amax)
    rs = r * 2.0**k if k else r
    sent = C.quantize_segments(rs[others], spec)

    # All-to-all: segment j to its owner j (nothing to self).
    packet_bytes = G * (code_bytes + 4)
    send = _packet(*sent).reshape(-1)
    recv = torch.empty((world_size - 1) * packet_bytes, dtype=torch.uint8, device=x.device)
    splits = [0 if j == rank else packet_bytes for j in range(world_size)]
    dist.all_to_all_single(recv, send, output_split_sizes=splits, input_split_sizes=splits, group=group)

    # Owner reduce: fp32 sum in rank order, own copy unquantized; requantize once.
    copies = C.dequantize_segments(*_unpacket(recv.view(world_size - 1, -1), G, code_bytes), spec)
    terms = torch.empty((world_size, G, spec.group_size), dtype=torch.float32, device=x.device)
    terms[others] = copies
    terms[rank] = rs[rank]
    acc = C.ordered_sum(terms)
    reduced = C.quantize_segments(acc[None], spec)

    # All-gather of the reduced codes; every rank dequantizes the same codes.
    gathered = torch.empty(world_size * packet_bytes, dtype=torch.uint8, device=x.device)
    _all_gather(gathered, _packet(*reduced).reshape(-1), group=group)
    s_hat_scaled = C.dequantize_segments(*_unpacket(gathered.view(world_size, -1), G, code_bytes), spec)
    s_hat = s_hat_scaled * 2.0**-k if k else s_hat_scaled
    y = C.from_segments(C.unrotate_if(s_hat, spec), layout, x.shape, x.dtype)

    if compensator is not None:
        if compensator.residual == "output":
            u = r - s_hat * reciprocal(world_size)
        else:
            err = torch.empty_like(rs)
            err[others] = C.dequantize_segments(*sent, spec) - rs[others]
            err[rank] = s_hat_scaled[rank] - acc
            u = -(err * 2.0**-k) if k else -err
        if compensator.telemetry:
            exact = r.clone()
            dist.all_reduce(exact, group=group)
            compensator.record(torch.linalg.vector_norm(s_hat - exact))
        compensator.update(u)
    return y


def exact_all_reduce(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The uncompressed all-reduce of ``x`` (a new tensor), for comparisons and small messages."""
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out
