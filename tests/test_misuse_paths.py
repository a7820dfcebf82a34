"""Misuse on the paths that tests/test_misuse_reference.py does not reach through echo_all_reduce: the
custom ops called as they are (torch.ops.echo_ds.all_reduce / all_reduce_compensated) and compiled, the
DeepSpeed mode's site op (torch.ops.echo_ds.site_all_reduce) compiled, the narrow compensator states
("int8", "int4") across ranks, the p2p transport's host stand-in behind the op, and on a GPU the chunked
one-launch call. Every CPU case of one kind runs in one spawn of two gloo ranks; the tests assert on what
the ranks report.
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from echo_ds import algorithm as A
from echo_ds.compensator import make_compensator
from echo_ds.config import DirectionConfig
from echo_ds.quant import QuantSpec
from host_transport import HostTransport
from p2p_suite import same_bits, same_state
from test_misuse_reference import PATHS, compile_counted
from utils import run_distributed

kNumel = 1000
kSpec = QuantSpec(4, 64)
kNarrow = ("int8", "int4")
kRequiresGradMessage = "the input requires grad, but an Echo call records no autograd graph"


def _parts(seed: int, nonfinite: bool = False) -> torch.Tensor:
    """Every rank's contribution [2, kNumel] (each rank builds all of them: the emulator needs them)."""
    parts = torch.randn(2, kNumel, generator=torch.Generator().manual_seed(seed))
    if nonfinite:  # NaN and infinities in three groups of g = 64, on both ranks
        parts[1, 10], parts[1, 300], parts[0, 700] = float("nan"), float("inf"), float("-inf")
    return parts


def _on(path: str, fn):
    """``fn`` as ``path`` runs it (compiled: from a fresh cache, so no recompile limit is reached)."""
    if path == "eager":
        return fn
    torch._dynamo.reset()
    return compile_counted(fn)[0]


# ----------------------------------------------------------------------------------------------------
# The ranks' side
# ----------------------------------------------------------------------------------------------------

def _requires_grad(rank):
    """An input that requires grad: refused by echo_all_reduce, also when it is compiled (at trace time,
    where torch.compile wraps the TypeError in its own error); the raw op, which has no autograd formula,
    returns an output whose backward raises."""
    from echo_ds import collective
    from echo_ds.reference import echo_all_reduce

    x = torch.randn(kNumel, requires_grad=True)
    out = {}
    for path in PATHS:
        try:
            _on(path, lambda t: echo_all_reduce(t, kSpec))(x)
            out[path] = ("returned", "")
        except Exception as e:  # noqa: BLE001 - the test names the class it expects
            out[path] = (type(e).__name__, str(e))
    y = torch.ops.echo_ds.all_reduce(x, collective.group_name(None), kSpec.bits, kSpec.group_size, kSpec.quantizer,
                                     kSpec.rotation, A.pow2_code("auto"), None, None, None)
    try:
        y.sum().backward()
        out["op_backward"] = "returned"
    except RuntimeError as e:
        out["op_backward"] = str(e)
    out["op_requires_grad"] = y.requires_grad
    return out


