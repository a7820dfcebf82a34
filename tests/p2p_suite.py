"""The checks of the p2p backend, one body for both transports.

``suite(rank, world_size, cfg)`` runs inside every rank of a gloo group (tests/utils.run_distributed):
on a GPU with the CUDA transport (tests/test_p2p_gpu.py, several ranks may share one GPU) and on a CPU
with the host transport (tests/test_p2p_host.py, small sizes), so that the checks themselves are
exercised where no GPU is. Every comparison is exact, across ranks and against the specification
computed on the same device: the emulator (echo_ds.emulate, equal to the reference bit for bit on one
device: tests/test_reference.py) with the inputs of all ranks, and on a CPU also the reference itself
over gloo. On a GPU the reference over gloo runs on CPU copies; it is compared and its differences are
counted and reported, not asserted (``cfg["cpu_reference"] = "report"``). The reference writes divisions
by constants as products by the fp32 reciprocal (docs/kernels.md, "Divisions by constants"), so CPU and
CUDA give the same bits, and the GPU runs have reported 0 differences.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from echo_ds import collective
from echo_ds.compensator import make_compensator
from echo_ds.config import STATE_DTYPES, DirectionConfig
from echo_ds.emulate import emulated_echo_all_reduce
from echo_ds.quant import QUANTIZERS, QuantSpec
from echo_ds.reference import echo_all_reduce
from host_transport import transport_arg

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def log(rank, msg):
    if rank == 0:
        print(f"P2P: {msg}", flush=True)
        path = os.environ.get("ECHO_P2P_LOG")
        if path:
            with open(path, "a") as f:
                f.write(msg + "\n")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality, NaN where the other is NaN (payloads of NaN may differ between devices)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.reshape(-1), b.reshape(-1).to(a.device)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    iv = _INT_VIEW[a.dtype]
    return torch.equal(torch.where(nan_a, torch.zeros_like(a), a).view(iv),
                       torch.where(nan_b, torch.zeros_like(b), b).view(iv))


def same_state(comp, comp_emul, rank: int) -> bool:
    """Every state tensor of ``comp`` (its stored format's: Compensator.state_names) equals rank ``rank``'s of
    the emulator's ``comp_emul``, bit for bit."""
    return all(torch.equal(getattr(comp, name), getattr(comp_emul, name)[rank]) for name in comp.state_names)


def digest(y: torch.Tensor) -> int:
    """A position-weighted sum of the bits: equal digests on every rank for equal tensors."""
    v = y.reshape(-1).contiguous()
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v).view(_INT_VIEW[y.dtype]).to(torch.int64)
    w = torch.arange(v.numel(), device=v.device, dtype=torch.int64) % 1000003 + 1
    return int((v * w).sum()) ^ int(torch.isnan(y).sum())


def all_same(obj) -> bool:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return all(e == everyone[0] for e in everyone)


def spec_on_device(parts, spec, comp=None, pow2="auto"):
    """The emulator's result (the reference's bits on this device) for every rank's ``parts`` [P, n]."""
    return emulated_echo_all_reduce(parts, spec, comp, pow2)


class CpuReference:
    """The reference over gloo on CPU copies: asserted equal (CPU runs) or its differences counted."""

    def __init__(self, mode):
        self.mode = mode  # "assert" | "report"
        self.num_calls = self.num_differ = self.num_elements_differ = 0

    def check(self, y, x, spec, comp=None, pow2="auto", what=""):
        with collective.reference_only():  # the EchoBuffer under test is this group's registered backend
            ref = echo_all_reduce(x.cpu(), spec, compensator=comp, pow2_rescale=pow2)
        self.num_calls += 1
        if same_bits(y.cpu(), ref):
            return ref
        assert self.mode == "report", f"{what}: differs from the reference over gloo"
        self.num_differ += 1
        yc, rc = y.cpu().float().reshape(-1), ref.float().reshape(-1)
        self.num_elements_differ += int(((yc != rc) & ~(torch.isnan(yc) & torch.isnan(rc))).sum())
        return ref

    def summary(self):
        return (f"CPU reference over gloo: {self.num_calls} calls compared, {self.num_differ} differ "
                f"({self.num_elements_differ} elements)")


def parts_for(P, n, dtype, seed, device, scale=1.0):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(P, n, generator=g, device=device) * scale).to(dtype)


# ----------------------------------------------------------------------------------------------------


