"""Misuse and faults on the reference path: ranks that disagree on a call raise EchoCallMismatch on every
rank (naming the field and each rank's value) before any data moves; a peer that dies or stalls fails the
call within Echo's own bound (EchoPeerError / EchoTimeout naming rank, peer, stage and call)."""

import time

import pytest
import torch

from echo_ds.compensator import make_compensator
from echo_ds.config import DirectionConfig
from echo_ds.emulate import emulated_echo_all_reduce
from echo_ds.quant import QuantSpec
from utils import run_distributed, run_with_dying_rank

kBase = dict(numel=1000, dtype=torch.float32, spec=QuantSpec(4, 64), pow2=False, comp=None, site=3,
             direction="forward")

# (field, what rank 0 passes, what rank 1 passes, rank 0's value, rank 1's value) as the message prints them.
MISMATCHES = [
    ("numel", {}, dict(numel=1020), "1000", "1020"),  # the same padded length (1024) at g = 64, P = 2
    ("dtype", {}, dict(dtype=torch.bfloat16), "float32", "bfloat16"),
    ("bits", {}, dict(spec=QuantSpec(8, 64)), "4", "8"),
    ("group_size", {}, dict(spec=QuantSpec(4, 128)), "64", "128"),
    ("quantizer", {}, dict(spec=QuantSpec(4, 64, "symmetric")), "zero_aware", "symmetric"),
    ("rotation", {}, dict(spec=QuantSpec(4, 64, rotation=True)), "False", "True"),
    ("pow2_rescale", dict(pow2=True), {}, "True", "False"),
    ("compensator", dict(comp="output"), {}, "residual=output", "none"),
    ("compensator", dict(comp="local"), dict(comp="output"), "residual=local", "residual=output"),
    ("site", {}, dict(site=4), "3", "4"),
    ("direction", {}, dict(direction="backward"), "forward", "backward"),
    ("direction", {}, dict(direction=None), "forward", "unset"),
    ("call", {}, dict(skip_call=True), "CALL", "CALL+1"),
]
CASE_IDS = [f"{m[0]}-{m[3]}-{m[4]}" for m in MISMATCHES]


def _call(rank, args, gen):
    from echo_ds import reference as R

    if args.get("skip_call"):  # this rank believes it made one more call on the group than its peer
        R._call_counts[R._group_key(None)] += 1
    x = torch.randn(args["numel"], generator=gen).to(args["dtype"])
    comp = None if args["comp"] is None else make_compensator(DirectionConfig(residual=args["comp"]))
    try:
        R.echo_all_reduce(x, args["spec"], compensator=comp, pow2_rescale=args["pow2"], site=args["site"],
                          direction=args["direction"], timeout_s=30)
        return ("returned", "", None)
    except R.EchoCallMismatch as e:
        return (type(e).__name__, str(e), e.fields)
    finally:
        if args.get("skip_call"):
            R._call_counts[R._group_key(None)] -= 1  # back in step for the next case


def mismatch_body(rank, world_size):
    from echo_ds import reference as R

    gen = torch.Generator().manual_seed(rank)
    out = []
    for _field, a0, a1, _v0, _v1 in MISMATCHES:
        args = dict(kBase, **(a0 if rank == 0 else a1))
        before = R.call_count()
        out.append(_call(rank, args, gen) + (before + 1,))
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


@pytest.mark.parametrize("case", range(len(MISMATCHES)), ids=CASE_IDS)
def test_mismatch_raises_on_every_rank_naming_field_and_values(mismatch_results, case):
    field, _a0, _a1, v0, v1 = MISMATCHES[case]
    results = [mismatch_results[r][0][case] for r in range(2)]
    call = results[0][3]
    if field == "call":
        v0, v1 = str(call), str(call + 1)
    for rank, (kind, message, fields, _call_number) in enumerate(results):
        assert kind == "EchoCallMismatch", f"rank {rank} did not raise: {kind}"
        assert f"ranks disagree on {field}: rank 0: {v0}, rank 1: {v1}" in message, message
        assert fields == {field: [v0, v1]}, fields
    assert results[0][1] == results[1][1], "the ranks raised different messages"
    if field == "numel":
        assert results[0][1].startswith(
            f"echo all-reduce call {call} (site 3, forward): ranks disagree on numel: rank 0: 1000, rank 1: 1020")


def test_group_usable_after_mismatches(mismatch_results):
    (_, y0, _, n0), (_, y1, _, n1) = mismatch_results
    assert n0 == n1 == len(MISMATCHES) + 2
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


def fault_body(rank, world_size, fault):
    import os

    from echo_ds import reference as R

    x = torch.randn(4096)
    R.echo_all_reduce(x, QuantSpec(4, 64), timeout_s=kFaultTimeout)  # call 1 completes
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
        R.echo_all_reduce(x, QuantSpec(4, 64), site=5, direction="backward", timeout_s=kFaultTimeout)
    except R.EchoPeerError as e:
        return (type(e).__name__, str(e), time.monotonic() - start, e.stage, e.call, e.peer, e.rank,
                type(e.__cause__).__name__)
    return ("returned", "", time.monotonic() - start)


@pytest.mark.parametrize("fault, stage", [("dead", "descriptor"), ("dead-at-all-to-all", "all-to-all")])
def test_dead_peer_fails_the_call_naming_rank_peer_stage_call(fault, stage):
    (result,) = run_with_dying_rank(fault_body, 2, fault, timeout=60)
    kind, message, elapsed, got_stage, call, peer, rank, cause = result
    assert kind in ("EchoPeerError", "EchoTimeout"), result
    assert elapsed < kFaultTimeout + 3, result
    assert (got_stage, call, peer, rank) == (stage, 2, 1, 0), result
    assert cause == "RuntimeError"  # gloo's own error is chained
    assert message.startswith("echo all-reduce: rank 0 of 2 "), message
    assert f"rank 1 at stage '{stage}' of echo all-reduce call 2 (site 5, backward)" in message, message


def test_stalled_peer_times_out_within_the_bound():
    (result,) = run_with_dying_rank(fault_body, 2, "stall", timeout=60)
    kind, message, elapsed, stage, call, peer, rank, cause = result
    assert kind == "EchoTimeout", result
    assert kFaultTimeout - 0.1 <= elapsed < kFaultTimeout + 3, result
    assert (stage, call, peer, rank) == ("descriptor", 2, 1, 0), result
    assert message.startswith(f"echo all-reduce: rank 0 of 2 timed out after ")
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
