"""The published low-bit tensor-parallel all-reduces ("peers"), as evaluation-only quantizers.

Each peer is a :class:`PeerFormat`: its wire format (grid, group size, scale format) and the way its
all-reduce runs, emulated on the P stacked partials of one site the way :mod:`echo_ds.emulate` emulates
Echo. None of them feeds errors back across calls, so a peer has no state. They live with the evaluation
code only: not in the kernels, not in the ds_config schema. ``python -m echo_ds.eval perplexity --peer
NAME`` evaluates one (repeatable); :data:`PEERS` lists them.

How a two-shot peer runs (each value quantized twice): every rank quantizes its contribution, the owner of
a segment dequantizes the P copies and sums them, quantizes the sum again, and every rank dequantizes that.
The details that differ between peers (whether the owner's own copy is quantized, the precision of the
sum, whether the owner keeps its unquantized sum) are the peer's and are given below. The emulation
returns one tensor for the model's single trajectory: where the peer's ranks end with different results
(vLLM and FlashInfer keep the owner's own stripe unquantized), it returns rank 0's result.

Bits per value are counted as ours (:func:`echo_ds.quant.wire_bytes`): the codes plus every group's
parameters, for the message quantized once, averaged over its elements.

The activations stay in the model's dtype (fp32 in the studies) for every peer, as for Echo; a peer's
own arithmetic (QuickReduce's fp16 codec and fp16 sum) is emulated, its input and output casts to bf16
(vLLM, FlashInfer) are not. Deployment thresholds are not emulated either: every site uses the format
(vLLM's quantized all-reduce, for example, only runs from 2M elements up at P = 4, 8M at P = 8).

Where a detail could not be read in a source, the docstring says so, and the emulation takes the choice
that favours the peer's accuracy (for example, the owner's own copy exact), so that a comparison with
Echo errs in the peer's favour.

Formats
-------

``quickreduce_int4``, ``quickreduce_int6``, ``quickreduce_int8`` (QuickReduce, AMD; in vLLM, SGLang, aiter)
    Read in vLLM's ``csrc/quickreduce/quick_reduce_impl.cuh`` (CodecQ4/Q6/Q8, AllReduceTwoshot) and
    ``csrc/quickreduce/base.h`` (group_abs_max, kThreadGroupSize).
    Grid: b-bit integers q in [-2^(b-1), 2^(b-1) - 1] (all 2^b codes), q = rint(x * enc), x_hat = q * dec.
    Scale: one fp16 decoding scale per group, dec = m * (-1/2^(b-1)), where m is the group's value of
    largest magnitude *with its sign* (``packed_abs_max`` keeps the sign; ties go to the minimum), so that
    m maps to code -2^(b-1) exactly and values of the other sign reach +2^(b-1) - 1 (one code short:
    those within one step of |m| are clipped by up to one step). enc = rcp(dec + 2^-24) in fp16 (the
    epsilon 0x0001 is fp16's smallest subnormal; an all-zero group's overflowing enc saturates, as
    ``set_fp16_ovfl(true)`` makes it), the product x * enc rounded to fp16, clamped, rounded half to even
    (``rintf``). All codec arithmetic is fp16 (vLLM casts bf16 inputs to fp16 by default: the kernel's
    ``cast_bf2half``, vLLM pull request 16804; the bf16 codec is not emulated); h2rcp is taken as the
    correctly rounded fp16 reciprocal.
    Group: 32 values = the even (or the odd) elements of 64 consecutive ones (8 threads x 8 fp16 values,
    the two halves of each f16x2 form two groups). Wire: b bits per value + 16 bits per 32 values =
    4.5 / 6.5 / 8.5 bits (the tile strides 1152 / 1664 / 2176 bytes per 2048 values say the same).
    Two-shot: phase 1 quantizes every segment, the rank's own included, and writes it to the owner; the
    owner sums the P decoded copies in fp16 (``packed_assign_add<half>``, from zero in rank order),
    phase 2 quantizes the sum and every rank, the owner included, decodes it. All ranks hold the same
    result.

``vllm_int8``, ``vllm_fp8`` (vLLM's quantized all-reduce, pull request 39783, ``VLLM_ALLREDUCE_QUANTIZATION``)
    Read in the pull request's Triton kernel ``two_shot_quantized_allreduce.py`` (Kraken-based) and its
    communicator ``quantized_all_reduce.py``.
    Grid: int8 in [-127, 127] or fp8 e4m3 (finite range +-448). Scale: one fp32 per group of 256
    contiguous values, s = qmax / max(amax, 1e-12) (qmax 127 or 448); q = cast(clamp(x * s, -qmax, qmax)),
    x_hat = q / s. Rounding: int8 via Triton's float-to-int cast ``.to(tl.int8)``, which is ``fptosi``,
    i.e. truncation toward zero (so the int8 error reaches a whole step); fp8 via ``.to(tl.float8e4nv)``,
    round to nearest even (emulated with ``torch.float8_e4m3fn``). Wire: 8 + 32/256 = 8.125 bits.
    Two-shot: phase 1 quantizes the whole input (own stripe included); the owner of a stripe (stripes of
    BLOCK_SIZE elements, owner = (i // BLOCK_SIZE) mod P) sums the P dequantized copies in fp32, writes
    its own output from that sum unquantized (cast to bf16) and the requantized sum to the others, which
    dequantize it. BLOCK_SIZE comes from a tuned-config file that was not read; 4096 is assumed (the
    vendored fallback schedule's value from 4M elements up, FlashInfer's below 64M). The ranks' results
    differ; the emulation returns rank 0's.

``flashinfer_fp8`` (FlashInfer, pull request 3759, ``flashinfer/comm/quantized_allreduce.py``)
    Read in that file (``_fp8_blockscale_2shot_kernel``). As ``vllm_fp8`` (same Kraken lineage), except
    that the stored scale is the inverse, inv = max(amax, 1e-12) / 448 (fp32), encoding multiplies by
    448 / amax and decoding multiplies by inv. Group 256 (``SCALE_GROUP_DEFAULT``), stripes of 4096
    (``_select_params`` for up to 64M elements). Wire: 8.125 bits. Two-shot as vLLM's, rank 0's result.

``flashcomm_int4`` (Flash Communication, arXiv 2412.04964)
    Read: the abstract (low-bit activation quantization with a two-step all-reduce: quantize, all-to-all,
    dequantize and reduce, quantize, all-gather, dequantize) and the issue's summary (INT4). The method
    section could not be read here; assumed: asymmetric min-max INT4 over groups of 128 contiguous values,
    fp16 scale s = (max - min) / 15 and fp16 minimum m, q = clamp(rint((x - m) / s), 0, 15),
    x_hat = q s + m; both steps INT4; the owner's own copy exact and the sum in fp32 (as ours). Wire:
    4 + 32/128 = 4.25 bits. Its successor (arXiv 2508.03760: any bit width by bit splitting, "spike
    reserving" of each group's extremes in floating point) is not emulated: its packing (group size, how
    the extremes and their positions are sent) could not be read.

``taco_fp8`` (TACO, arXiv 2604.24088, for training)
    Read: the abstract (FP8 after an "Adaptive Scale-Hadamard Transform", "Dual-Scale Quantization",
    data-driven reshaping). Assumed: a Hadamard transform over groups of 128 (this package's rotation,
    :func:`echo_ds.quant.rotate`), e4m3 codes with one fp32 scale per group of 128 (amax / 448, round to
    nearest even; the coarser per-tensor level of the two scales changes nothing in exact arithmetic and
    is not counted), two-shot with the owner's own copy exact and an fp32 sum. Wire: 8 + 32/128 = 8.25
    bits. The adaptive part and the reshaping could not be read and are not emulated.

``dong_int4_outliers`` (Dong et al., arXiv 2411.07942)
    Read: the abstract (outlier features, consistent across inputs, kept in high precision; the rest at
    low bit; 4.2 bits per value on average). Assumed: each rank keeps the ceil(H / 64) feature channels of
    its partial with the largest magnitude in fp16/bf16 (chosen per call from the data, which favours the
    peer over the paper's offline calibration; the indices are not counted), the other channels symmetric
    INT4 in [-7, 7] with one fp16 absmax scale per token row, round to nearest even; the all-reduce as an
    all-gather of the quantized partials that each rank sums itself (each value quantized once, its own
    partial exact). Wire per row of H values: (H - k) 4 + 16 k + 16 bits (4.215 for SmolLM2's H = 576).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from echo_ds import quant as Q
from echo_ds.eval.tp_emulation import TPEmulator, _EmulatedForwardReduce

kFp16Max = 65504.0
kFp16Eps = 2.0**-24          # QuickReduce's kScaleEpsilon for fp16 (0x0001)
kFp8Max = 448.0              # float8_e4m3fn's largest finite value
kAmaxFloor = 1e-12           # vLLM's and FlashInfer's floor on a group's amax
kStripeElements = 4096       # BLOCK_SIZE of the vLLM / FlashInfer kernels (see the module docstring)


# ----------------------------------------------------------------------------------------------------
# Round trips (quantize then dequantize) of one rank's contribution, vectorised over a leading rank axis
# ----------------------------------------------------------------------------------------------------

def _pad_to(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """[R, n] -> [R, ceil(n / multiple) * multiple], zeros appended."""
    pad = -x.shape[-1] % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def _f16(t: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to fp16 (kept in fp32): one fp16 operation is its fp32 result rounded so, since
    the product of two fp16 values is exact in fp32 (and fp16 arithmetic on the CPU is slow)."""
    return t.to(torch.float16).float()


