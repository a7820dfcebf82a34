"""Misuse and faults on the reference path: ranks that disagree on a call raise EchoCallMismatch on every
rank (naming the field and each rank's value) before any data moves; a peer that dies or stalls fails the
call within Echo's own bound (EchoPeerError / EchoTimeout naming rank, peer, stage and call).

Every case runs on two paths (``PATHS``): "eager", echo_all_reduce as called (its body is the custom op
torch.ops.echo_ds.all_reduce / all_reduce_compensated, echo_ds.collective), and "compiled", the same call
compiled with torch.compile(fullgraph=True), where the op is one node of an inductor graph. The
compensated cases hold their state in each stored format (state_dtype "bf16", "int8", "int4"). Misuse of
the paths that no call of echo_all_reduce reaches (the raw ops, the DeepSpeed mode's site op, the p2p
backends) is in tests/test_misuse_paths.py."""

import time

import pytest
import torch

from echo_ds.compensator import make_compensator
from echo_ds.config import DirectionConfig
from echo_ds.emulate import emulated_echo_all_reduce
from echo_ds.quant import QuantSpec
from utils import run_distributed, run_with_dying_rank

kBase = dict(numel=1000, dtype=torch.float32, spec=QuantSpec(4, 64), pow2=False, comp=None, state="bf16", site=3,
             direction="forward")
PATHS = ("eager", "compiled")


def case(field, a0, a1, v0, v1, **also):
    """(field, what rank 0 passes, what rank 1 passes, rank 0's value, rank 1's value as the message prints
    them, {another field that differs with it: [rank 0's, rank 1's]})."""
    return (field, a0, a1, v0, v1, also)


MISMATCHES = [
    case("numel", {}, dict(numel=1020), "1000", "1020"),  # the same padded length (1024) at g = 64, P = 2
    case("dtype", {}, dict(dtype=torch.bfloat16), "float32", "bfloat16"),
    case("bits", {}, dict(spec=QuantSpec(8, 64)), "4", "8"),
    case("group_size", {}, dict(spec=QuantSpec(4, 128)), "64", "128"),
    case("quantizer", {}, dict(spec=QuantSpec(4, 64, "symmetric")), "zero_aware", "symmetric"),
    case("rotation", {}, dict(spec=QuantSpec(4, 64, rotation=True)), "False", "True"),
    case("pow2_rescale", dict(pow2=True), {}, "True", "False"),
    case("compensator", dict(comp="output"), {}, "residual=output", "none", state_dtype=["bf16", "none"]),
    case("compensator", dict(comp="local", state="int4"), dict(comp="output", state="int4"), "residual=local",
         "residual=output"),
    # The stored format: the correction reads the stored state, so ranks must hold the same one.
    case("state_dtype", dict(comp="local", state="int4"), dict(comp="local", state="bf16"), "int4", "bf16"),
    case("state_dtype", dict(comp="output", state="int8"), dict(comp="output", state="int4"), "int8", "int4"),
    case("site", {}, dict(site=4), "3", "4"),
    case("direction", {}, dict(direction="backward"), "forward", "backward"),
    case("direction", {}, dict(direction=None), "forward", "unset"),
    case("call", {}, dict(skip_call=True), "CALL", "CALL+1"),
]
CASE_IDS = [f"{m[0]}-{m[3]}-{m[4]}" for m in MISMATCHES]


def _untouched(comp) -> bool:
    """No call has updated ``comp``: no call counted, its state unallocated or as allocated (zero codes)."""
    if comp is None:
        return True
    held = [getattr(comp, a) for a in comp.state_names]
    return comp.num_calls == 0 and (all(t is None for t in held) or not any(v.any() for v in comp.values()))


