"""Range: a message outside what fp16 group parameters express is rescaled by an exact power of two
("auto", the forward default), never clipped or flushed to zero; inside the window "auto" changes no bit.
With ``pow2_rescale=False`` such a message is never silent: the call counts it (algorithm.range_events)
and warns once, naming the setting. Also the refusal of inputs that require grad. Emulator and argument
checks, and one 2-rank gloo run of the reference for the counters (the reference over gloo is compared
with the emulator in tests/test_reference.py, "auto" cases included)."""

import inspect
import logging
import math

import pytest
import torch

from echo_ds import algorithm as A
from echo_ds.compensator import make_compensator
from echo_ds.config import DirectionConfig, EchoConfig
from echo_ds.emulate import emulated_echo_all_reduce
from echo_ds.p2p import protocol as proto
from echo_ds.quant import QuantSpec
from echo_ds.reference import echo_all_reduce
from host_transport import transport_arg
from utils import run_distributed, same_states, state_moved

SPECS = (QuantSpec(4, 128, "zero_aware", True), QuantSpec(4, 64, "symmetric", False), QuantSpec(8, 64))


def parts(P, n, scale, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(P, n, generator=g) * scale).to(dtype)


def relative_error(y, exact):
    return float((y.float() - exact).norm() / exact.norm())


def below(v: float) -> torch.Tensor:
    """The fp32 value just below ``v``."""
    return torch.nextafter(torch.tensor(v), torch.tensor(0.0))


def test_auto_exponent_window():
    lo, hi = A.kAutoLow, A.kAutoHigh
    for a in (torch.tensor(lo), torch.tensor(1.0), torch.tensor(3.0e4), below(hi)):
        assert A.pow2_exponent(a, "auto") == 0, a
    for a in (below(lo), torch.tensor(1e-9), torch.tensor(hi), torch.tensor(1e6), torch.tensor(3e38)):
        k = A.pow2_exponent(a, True)
        assert k != 0 and A.pow2_exponent(a, "auto") == k, a
    for a in (0.0, math.inf, math.nan):
        assert A.pow2_exponent(torch.tensor(a), "auto") == 0
    assert A.pow2_exponent(torch.tensor(1e6), False) == 0


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("residual", (None, "local", "output"))
def test_auto_inside_the_window_changes_no_bit(spec, residual):
    dcfg = None if residual is None else DirectionConfig(residual=residual)
    ca, cn = (make_compensator(dcfg) if dcfg else None for _ in range(2))
    for call, scale in enumerate((1.0, 30.0, 0.1)):
        x = parts(4, 999, scale, call, torch.bfloat16)
        auto = emulated_echo_all_reduce(x, spec, ca, "auto")
        never = emulated_echo_all_reduce(x, spec, cn, False)
        assert torch.equal(auto, never), (call, scale)
        if ca is not None:
            assert same_states(ca, cn)


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("scale", (1e6, 1e-9))
def test_auto_outside_the_window_is_the_rescaling(spec, scale):
    ca, ct = (make_compensator(DirectionConfig(residual="local")) for _ in range(2))
    for call in range(3):
        x = parts(2, 700, scale, 10 + call)
        assert torch.equal(emulated_echo_all_reduce(x, spec, ca, "auto"), emulated_echo_all_reduce(x, spec, ct, True))
    assert same_states(ca, ct) and state_moved(ca)


@pytest.mark.parametrize("scale", (1e6, 3e7, 1e-8, 1e-12))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_out_of_range_messages_keep_their_accuracy(scale, dtype):
    """fp32 / bf16 messages far above what an fp16 scale expresses (~4.9e5 at 4 bits) or far below it:
    "auto" keeps the error of an in-range message; without rescaling they are clipped or flushed."""
    spec = QuantSpec(4, 128, rotation=True)
    x = parts(2, 4096, scale, 3, dtype)
    exact = x.float().sum(0)
    typical = relative_error(emulated_echo_all_reduce(x / scale, spec, None, False), (x / scale).float().sum(0))
    assert typical < 0.2
    assert relative_error(emulated_echo_all_reduce(x, spec, None, "auto"), exact) < 1.01 * typical + 1e-3
    assert relative_error(emulated_echo_all_reduce(x, spec, None, False), exact) > 0.5  # what "auto" prevents