def _nonfinite(rank):
    """NaN and infinities in a call with a narrow state, on both paths, both residuals: outputs and states
    are the emulator's, the state finite (stored as 0 where this call's residual was not finite), and the
    next, clean call clean."""
    from echo_ds.emulate import emulated_echo_all_reduce
    from echo_ds.reference import echo_all_reduce

    out = {}
    for path in PATHS:
        for state_dtype in kNarrow:
            for residual in ("local", "output"):
                cfg = DirectionConfig(state_dtype=state_dtype, residual=residual)
                comp, comp_emul = make_compensator(cfg), make_compensator(cfg)
                call = _on(path, lambda t: echo_all_reduce(t, kSpec, compensator=comp))
                r = {}
                for i, parts in enumerate((_parts(1, nonfinite=True), _parts(2))):
                    y = call(parts[rank])
                    want = emulated_echo_all_reduce(parts, kSpec, comp_emul)
                    m1, m2 = comp.values()
                    r[f"equal{i}"] = same_bits(y, want) and same_state(comp, comp_emul, rank)
                    r[f"finite{i}"] = bool(torch.isfinite(m1).all() and torch.isfinite(m2).all())
                    if i == 0:
                        # The output residual is x' - y / P: not finite wherever y is NaN, on every rank.
                        nan = A.to_segments(y.isnan().float().reshape(1, -1), A.Layout(kNumel, 2, kSpec.group_size))[0]
                        r["nan_elements"] = int(nan.count_nonzero())
                        r["zero_there"] = bool((m1[nan != 0] == 0).all() and (m2[nan != 0] == 0).all())
                        r["nonzero_elsewhere"] = bool((m1[nan == 0] != 0).any())
                    else:
                        r["clean"] = bool(torch.isfinite(y).all())
                out[(path, state_dtype, residual)] = r
    return out


def _same_state_dict(a: dict, b: dict) -> bool:
    """Equal keys, equal num_calls, and each state tensor equal (or None in both)."""
    same = (lambda s, t: s is t is None or (s is not None and t is not None and torch.equal(s, t)))
    return a.keys() == b.keys() and all(a[k] == b[k] if k == "num_calls" else same(a[k], b[k]) for k in a)


def _state_dicts(rank):
    """A compensator refuses a state_dict of another stored format (ValueError) and stays as it was; one
    that loads its own format's state goes on through the compiled op as the emulator does."""
    from echo_ds.emulate import emulated_echo_all_reduce
    from echo_ds.reference import echo_all_reduce

    out = {}
    for state_dtype in kNarrow:
        cfg = DirectionConfig(state_dtype=state_dtype)
        comp, comp_emul = make_compensator(cfg), make_compensator(cfg)
        other = make_compensator(DirectionConfig(state_dtype="bf16"))
        parts = _parts(3)
        echo_all_reduce(parts[rank], kSpec, compensator=comp)
        emulated_echo_all_reduce(parts, kSpec, comp_emul)
        echo_all_reduce(parts[rank], kSpec, compensator=other)
        saved = comp.state_dict()
        restored = make_compensator(cfg)
        refused = []
        for target in (comp, restored):  # one that has run a call, and a fresh one
            before = target.state_dict()
            try:
                target.load_state_dict(other.state_dict())
                refused.append(("loaded", False))
            except ValueError as e:
                refused.append((str(e), _same_state_dict(before, target.state_dict())))
        restored.load_state_dict(saved)
        parts = _parts(4)
        y = _on("compiled", lambda t: echo_all_reduce(t, kSpec, compensator=restored))(parts[rank])
        want = emulated_echo_all_reduce(parts, kSpec, comp_emul)
        out[state_dtype] = dict(refused=refused, moved=bool(saved[comp.state_names[0]].any()),
                                continued=same_bits(y, want) and same_state(restored, comp_emul, rank)
                                and restored.num_calls == 2)
    return out


def _raw_state_of_another_dtype(rank):
    """The compensated op handed state tensors of another dtype than the compensator's format names."""
    from echo_ds import collective

    comp = make_compensator(DirectionConfig(state_dtype="int4"))
    comp._ensure(collective.state_shape(kNumel, 2, kSpec.group_size), "cpu")
    wrong = [comp.q.to(torch.int8), comp.exponent]  # int4's q is uint8
    try:
        torch.ops.echo_ds.all_reduce_compensated(_parts(5)[rank], wrong, collective.group_name(None), kSpec.bits,
                                                 kSpec.group_size, kSpec.quantizer, kSpec.rotation,
                                                 A.pow2_code("auto"), None, None, None, collective.handle(comp))
        return "returned"
    except ValueError as e:
        return str(e)