def quickreduce_qdq(x: torch.Tensor, bits: int) -> torch.Tensor:
    """QuickReduce's codec round trip: [R, n] (any float) -> [R, n] fp32 holding fp16 values (see the
    module docstring). fp16 arithmetic is emulated as fp32 operations rounded to fp16 (:func:`_f16`)."""
    qmax = 2 ** (bits - 1)
    n = x.shape[-1]
    h = _f16(_pad_to(x.float(), 64))
    R = h.shape[0]
    # [R, n/64, 32, 2]: element 2i + parity of a 64-block; a group is one parity of one block.
    g = h.view(R, -1, 32, 2)
    wmax, wmin = g.amax(dim=2, keepdim=True), g.amin(dim=2, keepdim=True)
    signed_max = torch.where(wmax.abs() > wmin.abs(), wmax, wmin)
    dec = _f16(signed_max * (-1.0 / qmax))                     # exact but for fp16 subnormals
    enc = (1.0 / _f16(dec + kFp16Eps)).clamp(-kFp16Max, kFp16Max)  # h2rcp; fp16 overflow saturates
    enc = _f16(enc)
    w = _f16(g * enc).clamp(-qmax, qmax - 1)
    q = torch.round(w)                                         # rintf: half to even
    out = _f16(q * dec).view(R, -1)
    return out[:, :n]