def check_options(buf, rank, P, device, n, cpu_ref, stride=1):
    """Every dtype x bit width x quantizer x rotation (and group sizes), against the emulator on this
    device and the CPU reference (every ``stride``-th combination)."""
    num = 0
    for i, (dtype, bits, quantizer, rot) in enumerate(
            (d, b, p, r) for d in DTYPES for b in (4, 8) for p in QUANTIZERS for r in (False, True)):
        if i % stride:
            continue
        # every quantizer meets every group size over the (dtype, bits) rows (8 combinations per row)
        spec = QuantSpec(bits, (64, 128, 256, 16)[(i + i // 8) % 4], quantizer, rot)
        # never, always (gradient-sized values), "auto" beyond its window (fp16 stays in range)
        pow2 = (False, True, "auto")[i % 3]
        scale = {False: 1.0, True: 1e-5, "auto": 1.0 if dtype == torch.float16 else 1e5}[pow2]
        parts = parts_for(P, n + i, dtype, 100 + i, device, scale)
        x = parts[rank].clone()
        y = buf.all_reduce(x, spec, pow2_rescale=pow2)
        what = f"options {dtype} {spec} pow2={pow2}: rank {rank}"
        assert same_bits(y, spec_on_device(parts, spec, pow2=pow2)), f"{what} differs from the emulator"
        cpu_ref.check(y, x, spec, pow2=pow2, what=what)
        assert torch.equal(x, parts[rank]), "the input was modified"
        assert all_same(digest(y.cpu())), f"options {dtype} {spec}: ranks differ"
        num += 1
    return num


def check_compensated(buf, rank, P, device, n, cpu_ref, num_calls=4):
    """Both residuals, with and without the pow2 rescaling: outputs and both averages, every call."""
    num = 0
    for residual in ("output", "local"):
        for m, pow2 in enumerate((False, True, "auto")):  # "auto" beyond its window: rescaled
            dcfg = DirectionConfig(residual=residual, gain=0.9)
            comp, comp_emul, comp_cpu = make_compensator(dcfg), make_compensator(dcfg), make_compensator(dcfg)
            spec = QuantSpec(4, 64, "zero_aware" if residual == "output" else "zero_aware_int", rotation=m > 0)
            for call in range(num_calls):
                parts = parts_for(P, n, torch.bfloat16, 1000 + 10 * call + m, device, (1.0, 1e-4, 1e5)[m])
                x = parts[rank]
                y = buf.all_reduce(x, spec, compensator=comp, pow2_rescale=pow2)
                expected = spec_on_device(parts, spec, comp_emul, pow2)
                what = f"compensated {residual} pow2={pow2} call {call}: rank {rank}"
                cpu_ref.check(y, x, spec, comp_cpu, pow2, what)
                buf.synchronize()
                assert same_bits(y, expected), f"{what}: output differs from the emulator"
                assert same_state(comp, comp_emul, rank), f"{what}: state differs from the emulator's"
                num += 1
    return num


def check_nonfinite(buf, rank, P, device, cpu_ref):
    parts = parts_for(P, 5000, torch.float32, 7, device)
    parts[0, 10] = float("nan")
    parts[P - 1, 3000] = float("inf")
    x = parts[rank]
    spec = QuantSpec(4, 128)
    y = buf.all_reduce(x, spec)
    assert same_bits(y, spec_on_device(parts, spec)), "non-finite inputs: output differs from the emulator"
    cpu_ref.check(y, x, spec, what="non-finite inputs")
    assert torch.isnan(y).any(), "NaN did not propagate"
    return 1


def check_sizes(buf, rank, P, device, sizes, every_rank_below: int):
    """Sizes from one element up, against the emulator on this device (on every rank below
    ``every_rank_below`` elements, on rank 0 above), and equal digests on every rank."""
    lines = []
    for i, (n, dtype_name) in enumerate(sizes):
        dtype = getattr(torch, dtype_name)
        rotation = i % 3 == 1
        spec = QuantSpec(4, 64, "zero_aware_int", rotation) if i % 4 == 3 else QuantSpec(4, 128, rotation=rotation)
        comp = make_compensator(DirectionConfig()) if i % 2 == 0 else None
        parts = parts_for(P, n, dtype, 5000 + i, device)
        x = parts[rank]
        t0 = time.perf_counter()
        y = buf.all_reduce(x, spec, compensator=comp)
        buf.synchronize()
        secs = time.perf_counter() - t0
        if n < every_rank_below or rank == 0:
            ref = spec_on_device(parts, spec, make_compensator(DirectionConfig()) if comp else None)
            assert same_bits(y, ref), f"size {n} {dtype}: rank {rank} differs from the emulator"
            del ref
        assert all_same(digest(y)), f"size {n} {dtype}: ranks differ"
        lines.append(f"n={n} {str(dtype)[6:]} ({n * parts.element_size() / 2**20:.3f} MiB){' compensated' if comp else ''}"
                     f"{' rotated' if spec.rotation else ''}: bit-identical to the emulator and across ranks "
                     f"(first call {secs * 1e3:.1f} ms)")
        del parts, x, y
    return lines


def plain_expected(parts: torch.Tensor) -> torch.Tensor:
    """EchoBuffer.plain_all_reduce's contract: the fp32 sum in rank order, saturated, rounded once."""
    acc = parts[0].float()
    for r in range(1, parts.shape[0]):
        acc = acc + parts[r].float()
    fmax = torch.finfo(parts.dtype).max
    return torch.where(torch.isfinite(acc), acc.clamp(-fmax, fmax), acc).to(parts.dtype)


def check_plain(buf, rank, P, device, sizes=(1, 4097, 65_537, 1_000_003, 333_333)):
    """The unquantized call of the same family: every dtype, sizes from one element (chunked where the
    buffer's workspace is small), NaN and a sum beyond fp16's range, against the rank-order fp32 sum."""
    num = 0
    for i, n in enumerate(sizes):
        for dtype in DTYPES:
            parts = parts_for(P, n, dtype, 8000 + 3 * i, device)
            if n > 100:
                parts[0, 7] = float("nan")
                parts[:, 50] = 60000.0 if dtype == torch.float16 else 1e30  # fp16: the sum saturates
            y = buf.plain_all_reduce(parts[rank])
            buf.synchronize()
            what = f"plain n={n} {dtype}: rank {rank}"
            assert same_bits(y, plain_expected(parts)), f"{what} differs from the rank-order fp32 sum"
            assert all_same(digest(y.cpu())), f"{what}: ranks differ"
            num += 1
    return num


def check_chunked(rank, P, device, cfg):
    """A workspace smaller than the messages: the one-launch call runs them chunk by chunk (one launch
    per chunk from one binding call). Sizes of one to several chunks, both residuals, pow2 off and "auto"
    beyond its window (the exponent of the whole message, taken by the first chunk), 4 and 8 bits, fp32
    and bf16, and a captured chunked call replayed with new inputs: outputs and states are the emulator's."""
    from echo_ds.p2p import EchoBuffer

    buf = EchoBuffer(max_numel=1 << 14, timeout_s=cfg.get("timeout_s", 10.0), stages="fused")
    assert buf.active and buf.one_launch is not None, buf.reason
    num = 0
    for i, n in enumerate((1000, 50_001, 200_003, 333_333)):
        for residual, pow2, bits, dtype in (("local", "auto", 4, torch.bfloat16), ("output", False, 8, torch.float32),
                                            (None, True, 4, torch.float32)):
            spec = QuantSpec(bits, 64, "zero_aware_int" if bits == 4 else "zero_aware", rotation=residual == "local")
            dcfg = DirectionConfig(residual=residual or "local", gain=0.9)
            comp = make_compensator(dcfg) if residual else None
            comp_emul = make_compensator(dcfg) if residual else None
            for call in range(2):
                parts = parts_for(P, n, dtype, 7000 + 10 * i + call, device, 1e5 if pow2 == "auto" else 1.0)
                y = buf.all_reduce(parts[rank], spec, compensator=comp, pow2_rescale=pow2)
                expected = spec_on_device(parts, spec, comp_emul, pow2)
                buf.synchronize()
                what = f"chunked n={n} {dtype} bits={bits} residual={residual} pow2={pow2} call {call}: rank {rank}"
                assert same_bits(y, expected), f"{what}: output differs from the emulator"
                if comp is not None:
                    assert same_state(comp, comp_emul, rank), f"{what}: state differs from the emulator's"
                num += 1
    # graph replay of a chunked call
    n, spec = 200_003, QuantSpec(4, 64, "zero_aware_int", rotation=True)
    comp, comp_emul = make_compensator(DirectionConfig()), make_compensator(DirectionConfig())
    inputs = [parts_for(P, n, torch.bfloat16, 7500 + j, device) for j in range(4)]
    static_x = inputs[0][rank].clone()
    y0 = buf.all_reduce(static_x, spec, compensator=comp)  # eager: builds the plan and the state
    assert same_bits(y0, spec_on_device(inputs[0], spec, comp_emul)), "chunked eager call before capture"
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = buf.all_reduce(static_x, spec, compensator=comp)
    for j in range(1, 4):
        static_x.copy_(inputs[j][rank])
        graph.replay()
        buf.synchronize()
        assert same_bits(static_y, spec_on_device(inputs[j], spec, comp_emul)), f"chunked replay {j}: rank {rank}"
        assert same_state(comp, comp_emul, rank), f"chunked replay {j}: state differs"
        num += 1
    num += check_plain(buf, rank, P, device, sizes=(333_333,))
    buf.close()
    return num


def same_as_emulator(buf, parts, rank, spec, comp, comp_emul, pow2, what, **kwargs):
    """One call of ``buf`` on this rank's part, and the emulator's of the same call: the outputs and, with a
    compensator, the states bit-identical (``what`` names the call in the assertion)."""
    y = buf.all_reduce(parts[rank], spec, compensator=comp, pow2_rescale=pow2, **kwargs)
    expected = spec_on_device(parts, spec, comp_emul, pow2)
    buf.synchronize()
    assert same_bits(y, expected), f"{what}: output differs from the emulator"
    if comp is not None:
        assert same_state(comp, comp_emul, rank), f"{what}: state differs from the emulator's"


def check_plans(buf, rank, P, device, n=5000):
    """The one-launch plans (P2PRuntime.plan: built once per call key, coefficients and descriptor included):
    compensators of two configurations that differ only in their coefficients, interleaved at one site and size;
    a fresh compensator of the first configuration (no state yet: the runtime refuses the call, the buffer
    allocates the state and calls again); and a reset mid-way. Every output and state is the emulator's."""
    spec = QuantSpec(4, 64, "zero_aware_int", rotation=True)
    cfgs = {"a": DirectionConfig(gain=0.9), "b": DirectionConfig(gain=0.5, blend=0.25)}
    comps = {k: (make_compensator(c), make_compensator(c)) for k, c in cfgs.items()}
    num = 0
    for call, which in enumerate("ababa" + "c" + "ab"):
        if which == "c":  # a new compensator of configuration "a", then the rest goes on with it
            comps["a"] = (make_compensator(cfgs["a"]), make_compensator(cfgs["a"]))
            which = "a"
        if call == 7:
            for c in comps["b"]:
                c.reset()
        comp, comp_emul = comps[which]
        parts = parts_for(P, n, torch.bfloat16, 8100 + call, device)
        same_as_emulator(buf, parts, rank, spec, comp, comp_emul, False, f"plans: call {call} with compensator "
                         f"{which!r}: rank {rank}", site=3)
        num += 1
    # One compensator at two lengths by turns (two plans): the state of the other length is not fed back but
    # allocated again at each change, as the emulator's compensator does.
    comp, comp_emul = comps["a"]
    for call, m in enumerate((2 * n + 3, n, 2 * n + 3, n)):
        parts = parts_for(P, m, torch.bfloat16, 8200 + call, device)
        same_as_emulator(buf, parts, rank, spec, comp, comp_emul, False,
                         f"plans: length {m} by turns, call {call}: rank {rank}", site=3)
        num += 1
    assert comp.num_resizes == comp_emul.num_resizes == 4, (comp.num_resizes, comp_emul.num_resizes)
    if buf.one_launch is not None:
        keys = [k for k in buf.one_launch.plans if k[1] == n and k[6] == 3]
        assert len(keys) == 2, f"one plan per coefficient set, got {len(keys)}"
    return num


def check_one_shot(buf, rank, P, device):
    """The one-shot variant of the one-launch call (16-bit x up to buf.one_shot_max_bytes, P = 2 and 4) against a
    buffer that runs every call two-shot (one_shot_max_bytes=0) and against the emulator: sizes from one element
    to the threshold and one above it, 4 and 8 bits, every residual, pow2 off and "auto", bf16 and fp16, calls
    back to back (the regions' two parities), and a CUDA graph of one-shot calls replayed with new inputs.
    Returns the number of calls compared."""
    from echo_ds.p2p import EchoBuffer, policy

    if P not in policy.ONE_SHOT_WORLD_SIZES:
        return 0
    # The one-shot buffer takes the policy's largest threshold whatever the ranks per GPU (where they share one,
    # the default may be two-shot only).
    one = EchoBuffer(max_numel=buf.capacity.max_numel, stages="fused", one_shot_max_bytes=policy.kOneShotMaxBytes)
    two = EchoBuffer(max_numel=buf.capacity.max_numel, stages="fused", one_shot_max_bytes=0)
    assert one.active and two.active and two.capacity.shot_numel == 0, (one.reason, two.reason)
    buf = one
    top = min(buf.capacity.shot_numel, buf.one_shot_max_bytes // 2)
    num = 0
    cases = [(4, None, False, torch.bfloat16), (8, "local", "auto", torch.float16),
             (4, "output", False, torch.bfloat16), (4, "local", False, torch.bfloat16)]
    for i, (bits, residual, pow2, dtype) in enumerate(cases):
        spec = QuantSpec(bits, (64, 128, 256, 64)[i], "zero_aware_int" if bits == 4 else "zero_aware", rotation=i != 2)
        dcfg = DirectionConfig(residual=residual or "local", gain=0.9)
        comps = [make_compensator(dcfg) if residual else None for _ in range(3)]  # one-shot, two-shot, emulator
        for call, n in enumerate((1, 1000, 4097, top // 3 + 5, top, top + 1, 777)):
            parts = parts_for(P, n, dtype, 9100 + 10 * i + call, device, 1e5 if pow2 == "auto" else 1.0)
            y1 = buf.all_reduce(parts[rank], spec, compensator=comps[0], pow2_rescale=pow2)
            y2 = two.all_reduce(parts[rank], spec, compensator=comps[1], pow2_rescale=pow2)
            expected = spec_on_device(parts, spec, comps[2], pow2)
            buf.synchronize()
            two.synchronize()
            what = f"one-shot n={n} {dtype} bits={bits} residual={residual} pow2={pow2} call {call}: rank {rank}"
            assert same_bits(y1, expected), f"{what}: the one-shot output differs from the emulator"
            assert same_bits(y2, expected), f"{what}: the two-shot output differs from the emulator"
            if residual:
                assert same_state(comps[0], comps[2], rank), f"{what}: one-shot state differs from the emulator's"
                assert same_state(comps[1], comps[2], rank), f"{what}: two-shot state differs from the emulator's"
            num += 1
    # graph replay of one-shot calls (three per replay: both parities, replay after replay)
    n, spec = top // 2, QuantSpec(4, 64, "zero_aware_int", rotation=True)
    comp, comp_emul = make_compensator(DirectionConfig()), make_compensator(DirectionConfig())
    inputs = [parts_for(P, n, torch.bfloat16, 9500 + j, device) for j in range(4)]
    static_x = inputs[0][rank].clone()
    buf.all_reduce(static_x, spec, compensator=comp)  # eager: the plan and the state
    spec_on_device(inputs[0], spec, comp_emul)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = [buf.all_reduce(static_x, spec, compensator=comp) for _ in range(3)]
    for j in range(1, 4):
        static_x.copy_(inputs[j][rank])
        graph.replay()
        buf.synchronize()
        for c, y in enumerate(ys):
            assert same_bits(y, spec_on_device(inputs[j], spec, comp_emul)), \
                f"one-shot replay {j} call {c}: rank {rank}"
        assert same_state(comp, comp_emul, rank), f"one-shot replay {j}: state differs"
        num += 3
    one.close()
    two.close()
    return num


def check_state_formats(buf, rank, P, device, n=4097):
    """Compensators that store their state in each format, named ("int4", "int8", "bf16": the other checks
    hold the default), on whatever path the buffer runs (the one launch, the staged kernels, the torch
    stages): both residuals, pow2 never / always / "auto" beyond its window, 4 and 8 bits, the three dtypes;
    outputs and every state tensor are the emulator's, call after call."""
    num = 0
    cases = [(4, "local", "auto", torch.bfloat16, 1e5), (8, "local", False, torch.float32, 1.0),
             (4, "output", True, torch.float16, 1e-4), (4, "local", False, torch.bfloat16, 1.0)]
    for state_dtype in STATE_DTYPES:
        for i, (bits, residual, pow2, dtype, scale) in enumerate(cases):
            dcfg = DirectionConfig(state_dtype=state_dtype, residual=residual, gain=0.9)
            comp, comp_emul = make_compensator(dcfg), make_compensator(dcfg)
            spec = QuantSpec(bits, (64, 128, 256, 64)[i], "zero_aware_int" if bits == 4 else "zero_aware",
                             rotation=i != 1)
            for call in range(3):
                parts = parts_for(P, n + 61 * i, dtype, 6000 + 10 * i + call, device, scale)
                x = parts[rank]
                assert buf.would_use_p2p(x, spec, comp), "every path holds every state format"
                y = buf.all_reduce(x, spec, compensator=comp, pow2_rescale=pow2)
                expected = spec_on_device(parts, spec, comp_emul, pow2)
                buf.synchronize()
                what = f"state_dtype={state_dtype} {dtype} bits={bits} {residual} pow2={pow2} call {call}: rank {rank}"
                assert same_bits(y, expected), f"{what}: output differs from the emulator"
                assert same_state(comp, comp_emul, rank), f"{what}: state differs from the emulator's"
                num += 1
    return num


def check_formats_chunked(rank, P, device, cfg):
    """The "int8" and "int4" states in a workspace smaller than the message: chunk by chunk, with the pow2
    exponent of the whole message; outputs and states are the emulator's. (check_chunked replays a chunked
    call from a CUDA graph with the default state, int4.)"""
    from echo_ds.p2p import EchoBuffer

    buf = EchoBuffer(max_numel=1 << 14, timeout_s=cfg.get("timeout_s", 10.0), stages="fused")
    assert buf.active and buf.one_launch is not None, buf.reason
    num = 0
    spec = QuantSpec(4, 64, "zero_aware_int", rotation=True)
    for state_dtype in ("int4", "int8"):
        dcfg = DirectionConfig(state_dtype=state_dtype)
        comp, comp_emul = make_compensator(dcfg), make_compensator(dcfg)
        for call in range(2):
            parts = parts_for(P, 200_003, torch.bfloat16, 8000 + call, device, 1e5)
            y = buf.all_reduce(parts[rank], spec, compensator=comp, pow2_rescale="auto")
            expected = spec_on_device(parts, spec, comp_emul, "auto")
            buf.synchronize()
            what = f"chunked {state_dtype} call {call}: rank {rank}"
            assert same_bits(y, expected), f"{what}: output differs from the emulator"
            assert same_state(comp, comp_emul, rank), f"{what}: state differs"
            num += 1
    buf.close()
    return num


def check_registered(buf, rank, P, device, n=4097):
    """The buffer is its group's backend: echo_all_reduce (the custom op) runs on it, with the emulator's
    bits, and inside collective.reference_only() it does not."""
    spec = QuantSpec(4, 64, "zero_aware_int", rotation=True)
    parts = parts_for(P, n, torch.bfloat16, 6500, device)
    before = buf.num_calls
    y = echo_all_reduce(parts[rank], spec)
    assert buf.num_calls == before + 1, "echo_all_reduce did not run on the group's EchoBuffer"
    assert same_bits(y, spec_on_device(parts, spec)), f"echo_all_reduce through the buffer: rank {rank} differs"
    with collective.reference_only():
        y_ref = echo_all_reduce(parts[rank].cpu(), spec)
    assert buf.num_calls == before + 1, "reference_only() still ran the buffer"
    assert same_bits(y, y_ref), f"the reference differs from the buffer: rank {rank}"
    return 2


def check_graph(buf, rank, P, device, n=100_003, replays=4):
    """Capture one compensated call (rotation, pow2) and replay it with new inputs; eager calls before
    and after; the outputs and the compensator sequence must be the emulator's."""
    dcfg = DirectionConfig(gain=0.8)
    comp, comp_emul = make_compensator(dcfg), make_compensator(dcfg)
    spec = QuantSpec(4, 128, "zero_aware", rotation=True)
    inputs = [parts_for(P, n, torch.float16, 9000 + i, device, 1e-3) for i in range(replays + 3)]
    static_x = inputs[0][rank].clone()
    y0 = buf.all_reduce(static_x, spec, compensator=comp, pow2_rescale=True)  # eager warm-up: schedule, state
    assert same_bits(y0, spec_on_device(inputs[0], spec, comp_emul, True)), "graph: the eager warm-up differs"
    buf.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = buf.all_reduce(static_x, spec, compensator=comp, pow2_rescale=True)

    def replay(i):
        static_x.copy_(inputs[i][rank])
        dist.barrier()
        graph.replay()
        expected = spec_on_device(inputs[i], spec, comp_emul, True)
        buf.synchronize()
        assert same_bits(static_y, expected), f"graph replay of inputs {i}: output differs from the emulator"
        assert same_state(comp, comp_emul, rank), f"graph replay of inputs {i}: state differs"
        assert all_same(digest(static_y)), f"graph replay of inputs {i}: ranks differ"

    for i in range(1, replays + 1):
        replay(i)
    # An eager call after the replays (the device flag base advanced with every replay), then one more replay.
    y = buf.all_reduce(inputs[replays + 1][rank], spec, compensator=comp, pow2_rescale=True)
    assert same_bits(y, spec_on_device(inputs[replays + 1], spec, comp_emul, True)), \
        "graph: the eager call after the replays differs"
    replay(replays + 2)
    return replays + 1


def check_stress(buf, rank, P, device, num_calls, sizes, sample_every):
    """Back-to-back calls of mixed sizes, no host synchronisation in between; every output folded into
    a digest compared across ranks at the end, sampled calls compared with the emulator."""
    base = parts_for(1, max(sizes), torch.float32, 77, device)[0]
    spec = QuantSpec(4, 128)
    running = torch.zeros((), dtype=torch.int64, device=device)
    weights = torch.arange(max(sizes), device=device, dtype=torch.int64) % 65521 + 1
    t0 = time.perf_counter()
    num_checked = 0
    for call in range(num_calls):
        n = sizes[call % len(sizes)]
        dtype = (torch.bfloat16, torch.float16)[call % 2]
        x = (base[:n] * (1.0 + 0.25 * rank) + 1e-3 * (call % 97)).to(dtype)
        y = buf.all_reduce(x, spec)
        running += (y.view(torch.int16).to(torch.int64) * weights[:n]).sum() * (call % 1009 + 1)
        if call % sample_every == sample_every - 1:
            if rank == 0:
                parts = torch.stack([(base[:n] * (1.0 + 0.25 * r) + 1e-3 * (call % 97)).to(dtype) for r in range(P)])
                assert same_bits(y, emulated_echo_all_reduce(parts, spec)), f"stress call {call}: differs"
            num_checked += 1
    buf.synchronize()
    secs = time.perf_counter() - t0
    assert all_same(int(running)), "stress: the ranks' digests differ"
    return secs, num_checked


def largest(rank, world_size, cfg):
    """The top of the range the transport is specified for: ``cfg["sizes"]`` (1 GiB of bf16) through an EchoBuffer of
    the default workspace (kDefaultMaxNumel: the one-launch call takes such a message chunk by chunk under every
    stages setting), compensated and not, rotated and not, against the emulator on rank 0 and across ranks."""
    from echo_ds.p2p import EchoBuffer

    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    buf = EchoBuffer(timeout_s=cfg.get("timeout_s", 10.0), stages=cfg.get("stages", "auto"))
    assert buf.active and buf.one_launch is not None, buf.reason
    lines = check_sizes(buf, rank, world_size, device, cfg["sizes"], every_rank_below=0)
    for line in lines:
        log(rank, f"P={world_size}: {line} (workspace of {buf.capacity.max_numel} elements)")
    buf.close()
    return {"lines": lines}


def suite(rank, world_size, cfg):
    """Everything but the killed rank; ``cfg``: transport, device kind, sizes, stress length."""
    from echo_ds.p2p import EchoBuffer

    P = world_size
    cuda = cfg["transport"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    out = []
    t0 = time.perf_counter()
    buf = EchoBuffer(max_numel=cfg["max_numel"], timeout_s=cfg.get("timeout_s", 10.0),
                     tile_bytes=cfg.get("tile_bytes", 1 << 20), transport=transport_arg(cfg["transport"]),
                     stages=cfg.get("stages", "auto"))
    assert buf.active, buf.reason
    table = buf.table
    assert len(table) == 3 * P + 1 and len(set(table)) == 3 * P + 1, table
    if buf.one_launch is not None:
        stages = (f"one launch per call (echo_ds.ops P2PRuntime, grid <= {buf.one_launch.max_blocks} blocks; group "
                  f"size 16 on the reference path)")
    else:
        stages = ("staged kernels of echo_ds.ops (group size 16 on the reference path)" if buf._ops is not None
                  else "the host transport's torch stages")
    if cfg.get("stages") in ("kernels", "fused"):
        assert buf._ops is not None, "the kernels of echo_ds.ops did not load"
    if cfg.get("stages") == "fused":
        assert buf.one_launch is not None, "the one-launch call is off"
    out.append(f"P={P}: EchoBuffer up in {time.perf_counter() - t0:.2f} s (probe passed, table of {len(table)} "
               f"addresses, stages: {stages})")
    log(rank, out[-1])
    cpu_ref = CpuReference(cfg.get("cpu_reference", "assert"))
    n_opt = check_options(buf, rank, P, device, cfg["option_numel"], cpu_ref, cfg.get("option_stride", 1))
    log(rank, f"P={P}: {n_opt} option combinations (of 3 dtypes x 2 bits x {len(QUANTIZERS)} quantizers x 2 rotations, group "
              f"sizes 16..256, pow2 on a third) bit-identical to the emulator on this device and across ranks")
    n_comp = check_compensated(buf, rank, P, device, cfg["option_numel"], cpu_ref, cfg.get("comp_calls", 4))
    log(rank, f"P={P}: {n_comp} compensated calls (output/local residual x pow2 off/on): outputs and both "
              f"averages bit-identical to the emulator's")
    check_nonfinite(buf, rank, P, device, cpu_ref)
    log(rank, f"P={P}: NaN/inf inputs propagate exactly as in the emulator")
    log(rank, f"P={P}: {cpu_ref.summary()} (rank 0; mode {cpu_ref.mode})")
    for line in check_sizes(buf, rank, P, device, cfg["sizes"], cfg["emulator_from"]):
        log(rank, f"P={P}: {line}")
    if cfg.get("stress_calls"):
        secs, checked = check_stress(buf, rank, P, device, cfg["stress_calls"], cfg["stress_sizes"],
                                     cfg["stress_sample_every"])
        log(rank, f"P={P}: {cfg['stress_calls']} back-to-back calls of {len(cfg['stress_sizes'])} mixed sizes in "
                  f"{secs:.1f} s ({cfg['stress_calls'] / secs:.0f} calls/s per rank): no hang, digests equal on "
                  f"every rank, {checked} sampled calls bit-identical to the emulator")
    check_registered(buf, rank, P, device)
    log(rank, f"P={P}: echo_all_reduce on the group runs on its EchoBuffer (the registered backend of the "
              f"custom op), bit-identical to the emulator and to the reference")
    n_formats = check_state_formats(buf, rank, P, device)
    log(rank, f"P={P}: {n_formats} calls with the compensator state in each format ({', '.join(STATE_DTYPES)}) on "
              f"the p2p transport ({stages}): outputs and states bit-identical to the emulator's")
    if cuda and buf.one_launch is not None and cfg.get("chunked", True):
        n_narrow = check_formats_chunked(rank, P, device, cfg)
        log(rank, f"P={P}: {n_narrow} calls with an int4 or int8 state chunk by chunk: outputs and states "
                  f"bit-identical to the emulator's")
    if cuda and buf.one_launch is not None:
        n_plans = check_plans(buf, rank, P, device)
        log(rank, f"P={P}: {n_plans} calls by the runtime's plans (two coefficient sets at one site, a new "
                  f"compensator, a reset): outputs and states bit-identical to the emulator's")
        n_shot = check_one_shot(buf, rank, P, device)
        log(rank, f"P={P}: {n_shot} calls one-shot (up to 256 KiB of 16-bit x; this buffer's default: "
                  f"{buf.one_shot_max_bytes} bytes) beside a two-shot buffer: both bit-identical to the emulator, "
                  f"outputs and states; graph replay")
        n_plain = check_plain(buf, rank, P, device)
        log(rank, f"P={P}: {n_plain} unquantized calls (plain_all_reduce: 3 dtypes, 1 element to 1 M, NaN, fp16 "
                  f"saturation) bit-identical to the rank-order fp32 sum and across ranks")
    if cuda and cfg.get("chunked", True):
        n_chunked = check_chunked(rank, P, device, cfg)
        log(rank, f"P={P}: {n_chunked} calls in a workspace of 16 Ki elements (messages of 1 to 7 chunks, both "
                  f"residuals, pow2, 4/8 bits, graph replay): outputs and states bit-identical to the emulator's")
    if cuda and cfg.get("graph", True):
        n_rep = check_graph(buf, rank, P, device)
        log(rank, f"P={P}: CUDA graph: {n_rep} replays with new inputs (compensated, rotation, pow2) and an eager "
                  f"call between them: outputs and state bit-identical to the emulator's")
    calls = buf.transport.call_index()
    if not cfg.get("leave_open"):  # else interpreter exit closes it (the atexit path)
        buf.close()
    return {"lines": out, "device_calls": int(calls)}


def killed_body(rank, world_size, cfg):
    """Rank P - 1 dies in the middle of call ``cfg['kill_call']`` (after its push); the others must
    fail with EchoP2PTimeout naming rank, peer, stage and call within the timeout."""
    from echo_ds.p2p import EchoBuffer, EchoP2PTimeout

    P = world_size
    cuda = cfg["transport"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    # stages "kernels" (default) tests the staged transport (on the host transport: its torch stages); "fused"
    # the one launch.
    stages = cfg.get("stages", "kernels")
    buf = EchoBuffer(max_numel=1 << 20, timeout_s=cfg["timeout_s"], transport=transport_arg(cfg["transport"]), stages=stages)
    assert buf.active, buf.reason
    if stages == "fused":
        assert buf.one_launch is not None, "the one-launch call is off"
    if rank == P - 1:
        buf._fault = (cfg["kill_call"], "exit_after_push")
    spec = QuantSpec(4, 128)
    x = parts_for(P, 50_000, torch.float32, 3, device)[rank]
    t_start = None
    for call in range(1, cfg["kill_call"] + 3):
        t_start = time.perf_counter()
        try:
            buf.all_reduce(x, spec)
            buf.synchronize()
        except EchoP2PTimeout as e:
            waited = time.perf_counter() - t_start
            msg = str(e)
            buf.close(abort=True, barrier=False)
            return {"call": call, "waited_s": waited, "message": msg}
    raise AssertionError(f"rank {rank}: no EchoP2PTimeout after rank {P - 1} died")


def one_shot_disagree_body(rank, P, cfg):
    """Ranks that build their EchoBuffer with different one_shot_max_bytes: the message of the ValueError each
    rank raises (or "no error")."""
    from echo_ds.p2p import EchoBuffer

    torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        buf = EchoBuffer(max_numel=1 << 16, stages="fused", one_shot_max_bytes=0 if rank == 0 else 1 << 18)
    except ValueError as e:
        return str(e)
    buf.close()
    return "no error"


def mismatch_body(rank, world_size, cfg):
    """The last rank calls with a different ``cfg['field']`` (bits or element count) in call 3 of the
    one-launch path; every rank must raise EchoP2PMismatch naming the field, within the timeout."""
    from echo_ds.p2p import EchoBuffer, EchoP2PMismatch

    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    buf = EchoBuffer(max_numel=1 << 20, timeout_s=cfg["timeout_s"], stages="fused")
    assert buf.active and buf.one_launch is not None, buf.reason
    odd = rank == world_size - 1
    t0 = time.perf_counter()
    for call in range(1, 6):
        n, bits = 1000, 4
        if call == 3 and odd:
            n, bits = (1020, 4) if cfg["field"] == "numel" else (1000, 8)
        x = torch.randn(n, device=device, dtype=torch.bfloat16)
        try:
            buf.all_reduce(x, QuantSpec(bits, 128))
            buf.synchronize()
        except EchoP2PMismatch as e:
            msg = str(e)
            buf.close(abort=True, barrier=False)
            return {"call": call, "message": msg, "waited_s": time.perf_counter() - t0}
    raise AssertionError(f"rank {rank}: no EchoP2PMismatch")


# ----------------------------------------------------------------------------------------------------
# Mixed calls of one group, any of which any rank can check (tests/test_groups_gpu.py,
# tests/test_faults_gpu.py)
# ----------------------------------------------------------------------------------------------------

# (spec, residual or None, pow2 mode, dtype or None): 4 and 8 bits, compensated with both residuals or not.
# A compensated configuration keeps one dtype (and one size: MixedCalls), so that its state carries from
# call to call; an uncompensated one cycles through the dtypes.
MIX_CONFIGS = (
    (QuantSpec(4, 64, "zero_aware_int", True), None, "auto", None),
    (QuantSpec(4, 128, "zero_aware", False), "local", True, torch.bfloat16),
    (QuantSpec(8, 64, "zero_aware", True), "output", False, torch.float32),
    (QuantSpec(8, 256, "zero_aware_int", False), None, True, None),
)


class MixedCalls:
    """An endless sequence of mixed Echo calls on one group of ``world_size`` ranks (MIX_CONFIGS in turn,
    starting at ``offset``): every rank's input of call c comes from the seed ``seed`` and c, so that any
    rank can form the specification of any call (the emulator on its device, with every rank's input).

    sizes: the uncompensated calls' element counts, in turn; comp_numel: the compensated calls' one count.
    A compensated configuration's emulated state must follow every one of its calls, so ``run`` emulates
    each of them; the uncompensated ones only where asked.
    """

    def __init__(self, world_size, rank, device, sizes, comp_numel, seed, offset=0):
        self.world_size, self.rank, self.device = world_size, rank, device
        self.sizes, self.comp_numel, self.seed, self.offset = tuple(sizes), comp_numel, seed, offset
        # config index -> (this rank's compensator, the emulator's, which holds every rank's state)
        self.states = {i: (make_compensator(DirectionConfig(residual=r)), make_compensator(DirectionConfig(residual=r)))
                       for i, (_, r, _, _) in enumerate(MIX_CONFIGS) if r is not None}

    def config(self, call):
        """(config index, spec, residual, pow2, dtype, numel) of call ``call``."""
        ci = (call + self.offset) % len(MIX_CONFIGS)
        spec, residual, pow2, dtype = MIX_CONFIGS[ci]
        if residual is None:
            dtype = DTYPES[(call // len(MIX_CONFIGS)) % len(DTYPES)]
            n = self.sizes[(call // len(MIX_CONFIGS)) % len(self.sizes)]
        else:
            n = self.comp_numel
        return ci, spec, residual, pow2, dtype, n

    def parts(self, call):
        """Every rank's input of call ``call``: [P, n]."""
        _, _, _, _, dtype, n = self.config(call)
        return parts_for(self.world_size, n, dtype, self.seed + 7919 * call, self.device)

    def run(self, reduce, call, check):
        """Make call ``call`` as ``reduce(x, spec, compensator, pow2)``; returns (its output, the emulator's
        result where ``check`` or the call is compensated, else None). Compare only after the backend
        raised what it had to raise: a failed call's output is undefined."""
        ci, spec, residual, pow2, _, _ = self.config(call)
        parts = self.parts(call)
        comp, comp_emul = self.states.get(ci, (None, None))
        y = reduce(parts[self.rank].clone(), spec, comp, pow2)
        expected = emulated_echo_all_reduce(parts, spec, comp_emul, pow2) if check or residual else None
        return y, expected

    def is_compensated(self, call):
        return self.config(call)[2] is not None