# (field, rank 0's config, rank 1's config, whether rank 1 trains, rank 1 visits site 1 instead of 0): the
# DeepSpeed mode's runtimes, one per case, reached through its compiled row-parallel all-reduce.
SITE_CASES = [
    ("state_dtype", {}, {"forward": {"state_dtype": "bf16"}}, True, False),
    ("bits", {}, {"bits": 8}, True, False),
    ("direction", {}, {}, False, False),
    ("site", {}, {}, True, True),
]


def _site_op(rank):
    """Ranks whose DeepSpeed-mode runtimes disagree, through torch.ops.echo_ds.site_all_reduce compiled."""
    import torch.distributed as dist

    from echo_ds.config import EchoConfig
    from echo_ds.deepspeed import FORWARD, EchoRuntime, reduce_from_tensor_parallel_region
    from echo_ds.reference import EchoCallMismatch

    out = {}
    for field, cfg0, cfg1, trains, other_site in SITE_CASES:
        cfg = {"bits": 4, "backend": "reference", "forward": {"state_dtype": "int4"}, **(cfg1 if rank else cfg0)}
        rt = EchoRuntime(EchoConfig(**cfg), dist.group.WORLD, torch.device("cpu"))
        sites = [rt.add_site("blocks.0.o", FORWARD), rt.add_site("blocks.1.o", FORWARD)]
        site = sites[1 if rank and other_site else 0]
        rt.begin_forward_pass(trains if rank else True)
        torch._dynamo.reset()
        call, traced = compile_counted(lambda t: reduce_from_tensor_parallel_region(t, site))
        try:
            call(_parts(6)[rank])
            out[field] = ("returned", "", None, traced(), None)
        except EchoCallMismatch as e:
            out[field] = ("EchoCallMismatch", str(e), e.fields, traced(), rt.forward_state.num_calls)
    return out


def paths_body(rank, world_size, with_deepspeed):
    out = dict(requires_grad=_requires_grad(rank), nonfinite=_nonfinite(rank), state_dicts=_state_dicts(rank),
               raw_state=_raw_state_of_another_dtype(rank))
    if with_deepspeed:
        out["site_op"] = _site_op(rank)
    return out


# ----------------------------------------------------------------------------------------------------
# The tests
# ----------------------------------------------------------------------------------------------------

kWithDeepSpeed = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="module")
def results():
    return run_distributed(paths_body, 2, kWithDeepSpeed, timeout=180)


def test_requires_grad_refused_eager_and_compiled(results):
    for r in results:
        rg = r["requires_grad"]
        assert rg["eager"][0] == "TypeError" and kRequiresGradMessage in rg["eager"][1], rg["eager"]
        # torch.compile(fullgraph=True) raises its own error for an exception raised while it traces,
        # with the TypeError's message in it.
        assert kRequiresGradMessage in rg["compiled"][1], rg["compiled"]


def test_raw_op_with_requires_grad_is_not_silent(results):
    """The op itself has no autograd formula: its output requires grad and its backward raises, rather than
    returning a gradient that skips the all-reduce."""
    for r in results:
        rg = r["requires_grad"]
        assert rg["op_requires_grad"]
        assert "echo_ds.all_reduce" in rg["op_backward"] and "no autograd formula" in rg["op_backward"], rg


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("state_dtype", kNarrow)
@pytest.mark.parametrize("residual", ("local", "output"))
def test_nonfinite_input_with_a_narrow_state(results, path, state_dtype, residual):
    for rank, r in enumerate(results):
        got = r["nonfinite"][(path, state_dtype, residual)]
        assert got["equal0"] and got["equal1"], f"rank {rank}: differs from the emulator: {got}"
        assert got["finite0"] and got["finite1"] and got["clean"], got
        if residual == "output":
            assert got["nan_elements"] >= 3 * kSpec.group_size, got  # three groups of g = 64 at least
            assert got["zero_there"] and got["nonzero_elsewhere"], got