def compile_counted(fn):
    """``fn`` compiled with fullgraph=True by inductor, and the names of the Echo ops in the graphs it traced
    (a call that did not run as one compiled graph would leave them out)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    echo_ops = lambda: [str(n.target) for g in counter.graphs for n in g.graph.nodes if "echo_ds" in str(n.target)]
    return torch.compile(fn, backend=counter, fullgraph=True), echo_ops


def _call(rank, args, gen, path):
    from echo_ds import reference as R

    if args.get("skip_call"):  # this rank believes it made one more call on the group than its peer
        R._call_counts[R._group_key(None)] += 1
    x = torch.randn(args["numel"], generator=gen).to(args["dtype"])
    comp = None if args["comp"] is None else make_compensator(
        DirectionConfig(residual=args["comp"], state_dtype=args["state"]))

    def call(t):
        return R.echo_all_reduce(t, args["spec"], compensator=comp, pow2_rescale=args["pow2"], site=args["site"],
                                 direction=args["direction"], timeout_s=30)

    traced = lambda: []
    if path == "compiled":
        torch._dynamo.reset()  # every case compiles its own graph (no recompile limit reached)
        call, traced = compile_counted(call)
    try:
        call(x)
        return ("returned", "", None, traced(), _untouched(comp))
    except R.EchoCallMismatch as e:
        return (type(e).__name__, str(e), e.fields, traced(), _untouched(comp))
    finally:
        if args.get("skip_call"):
            R._call_counts[R._group_key(None)] -= 1  # back in step for the next case


def mismatch_body(rank, world_size):
    from echo_ds import reference as R

    gen = torch.Generator().manual_seed(rank)
    out = {}
    for path in PATHS:
        out[path] = []
        for _field, a0, a1, _v0, _v1, _also in MISMATCHES:
            args = dict(kBase, **(a0 if rank == 0 else a1))
            before = R.call_count()
            out[path].append(_call(rank, args, gen, path) + (before + 1,))
    # The group is still usable, the call numbers in step: a matching call works and agrees.
    x = torch.full((1000,), float(rank + 1))
    y = R.echo_all_reduce(x, QuantSpec(4, 64), site=3, direction="forward")
    # pow2 rescaling takes its max from the descriptor exchange: a NaN on rank 1 only gives k = 0 on
    # both ranks, as in the emulator (gloo's MAX all-reduce dropped it and rescaled the finite groups).
    y_nan = R.echo_all_reduce(nan_parts()[rank], QuantSpec(4, 64), pow2_rescale=True)
    return out, y, y_nan, R.call_count()


def nan_parts():
    parts = torch.randn(2, 1000, generator=torch.Generator().manual_seed(7)) * 1e-6
    parts[1, 0] = float("nan")
    return parts


@pytest.fixture(scope="module")
def mismatch_results():
    return run_distributed(mismatch_body, 2, timeout=120)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", range(len(MISMATCHES)), ids=CASE_IDS)
def test_mismatch_raises_on_every_rank_naming_field_and_values(mismatch_results, case, path):
    field, _a0, _a1, v0, v1, also = MISMATCHES[case]
    results = [mismatch_results[r][0][path][case] for r in range(2)]
    call = results[0][5]
    if field == "call":
        v0, v1 = str(call), str(call + 1)
    for rank, (kind, message, fields, traced, untouched, _call_number) in enumerate(results):
        assert kind == "EchoCallMismatch", f"rank {rank} did not raise: {kind}"
        assert f"ranks disagree on {field}: rank 0: {v0}, rank 1: {v1}" in message, message
        assert fields == {field: [v0, v1], **also}, fields
        assert untouched, f"rank {rank}: the refused call updated the compensator"
        if path == "compiled":  # the call ran as one graph holding the op
            assert len(traced) == 1 and traced[0].startswith("echo_ds.all_reduce"), traced
    assert results[0][1] == results[1][1], "the ranks raised different messages"
    if field == "numel":
        assert results[0][1].startswith(
            f"echo all-reduce call {call} (site 3, forward): ranks disagree on numel: rank 0: 1000, rank 1: 1020")


def test_group_usable_after_mismatches(mismatch_results):
    (_, y0, _, n0), (_, y1, _, n1) = mismatch_results
    assert n0 == n1 == len(PATHS) * len(MISMATCHES) + 2
    parts = torch.stack([torch.full((1000,), float(r + 1)) for r in range(2)])
    expected = emulated_echo_all_reduce(parts, QuantSpec(4, 64))
    assert torch.equal(y0, expected) and torch.equal(y1, expected)


def test_pow2_max_with_a_nan_on_one_rank_equals_the_emulator(mismatch_results):
    expected = emulated_echo_all_reduce(nan_parts(), QuantSpec(4, 64), None, True)
    assert expected[64:].isfinite().all() and expected[:64].isnan().all()
    for r in range(2):
        y = mismatch_results[r][2]
        assert torch.equal(y.isnan(), expected.isnan()) and torch.equal(y.nan_to_num(), expected.nan_to_num())


def three_rank_body(rank, world_size):
    from echo_ds import reference as R

    spec = QuantSpec(8, 64) if rank == 2 else QuantSpec(4, 64)
    try:
        R.echo_all_reduce(torch.zeros(500 if rank == 1 else 512), spec, timeout_s=30)
    except R.EchoCallMismatch as e:
        return str(e)
    return "returned"


def test_three_ranks_every_field_named():
    messages = run_distributed(three_rank_body, 3, timeout=90)
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("echo all-reduce call 1: ranks disagree on numel: rank 0: 512, rank 1: 500, "
                                  "rank 2: 512; bits: rank 0: 4, rank 1: 4, rank 2: 8"), messages[0]


kFaultTimeout = 2.0


def _fault_call(path):
    """Call 2 of the fault tests on ``path``, and the Echo ops it traced. The compiled one carries an "int4"
    compensator and takes its timeout from ECHO_P2P_TIMEOUT_S, which the op reads when it runs: call 1 runs
    the same graph with a wait long enough for the peer's compile."""
    from echo_ds import reference as R

    if path == "eager":
        return (lambda t: R.echo_all_reduce(t, QuantSpec(4, 64), site=5, direction="backward",
                                            timeout_s=kFaultTimeout)), (lambda: [])
    comp = make_compensator(DirectionConfig(state_dtype="int4"))
    return compile_counted(lambda t: R.echo_all_reduce(t, QuantSpec(4, 64), compensator=comp, site=5,
                                                       direction="backward"))