def _group_view(x: torch.Tensor, group_size: int) -> torch.Tensor:
    return _pad_to(x.float(), group_size).view(x.shape[0], -1, group_size)


def kraken_qdq(x: torch.Tensor, code: str, inverse_scale: bool, group_size: int = 256) -> torch.Tensor:
    """vLLM's (inverse_scale False) or FlashInfer's (True) per-group round trip: [R, n] -> fp32 [R, n].

    code: "int8" (truncated toward zero, [-127, 127]), "int8_rne" (the same rounded to nearest even: not
    what the kernel does, a what-if) or "fp8" (e4m3, round to nearest even, +-448).
    """
    n = x.shape[-1]
    g = _group_view(x, group_size)
    qmax = kFp8Max if code == "fp8" else 127.0
    amax = g.abs().amax(dim=-1, keepdim=True).clamp_min(kAmaxFloor)
    y = (g * (qmax / amax)).clamp(-qmax, qmax)
    if code == "int8":
        q = torch.trunc(y)
    elif code == "int8_rne":
        q = torch.round(y)
    else:
        q = y.to(torch.float8_e4m3fn).float()
    out = q * (amax / qmax) if inverse_scale else q / (qmax / amax)
    return out.reshape(x.shape[0], -1)[:, :n]


def asymmetric_int_qdq(x: torch.Tensor, bits: int = 4, group_size: int = 128) -> torch.Tensor:
    """Min-max INT-b round trip with an fp16 scale and an fp16 minimum per group: [R, n] -> fp32 [R, n]."""
    n = x.shape[-1]
    g = _group_view(x, group_size)
    levels = 2**bits - 1
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    s = ((hi - lo) / levels).clamp(Q.kFp16MinSubnormal, kFp16Max).half().float()
    m = lo.half().float()
    q = torch.round((g - m) / s).clamp(0, levels)
    return (q * s + m).reshape(x.shape[0], -1)[:, :n]