@pytest.mark.parametrize("state_dtype", kNarrow)
def test_state_dict_of_another_format_is_refused_and_a_loaded_state_goes_on(results, state_dtype):
    for r in results:
        got = r["state_dicts"][state_dtype]
        assert got["moved"], "the saved state is zeros: the comparison would prove nothing"
        for refused in got["refused"]:
            message, unchanged = refused
            assert message.startswith("Compensator.load_state_dict: missing keys ['exponent'") \
                and f"for state_dtype {state_dtype!r}" in message, message
            assert unchanged, "a refused load changed the compensator"
        assert got["continued"], "a restored state did not go on through the compiled op as the emulator"


def test_raw_compensated_op_refuses_state_tensors_of_another_dtype(results):
    for r in results:
        assert r["raw_state"] != "returned" and "q" in r["raw_state"], r["raw_state"]


@pytest.mark.skipif(not kWithDeepSpeed, reason="the DeepSpeed mode needs deepspeed")
@pytest.mark.parametrize("case", range(len(SITE_CASES)), ids=[c[0] for c in SITE_CASES])
def test_site_op_compiled_names_the_disagreement(results, case):
    field = SITE_CASES[case][0]
    shown = {"state_dtype": ["int4", "bf16"], "bits": ["4", "8"], "direction": ["forward", "eval"],
             "site": ["0", "1"]}[field]
    hint = {"direction": "eval mode or no_grad", "site": "rank 0: blocks.0.o, rank 1: blocks.1.o"}.get(field, "")
    messages = set()
    for rank, r in enumerate(results):
        kind, message, fields, traced, num_calls = r["site_op"][field]
        assert kind == "EchoCallMismatch", f"rank {rank}: {kind}"
        assert fields == {field: shown}, fields
        assert hint in message, message
        assert len(traced) == 1 and traced[0].startswith("echo_ds.site_all_reduce"), traced  # one graph, the op
        assert num_calls == 0, "the refused call updated the forward state"
        messages.add(message)
    assert len(messages) == 1, messages


# ----------------------------------------------------------------------------------------------------
# The p2p transport behind the op: the host stand-in (CPU), the chunked one-launch call (GPU)
# ----------------------------------------------------------------------------------------------------

def host_mismatch_body(rank, world_size):
    """echo_all_reduce on a group whose registered backend is an EchoBuffer over the host transport (its
    staged pipeline), rank 1 with 8 bits where rank 0 has 4."""
    from echo_ds.p2p import EchoBuffer, EchoP2PError
    from echo_ds.reference import echo_all_reduce

    buf = EchoBuffer(max_numel=1 << 16, timeout_s=5.0, transport=HostTransport)
    assert buf.active, buf.reason
    x = _parts(7)[rank]
    try:
        y = echo_all_reduce(x, QuantSpec(8 if rank else 4, 64))
        buf.synchronize()
        result = ("returned", y)
    except EchoP2PError as e:
        result = (type(e).__name__, str(e))
    ran_on_buffer = buf.num_calls == 1
    buf.close(abort=True, barrier=False)
    return result, ran_on_buffer


@pytest.mark.xfail(strict=True, reason="the staged pipeline carries no call descriptor, and on the host transport "
                   "(tests only) no one-launch runtime gates it (on a GPU one does: "
                   "test_gpu_staged_mismatch_is_named): ranks that call with different bits return different "
                   "results without an error")
def test_host_transport_mismatch_through_the_op_is_named():
    results = run_distributed(host_mismatch_body, 2, timeout=90)
    for rank, (result, ran_on_buffer) in enumerate(results):
        assert ran_on_buffer, "echo_all_reduce did not run on the group's EchoBuffer"
        assert result[0] == "EchoP2PMismatch" and "bits: rank" in result[1], f"rank {rank}: {result}"