def fault_body(rank, world_size, fault, path):
    import os

    from echo_ds import reference as R

    x = torch.randn(4096)
    call, traced = _fault_call(path)
    if path == "eager":
        R.echo_all_reduce(x, QuantSpec(4, 64), timeout_s=kFaultTimeout)  # call 1 completes
    else:
        os.environ[R.kTimeoutEnv] = "60"
        call(x)  # call 1 completes (compiled on each rank at its own pace)
        os.environ[R.kTimeoutEnv] = str(kFaultTimeout)
    if rank == world_size - 1:
        if fault == "dead":
            os._exit(17)
        if fault == "stall":
            time.sleep(kFaultTimeout + 3)  # rank 0 gives up first, with a margin for a loaded machine
            os._exit(17)
        if fault == "dead-at-all-to-all":
            import torch.distributed as dist

            dist.all_to_all_single = lambda *a, **k: os._exit(17)
    start = time.monotonic()
    try:
        call(x)
    except R.EchoPeerError as e:
        return (type(e).__name__, str(e), time.monotonic() - start, e.stage, e.call, e.peer, e.rank,
                type(e.__cause__).__name__, traced())
    return ("returned", "", time.monotonic() - start)


# Compiled once (each compiled run costs a compile per rank): a death in the middle of the op's collectives.
@pytest.mark.parametrize("fault, stage, path", [("dead", "descriptor", "eager"),
                                                ("dead-at-all-to-all", "all-to-all", "eager"),
                                                ("dead-at-all-to-all", "all-to-all", "compiled")])
def test_dead_peer_fails_the_call_naming_rank_peer_stage_call(fault, stage, path):
    (result,) = run_with_dying_rank(fault_body, 2, fault, path, timeout=90)
    kind, message, elapsed, got_stage, call, peer, rank, cause, traced = result
    assert kind in ("EchoPeerError", "EchoTimeout"), result
    if path == "compiled":  # the compensated op in each graph (call 2 recompiles: its state is allocated now)
        assert set(traced) == {"echo_ds.all_reduce_compensated"}, traced
    assert elapsed < kFaultTimeout + 3, result
    assert (got_stage, call, peer, rank) == (stage, 2, 1, 0), result
    assert cause == "RuntimeError"  # gloo's own error is chained
    assert message.startswith("echo all-reduce: rank 0 of 2 "), message
    assert f"rank 1 at stage '{stage}' of echo all-reduce call 2 (site 5, backward)" in message, message


def test_stalled_peer_times_out_within_the_bound():
    (result,) = run_with_dying_rank(fault_body, 2, "stall", "eager", timeout=60)
    kind, message, elapsed, stage, call, peer, rank, cause, _traced = result
    assert kind == "EchoTimeout", result
    assert kFaultTimeout - 0.1 <= elapsed < kFaultTimeout + 3, result
    assert (stage, call, peer, rank) == ("descriptor", 2, 1, 0), result
    assert message.startswith("echo all-reduce: rank 0 of 2 timed out after ")
    assert (f"(timeout {kFaultTimeout:g} s) waiting for rank 1 at stage 'descriptor' of echo all-reduce call 2 "
            f"(site 5, backward)") in message, message


def test_arguments_checked_before_any_collective():
    from echo_ds.reference import echo_all_reduce

    x = torch.zeros(8)
    with pytest.raises(ValueError, match="direction='sideways'"):
        echo_all_reduce(x, QuantSpec(), direction="sideways")
    with pytest.raises(ValueError, match="site=-1"):
        echo_all_reduce(x, QuantSpec(), site=-1)
    with pytest.raises(ValueError, match="timeout_s=0"):
        echo_all_reduce(x, QuantSpec(), timeout_s=0)


def test_default_timeout_is_p2p_s(monkeypatch):
    from echo_ds.p2p.protocol import kDefaultTimeoutS
    from echo_ds.reference import default_timeout, kTimeoutEnv

    monkeypatch.delenv(kTimeoutEnv, raising=False)
    assert default_timeout() == kDefaultTimeoutS
    monkeypatch.setenv(kTimeoutEnv, "0.25")
    assert default_timeout() == 0.25