def _hadamard_matrix(size: int) -> torch.Tensor:
    """The orthonormal rotation of :func:`echo_ds.quant.rotate` as a matrix M (rotate(x) = x @ M)."""
    return Q.rotate(torch.eye(size))


def hadamard_fp8_qdq(x: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """Rotate groups of ``group_size``, e4m3 with an fp32 amax/448 scale per group, unrotate: [R, n] -> fp32."""
    n = x.shape[-1]
    g = _group_view(x, group_size)
    m = _hadamard_matrix(group_size).to(g.device)
    r = g @ m
    inv = r.abs().amax(dim=-1, keepdim=True).clamp_min(kAmaxFloor) / kFp8Max
    q = (r / inv).clamp(-kFp8Max, kFp8Max).to(torch.float8_e4m3fn).float()
    out = (q * inv) @ m.T
    return out.reshape(x.shape[0], -1)[:, :n]


def outlier_int4_qdq(x: torch.Tensor, num_outliers: int) -> torch.Tensor:
    """Dong et al. (as assumed): [R, rows, H] -> fp32; per rank the ``num_outliers`` channels of largest
    magnitude kept (rounded to fp16), the rest symmetric INT4 [-7, 7] with an fp16 absmax scale per row."""
    xf = x.float()
    R, _, H = xf.shape
    keep = torch.zeros(R, 1, H, dtype=torch.bool, device=x.device)
    if num_outliers:
        top = xf.abs().amax(dim=1).topk(num_outliers, dim=-1).indices          # [R, k]
        keep.scatter_(2, top[:, None, :], True)
    inl = torch.where(keep, 0.0, xf)
    s = (inl.abs().amax(dim=-1, keepdim=True) / 7.0).clamp(Q.kFp16MinSubnormal, kFp16Max).half().float()
    q = torch.round(inl / s).clamp(-7, 7)
    return torch.where(keep, xf.half().float(), q * s)


# ----------------------------------------------------------------------------------------------------
# The formats
# ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PeerFormat:
    """One peer's wire format and how its all-reduce runs.

    name: the CLI name; kind: "quickreduce", "kraken" (vLLM / FlashInfer), "asymmetric", "hadamard_fp8",
    "outliers"; bits: code bits; group_size: values per scale (0 for per-row scales); param_bits: bits of
    a group's parameters on the wire; two_shot: each value quantized twice; code, inverse_scale: kraken
    options; source: what was read.
    """

    name: str
    kind: str
    bits: int
    group_size: int
    param_bits: int
    two_shot: bool
    description: str
    source: str
    options: dict = field(default_factory=dict)

    # -- bits on the wire ------------------------------------------------------------------------------
    @property
    def bits_per_value(self) -> float:
        """Bits per value of a whole group (codes + parameters); the outlier format: for a 576-wide row."""
        if self.kind == "outliers":
            return self.wire_bits((1, 576)) / 576
        return self.bits + self.param_bits / self.group_size

    def wire_bits(self, shape) -> float:
        """Bits one rank puts on the wire for a message of ``shape`` quantized once (codes + parameters)."""
        numel = math.prod(shape)
        if self.kind == "outliers":
            H = shape[-1]
            k = self.num_outliers(H)
            return (numel // H) * ((H - k) * self.bits + 16 * k + self.param_bits)
        if self.kind == "quickreduce":
            num_groups = 2 * -(-numel // 64)  # two interleaved groups per 64 values
        else:
            num_groups = -(-numel // self.group_size)
        return num_groups * (self.group_size * self.bits + self.param_bits)

    def num_outliers(self, width: int) -> int:
        return -(-width // self.options.get("outlier_divisor", 64))

    # -- one round trip and the all-reduce -------------------------------------------------------------
    def qdq(self, x: torch.Tensor) -> torch.Tensor:
        """One quantize-dequantize of R contributions, ``x`` [R, ...]: fp32 (QuickReduce: fp16) [R, ...]."""
        R = x.shape[0]
        if self.kind == "outliers":
            return outlier_int4_qdq(x.reshape(R, -1, x.shape[-1]), self.num_outliers(x.shape[-1])).view(x.shape)
        flat = x.reshape(R, -1)
        if self.kind == "quickreduce":
            out = quickreduce_qdq(flat, self.bits)
        elif self.kind == "kraken":
            out = kraken_qdq(flat, self.options["code"], self.options["inverse_scale"], self.group_size)
        elif self.kind == "asymmetric":
            out = asymmetric_int_qdq(flat, self.bits, self.group_size)
        elif self.kind == "hadamard_fp8":
            out = hadamard_fp8_qdq(flat, self.group_size)
        else:
            raise ValueError(f"unknown peer kind {self.kind!r}")
        return out.view(x.shape)

    def all_reduce(self, parts: torch.Tensor) -> torch.Tensor:
        """The peer's all-reduce of ``parts`` [P, ...] (any float dtype): [...] in parts' dtype (rank 0's
        result where the ranks' results differ)."""
        P = parts.shape[0]
        if P == 1:
            return parts[0].clone()
        shape = parts.shape[1:]
        if self.kind == "outliers":  # all-gather of quantized partials; rank 0 sums, its own partial exact
            copies = self.qdq(parts)
            acc = parts[0].float()
            for r in range(1, P):
                acc = acc + copies[r].float()
            return acc.to(parts.dtype)
        x = parts.reshape(P, -1)
        n = x.shape[1]
        copies = self.qdq(x)
        if self.kind == "quickreduce":
            # Every copy quantized (the own one too), fp16 sum from zero in rank order, requantized.
            acc = torch.zeros_like(copies[0])
            for r in range(P):
                acc = _f16(acc + copies[r])
            return self.qdq(acc[None])[0].to(parts.dtype).view(shape)
        if self.kind == "kraken":
            # Every copy quantized, fp32 sum; rank 0 keeps its own stripes' sum, dequantizes the others.
            acc = copies[0].clone()
            for r in range(1, P):
                acc = acc + copies[r]
            out = self.qdq(acc[None])[0]
            stripe = self.options.get("stripe_elements", kStripeElements)
            own = (torch.arange(n, device=x.device) // stripe) % P == 0
            return torch.where(own, acc, out).to(parts.dtype).view(shape)
        # Echo's layout (assumed): P contiguous segments of whole groups, the owner's own copy exact.
        g = self.group_size
        padded = -(-n // (P * g)) * P * g
        xp = _pad_to(x.float(), padded)
        cp = _pad_to(copies.float(), padded)
        seg = torch.arange(padded, device=x.device) // (padded // P)
        acc = torch.where(seg == 0, xp[0], cp[0])
        for r in range(1, P):
            acc = acc + torch.where(seg == r, xp[r], cp[r])
        out = self.qdq(acc[None])[0][:n]
        return out.to(parts.dtype).view(shape)

    def model_dump(self, mode: str = "python") -> dict:
        """What a results file records of this peer (perplexity.evaluate stores it as "peer")."""
        return dict(name=self.name, kind=self.kind, bits=self.bits, group_size=self.group_size,
                    param_bits=self.param_bits, bits_per_value=self.bits_per_value, two_shot=self.two_shot,
                    options=dict(self.options), source=self.source)


def _quickreduce(bits: int) -> PeerFormat:
    return PeerFormat(
        f"quickreduce_int{bits}", "quickreduce", bits, 32, 16, True,
        f"QuickReduce INT{bits}: signed-absmax grid [-{2 ** (bits - 1)}, {2 ** (bits - 1) - 1}], fp16 scale per 32 "
        f"values, fp16 codec and sum, two-shot ({bits + 0.5} bits)",
        "vLLM csrc/quickreduce/quick_reduce_impl.cuh (CodecQ4/Q6/Q8, AllReduceTwoshot), base.h")


PEERS = {p.name: p for p in (
    _quickreduce(4),
    _quickreduce(6),
    _quickreduce(8),
    PeerFormat("vllm_int8", "kraken", 8, 256, 32, True,
               "vLLM quantized all-reduce, int8: fp32 scale per 256, truncated toward zero, two-shot, the owner "
               "keeps its stripe's sum (8.125 bits)",
               "vLLM pull request 39783, two_shot_quantized_allreduce.py",
               {"code": "int8", "inverse_scale": False}),
    PeerFormat("vllm_fp8", "kraken", 8, 256, 32, True,
               "vLLM quantized all-reduce, fp8 e4m3: fp32 scale per 256, two-shot, the owner keeps its stripe's "
               "sum (8.125 bits)",
               "vLLM pull request 39783, two_shot_quantized_allreduce.py",
               {"code": "fp8", "inverse_scale": False}),
    PeerFormat("flashinfer_fp8", "kraken", 8, 256, 32, True,
               "FlashInfer fp8 two-shot all-reduce: e4m3, fp32 inverse scale per 256, the owner keeps its "
               "stripe's sum (8.125 bits)",
               "FlashInfer pull request 3759, flashinfer/comm/quantized_allreduce.py",
               {"code": "fp8", "inverse_scale": True}),
    PeerFormat("flashcomm_int4", "asymmetric", 4, 128, 32, True,
               "Flash Communication INT4 (format assumed): min-max grid, fp16 scale + fp16 min per 128, "
               "two-step (4.25 bits)",
               "arXiv 2412.04964, abstract only; group size and grid assumed"),
    PeerFormat("taco_fp8", "hadamard_fp8", 8, 128, 32, True,
               "TACO fp8 (format assumed): Hadamard over 128, e4m3 with an fp32 scale per 128, two-shot "
               "(8.25 bits)",
               "arXiv 2604.24088, abstract only; group size, scales and the transform assumed"),
    PeerFormat("dong_int4_outliers", "outliers", 4, 0, 16, False,
               "Dong et al. (format assumed): 1/64 of the channels kept at 16 bits, the rest INT4 with an "
               "fp16 scale per row, quantized once (about 4.2 bits)",
               "arXiv 2411.07942, abstract only; channel share, grid and scales assumed",
               {"outlier_divisor": 64}),
)}


def get_peer(name: str) -> PeerFormat:
    try:
        return PEERS[name]
    except KeyError:
        raise ValueError(f"unknown peer {name!r}: choose from {', '.join(PEERS)}") from None


# ----------------------------------------------------------------------------------------------------
# The tensor-parallel emulation with peers
# ----------------------------------------------------------------------------------------------------

class PeerTPEmulator(TPEmulator):
    """:class:`~echo_ds.eval.tp_emulation.TPEmulator` that also takes a :class:`PeerFormat` as its config:
    every site then sums its P partials with the peer's all-reduce (a peer has no state to reset)."""

    def reduce(self, parts: torch.Tensor, site_index: int, direction: str = "forward") -> torch.Tensor:
        fmt = self.config
        if not isinstance(fmt, PeerFormat):
            return super().reduce(parts, site_index, direction)
        self.stats.num_elements += parts[0].numel()
        self.stats.num_wire_bytes += fmt.wire_bits(tuple(parts.shape[1:])) / 8.0
        self.stats.num_calls += 1
        return _EmulatedForwardReduce.apply(parts, lambda p, bits=None: fmt.all_reduce(p), None)