kChunkedMaxNumel = 1 << 14  # the workspace: a message of kChunkedNumel runs in many chunks
kChunkedNumel = 200_003


def chunked_mismatch_body(rank, world_size, field):
    """Calls through echo_all_reduce (the op) on a registered one-launch buffer whose workspace holds a
    fraction of the message; in call 3 the last rank passes another element count (and so another number
    of chunks) or a compensator of another state format. Every rank must raise EchoP2PMismatch at that
    call, long before the timeout."""
    from echo_ds.p2p import EchoBuffer
    from echo_ds.reference import echo_all_reduce

    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    buf = EchoBuffer(max_numel=kChunkedMaxNumel, timeout_s=10.0, stages="fused")
    assert buf.active and buf.one_launch is not None, buf.reason
    spec = QuantSpec(4, 64, "zero_aware_int", rotation=True)
    comps = {s: make_compensator(DirectionConfig(state_dtype=s)) for s in kNarrow}
    odd = rank == world_size - 1

    def issue(call):
        n, state_dtype = kChunkedNumel, "int4"
        if call == 3 and odd:
            if field == "numel":
                n += 3 * kChunkedMaxNumel
            else:
                state_dtype = "int8"
        echo_all_reduce(torch.randn(n, device=device, dtype=torch.bfloat16), spec, compensator=comps[state_dtype])

    return _first_mismatch(buf, rank, issue)