def test_defaults_are_auto_forward_and_always_backward():
    cfg = EchoConfig()
    assert cfg.forward.pow2_rescale == "auto" and cfg.backward.pow2_rescale is True
    assert EchoConfig(forward={"pow2_rescale": False}).forward.pow2_rescale is False
    for fn in (echo_all_reduce, emulated_echo_all_reduce):
        assert inspect.signature(fn).parameters["pow2_rescale"].default == "auto", fn
    from echo_ds.p2p.buffer import EchoBuffer
    assert inspect.signature(EchoBuffer.all_reduce).parameters["pow2_rescale"].default == "auto"


@pytest.mark.parametrize("bad", (1, 0, "always", None, "Auto"))
def test_unknown_rescaling_modes_are_refused(bad):
    x = parts(2, 64, 1.0, 0)
    with pytest.raises(ValueError, match="pow2_rescale"):
        emulated_echo_all_reduce(x, QuantSpec(4, 64), None, bad)
    with pytest.raises(ValueError, match="pow2_rescale"):
        echo_all_reduce(x[0], QuantSpec(4, 64), pow2_rescale=bad)  # refused before any collective


def test_descriptor_carries_the_mode():
    base = dict(numel=1000, dtype="bfloat16", bits=4, group_size=128, quantizer="zero_aware", rotation=True,
                residual="local", site=3, direction="forward")
    seen = set()
    for mode in (False, True, "auto"):
        d = proto.call_descriptor(pow2=mode, **base)
        assert 0 <= d < 2**32 and proto.decode_descriptor(d)["pow2_rescale"] == mode
        assert proto.decode_descriptor(d)["compensator"] == "local"
        seen.add(d)
    assert len(seen) == 3


def test_inputs_that_require_grad_are_refused_while_autograd_records():
    x = torch.randn(64, requires_grad=True)
    with pytest.raises(TypeError, match="requires grad"):
        echo_all_reduce(x, QuantSpec(4, 64))
    y = x * 2  # a non-leaf with a graph
    with pytest.raises(TypeError, match="no gradient"):
        echo_all_reduce(y, QuantSpec(4, 64))
    # Under no_grad (and inside an autograd Function's forward) the check passes; the call then needs a
    # process group, which this test has none of.
    with torch.no_grad(), pytest.raises((RuntimeError, ValueError), match="(?i)process group|init"):
        echo_all_reduce(x, QuantSpec(4, 64))


# ------------------------------------------------------------------------------------------------------
# pow2_rescale=False: never silent (issue 35)
# ------------------------------------------------------------------------------------------------------

ALL_SPECS = SPECS + (QuantSpec(4, 64, "zero_aware_int", True), QuantSpec(8, 64, "naive"))