def _first_mismatch(buf, rank, issue):
    """Calls 1 to 5 of ``issue(call)``, each synchronised, until one raises EchoP2PMismatch: its call, message,
    seconds since the first call and the buffer's call count; the buffer is then closed (no barrier)."""
    from echo_ds.p2p import EchoP2PMismatch

    t0 = time.perf_counter()
    for call in range(1, 6):
        try:
            issue(call)
            buf.synchronize()
        except EchoP2PMismatch as e:
            result = {"call": call, "message": str(e), "waited_s": time.perf_counter() - t0,
                      "buffer_calls": buf.num_calls}
            buf.close(abort=True, barrier=False)
            return result
    raise AssertionError(f"rank {rank}: no EchoP2PMismatch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("field", ("numel", "state_dtype"))
def test_gpu_chunked_one_launch_mismatch_is_named(field):
    from echo_ds.p2p import protocol as proto

    results = run_distributed(chunked_mismatch_body, 2, field, timeout=180)
    want = {"numel": f"{proto.kHashField}: rank", "state_dtype": "state_dtype: rank"}[field]
    for rank, r in enumerate(results):
        assert r["call"] == 3 and r["buffer_calls"] == 3, r
        assert want in r["message"] and "different arguments" in r["message"], r
        assert r["waited_s"] < 10.0, r


def staged_mismatch_body(rank, world_size, how):
    """A staged call (how "large": 9 Mi bf16 elements, above the 16 MiB hand-over of ranks sharing a GPU;
    "kernels": stages="kernels" at 3001 elements) after two good ones; in call 3 the last rank passes 8 bits
    where the others pass 4. Every rank must raise EchoP2PMismatch at that call (the descriptor gate in
    front of the staged pipeline), long before the timeout."""
    from echo_ds.p2p import EchoBuffer

    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    n = 9 << 20 if how == "large" else 3001
    buf = EchoBuffer(max_numel=n, timeout_s=10.0, stages="auto" if how == "large" else "kernels")
    assert buf.active and buf.gates_staged, buf.reason
    if how == "large":  # the one launch is there, and the message is above its hand-over (ranks share the GPU)
        assert buf.one_launch is not None and 2 * n > buf.one_launch_max_bytes, buf.one_launch_max_bytes
    else:  # stages="kernels": no one-launch call, the runtime only for the gate
        assert buf.one_launch is None

    def issue(call):
        bits = 8 if call == 3 and rank == world_size - 1 else 4
        buf.all_reduce(torch.randn(n, device=device, dtype=torch.bfloat16),
                       QuantSpec(bits, 64, "zero_aware_int" if bits == 4 else "zero_aware", True))

    return _first_mismatch(buf, rank, issue)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("how", ("large", "kernels"))
def test_gpu_staged_mismatch_is_named(how):
    results = run_distributed(staged_mismatch_body, 2, how, timeout=180)
    for rank, r in enumerate(results):
        assert r["call"] == 3 and r["buffer_calls"] == 3, r
        # each rank names itself first: "rank 1 of 2 and rank 0 made call 3 ... (bits: rank 1 8, rank 0 4; ..."
        bits = "bits: rank 0 4, rank 1 8" if rank == 0 else "bits: rank 1 8, rank 0 4"
        assert bits in r["message"] and "different arguments" in r["message"], r
        assert r["waited_s"] < 10.0, r


def pow2_mismatch_body(rank, world_size):
    """One-launch calls; in call 3 the last rank passes pow2_rescale=False where the others rescale ("auto"):
    the rescaling ranks wait for a max it never publishes, and its push flag names the other call."""
    from echo_ds.p2p import EchoBuffer

    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    buf = EchoBuffer(max_numel=1 << 16, timeout_s=10.0, stages="fused")
    assert buf.active and buf.one_launch is not None, buf.reason
    spec = QuantSpec(4, 64, "zero_aware_int", True)

    def issue(call):
        pow2 = False if call == 3 and rank == world_size - 1 else "auto"
        buf.all_reduce(torch.randn(4097, device=device, dtype=torch.bfloat16), spec, pow2_rescale=pow2)

    return _first_mismatch(buf, rank, issue)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_pow2_on_off_mismatch_is_named():
    for rank, r in enumerate(run_distributed(pow2_mismatch_body, 2, timeout=120)):
        assert r["call"] == 3 and r["buffer_calls"] == 3, r
        assert "pow2_rescale: rank" in r["message"] and "different arguments" in r["message"], r
        assert r["waited_s"] < 10.0, r


def deepspeed_exact_body(rank, world_size):
    """The DeepSpeed mode on the p2p backend with every message below min_message_bytes: its exact calls run on
    the buffer's 16-bit one-launch call (the fp32 sum in rank order, rounded once); in the second call the
    last rank is at another site, which every rank must name (EchoP2PMismatch) long before the timeout."""
    import torch.distributed as dist

    from echo_ds.config import EchoConfig
    from echo_ds.deepspeed import FORWARD, EchoRuntime

    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    rt = EchoRuntime(EchoConfig(bits=4, backend="p2p", min_message_bytes=1 << 30), dist.group.WORLD, device)
    buf = rt.buffer
    assert buf is not None and buf.one_launch is not None, rt.backend_reason
    sites = [rt.add_site("blocks.0.o", FORWARD), rt.add_site("blocks.1.o", FORWARD)]
    rt.begin_forward_pass(False)
    parts = torch.randn(world_size, 4097, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = parts.float().sum(0).bfloat16()  # P = 2: one rounding of the exact fp32 sum
    y = rt.reduce(parts[rank].to(device), sites[0])
    buf.synchronize()
    out = {"equal": torch.equal(y.cpu(), want), "buffer_calls": buf.num_calls,
           "plain_calls": rt.stats.forward_plain_calls}

    def issue(call):
        if call == 2:
            rt.reduce(parts[rank].to(device), sites[1 if rank == world_size - 1 else 0])

    out.update(_first_mismatch(buf, rank, issue))
    rt.buffer = None  # closed by _first_mismatch
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_deepspeed_exact_calls_on_the_one_launch_call():
    for rank, r in enumerate(run_distributed(deepspeed_exact_body, 2, timeout=180)):
        assert r["equal"] and r["plain_calls"] == 1, r
        assert r["call"] == 2 and r["buffer_calls"] == 2, r
        assert "different arguments" in r["message"] and r["waited_s"] < 10.0, r