class _Captured(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def events(monkeypatch):
    """Fresh counters and a fresh once-only warning state; yields (counters, warnings logged)."""
    from echo_ds import log as echo_log

    monkeypatch.setattr(A, "range_events", A.RangeEvents())
    monkeypatch.setattr(echo_log, "_emitted_once", set())
    handler = _Captured()
    echo_log.logger.addHandler(handler)
    yield A.range_events, handler.messages
    echo_log.logger.removeHandler(handler)


def test_range_flags_are_exact_at_the_edges():
    """clipped: a value more than half a step beyond the grid's end; underflow: the largest group's scale
    below fp16's smallest normal value. Built from known groups, per quantizer."""
    for spec in ALL_SPECS:
        L = 2**spec.bits - 1
        qmax = 2 ** (spec.bits - 1) - 1 if spec.quantizer == "symmetric" else L
        for amax, clipped, underflow in ((65504.0 * qmax * 4, True, False), (65000.0 * qmax / 2, False, False),
                                         (1.0, False, False), (2.0**-15, False, True), (1e-9, False, True)):
            g = torch.linspace(-amax, amax, spec.group_size).view(1, 1, spec.group_size)
            codes, scale, zero = A.quantize_segments(g, spec)
            c, u = A.range_flags(g, scale, zero, spec)
            assert (bool(c), bool(u)) == (clipped, underflow), (spec, amax)
            if not clipped:  # then every value is within the stated bound
                err = (A.dequantize_segments(codes, scale, zero, spec) - g).abs().max()
                assert err <= 0.5 * scale.float().max() * (1 + 2**-10), (spec, amax)
        # a small group next to a normal one is no underflow of the message; a NaN group is neither
        g = torch.stack((torch.linspace(-1, 1, spec.group_size), torch.full((spec.group_size,), 1e-9),
                         torch.full((spec.group_size,), float("nan"))))[None]
        _, scale, zero = A.quantize_segments(g, spec)
        assert [bool(f) for f in A.range_flags(g, scale, zero, spec)] == [False, False], spec


@pytest.mark.parametrize("spec", ALL_SPECS, ids=str)
def test_false_out_of_range_is_counted_and_warned_once(spec, events):
    counters, warned = events
    for scale in (1e-2, 1.0, 1e3):  # in range: nothing to say
        emulated_echo_all_reduce(parts(4, 1000, scale, 1), spec, None, False)
    assert counters == A.RangeEvents() and warned == []
    big, tiny = parts(2, 2000, 1e7, 2), parts(2, 2000, 1e-9, 3)
    for call in range(3):
        y = emulated_echo_all_reduce(big, spec, None, False)
    assert relative_error(y, big.sum(0)) > 0.5  # the numerics are unchanged: still clipped...
    assert counters.clipped_calls == 3 and counters.underflow_calls == 0  # ...but counted
    emulated_echo_all_reduce(tiny, spec, make_compensator(DirectionConfig()), False)
    assert counters.underflow_calls == 1
    assert len(warned) == 2, warned  # once per kind
    assert all("pow2_rescale=False" in m and '"auto"' in m and "echo.forward.pow2_rescale" in m for m in warned)
    assert "clipped" in warned[0] and "flushed" in warned[1]
    for mode in ("auto", True):  # the modes that rescale have nothing to count
        emulated_echo_all_reduce(big, spec, None, mode)
        emulated_echo_all_reduce(tiny, spec, None, mode)
    assert counters.clipped_calls == 3 and counters.underflow_calls == 1


def test_false_message_with_one_tiny_rank_is_no_underflow(events):
    """A rank whose whole contribution is tiny next to its peer's: the sum it reduces is normal."""
    counters, _ = events
    x = parts(2, 2048, 1.0, 4)
    x[0] *= 1e-9
    emulated_echo_all_reduce(x, QuantSpec(4, 64, "zero_aware_int", True), None, False)
    assert counters == A.RangeEvents()


def _reference_range_counts(rank, world_size):
    from echo_ds import algorithm

    spec = QuantSpec(4, 64, "zero_aware_int", True)
    out = []
    for scale in (1.0, 1e7, 1e-9):
        before = (algorithm.range_events.clipped_calls, algorithm.range_events.underflow_calls)
        x = parts(world_size, 3000, scale, 5)
        y = echo_all_reduce(x[rank], spec, pow2_rescale=False)
        out.append((algorithm.range_events.clipped_calls - before[0],
                    algorithm.range_events.underflow_calls - before[1]))
        assert torch.equal(y, emulated_echo_all_reduce(x, spec, None, False))  # numerics unchanged
    return out


def test_reference_counts_what_each_rank_quantized():
    for counts in run_distributed(_reference_range_counts, 2, timeout=60):
        assert counts == [(0, 0), (1, 0), (0, 1)], counts


def test_ties_at_the_largest_group_take_the_largest_scale():
    """Of groups tied at the largest max |v|, the largest scale decides the underflow (the kernels take the
    maximum of (max |v|, scale) pairs): a symmetric-range group next to a one-sided one of the same max."""
    spec = QuantSpec(4, 64, "zero_aware", False)
    a = 2.0**-11  # (max - min) / 15: 2^-10 / 15 (above 2^-14) for the symmetric group, 2^-11 / 15 for the other
    g = torch.stack((torch.linspace(0, a, 64), torch.linspace(-a, a, 64)))[None]
    _, scale, zero = A.quantize_segments(g, spec)
    assert scale.float()[0, 0] < A.kFp16MinNormal <= scale.float()[0, 1], scale
    assert [bool(f) for f in A.range_flags(g, scale, zero, spec)] == [False, False]
    assert [bool(f) for f in A.range_flags(g[:, :1], scale[:, :1], zero[:, :1], spec)] == [False, True]


# (name, parts' scale, the rank whose parts are scaled by 1e-9 or None, (clipped, underflow) on every rank)
GPU_RANGE_CASES = (("in range", 1.0, None, (0, 0)), ("clipped", 1e7, None, (1, 0)),
                   ("underflow", 1e-9, None, (0, 1)), ("one tiny rank", 1.0, 0, (0, 0)))


def _p2p_range_counts(rank, world_size, transport="cuda"):
    """Every case through the p2p backend with pow2_rescale=False: the counts reported per call (after
    synchronize), the results against the emulator, the warnings. "cuda": the one-launch kernel; "host": the
    torch stages (3000 elements; the 40,000-element calls do not fit the staged pipeline's workspace and take
    the reference path)."""
    from echo_ds import algorithm
    from echo_ds import log as echo_log
    from echo_ds.p2p import EchoBuffer
    import p2p_suite

    if transport == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    handler = _Captured()
    echo_log.logger.addHandler(handler)
    # max_numel: the 40,000-element calls run in several chunks (one launch each), counted once per call.
    buf = EchoBuffer(max_numel=1 << 14, timeout_s=20.0, stages="fused" if transport == "cuda" else "auto",
                     transport=transport_arg(transport))
    assert buf.active, buf.reason
    out = []
    for spec in ALL_SPECS:
        for n in (3000, 40_000):
            for name, scale, tiny, _ in GPU_RANGE_CASES:
                x = p2p_suite.parts_for(world_size, n, torch.bfloat16, 7 + n, device, scale)
                if tiny is not None:
                    x[tiny] *= 1e-9
                before = (algorithm.range_events.clipped_calls, algorithm.range_events.underflow_calls)
                y = buf.all_reduce(x[rank].clone(), spec, pow2_rescale=False)
                buf.synchronize()
                counts = (algorithm.range_events.clipped_calls - before[0],
                          algorithm.range_events.underflow_calls - before[1])
                same = p2p_suite.same_bits(y, emulated_echo_all_reduce(x, spec, None, False))
                out.append((str(spec), n, name, counts, same))
    buf.close()
    echo_log.logger.removeHandler(handler)
    return out, [m for m in handler.messages if "pow2_rescale=False" in m]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("world_size", (2, 4))
def test_kernel_counts_range_events_as_the_reference(world_size):
    """pow2_rescale=False on the one-launch kernel: every call whose groups the format could not express is
    counted and warned about, as the reference counts and warns (per rank, what it quantized), one count per
    call however many chunks it takes; the numerics are unchanged (bit-identical to the emulator)."""
    _check_p2p_range_counts(run_distributed(_p2p_range_counts, world_size, timeout=300))


def test_torch_stages_count_range_events_as_the_reference():
    """The same on the host transport (its torch stages, the staged pipeline's CPU oracle)."""
    _check_p2p_range_counts(run_distributed(_p2p_range_counts, 2, "host", timeout=120))


def _check_p2p_range_counts(results):
    expected = {name: counts for name, _, _, counts in GPU_RANGE_CASES}
    for rank, (calls, warned) in enumerate(results):
        for spec, n, name, counts, same in calls:
            assert same, (rank, spec, n, name)
            assert counts == expected[name], (rank, spec, n, name, counts)
        if rank == 0:  # the warnings are rank 0's (log_once(rank=0)), one per kind
            assert len(warned) == 2 and "clipped" in warned[0] and "flushed" in warned[1], warned
