"""Several Echo groups at once (issue 35, item 3): data parallel 2 x tensor parallel 2 on four gloo ranks.

The tensor-parallel groups are {0, 1} and {2, 3}, the data-parallel groups {0, 2} and {1, 3}; every rank is
in one of each. One spawn of four ranks (tests/utils.py) runs both cases, one after the other:

* the reference path: every rank makes Echo calls on both of its groups, interleaved (TP, DP, TP, ...),
  each group with its own compensator (different residuals and gains), with exact all-reduces on the
  other group in between; every group gets its own data and sizes, so any cross-talk changes bits. Then
  one rank issues its tensor-parallel call on the data-parallel group, where its peer makes a call of its
  own: both get ``EchoCallMismatch`` before any data moves, and the next calls on every group are still
  bit-identical to the emulator (the refused call changed no state).
* the DeepSpeed mode: each rank builds an AutoTP MLP on its tensor-parallel group and enables Echo on it
  (the "reference" backend); three training steps, the gradients then all-reduced over the data-parallel
  group (as DeepSpeed's data parallelism does) and one Echo call on that group between the passes.

The parent replays every group's calls through the emulator (echo_ds.emulate), with that group's own
state, and asks for bit-identical results on both ranks of each group.
"""

from __future__ import annotations

import pytest
import torch

from echo_ds.compensator import make_compensator
from echo_ds.config import DirectionConfig, EchoConfig
from echo_ds.emulate import CompensatedAllReduce, emulated_echo_all_reduce
from echo_ds.quant import QuantSpec
from utils import deepspeed_env, free_port, run_distributed

TP_GROUPS = ((0, 1), (2, 3))
DP_GROUPS = ((0, 2), (1, 3))
SPEC = QuantSpec(4, 64, "zero_aware_int", True)
# Each kind of group its own compensator settings, so that a state fed by the wrong group shows.
DIRECTIONS = {"tp": DirectionConfig(residual="local"), "dp": DirectionConfig(residual="output", gain=0.75)}
MODES = {"tp": "auto", "dp": False}
kCalls = 5
HIDDEN = 32


_made = {}


def _groups(rank):
    """(tp group, its index, dp group, its index); every rank creates all four groups once, in one order."""
    import torch.distributed as dist

    if rank in _made:
        return _made[rank]
    tp = [dist.new_group(list(r)) for r in TP_GROUPS]
    dp = [dist.new_group(list(r)) for r in DP_GROUPS]
    ti = next(i for i, r in enumerate(TP_GROUPS) if rank in r)
    di = next(i for i, r in enumerate(DP_GROUPS) if rank in r)
    _made[rank] = (tp[ti], ti, dp[di], di)
    return _made[rank]


def _parts(kind: str, index: int, call: int) -> torch.Tensor:
    """The two members' contributions [2, n] to call ``call`` of group (kind, index): the group's own size
    (one per group, so that its compensator state carries from call to call) and its own data."""
    n = 1000 + (0 if kind == "tp" else 129) + 61 * index
    seed = 1000 * call + 10 * index + (0 if kind == "tp" else 5)
    return torch.randn(2, n, generator=torch.Generator().manual_seed(seed)) * (1.0 + index + call)


# ------------------------------------------------------------------------------------------------------
# The reference path
# ------------------------------------------------------------------------------------------------------

def _reference_case(rank, world_size):
    import torch.distributed as dist

    from echo_ds.reference import EchoCallMismatch, echo_all_reduce

    tp, ti, dp, di = _groups(rank)
    mine = {"tp": (tp, ti), "dp": (dp, di)}
    states = {kind: make_compensator(DIRECTIONS[kind]) for kind in mine}
    out = {"calls": [], "refused": None}

    def call(kind, c, site):
        group, index = mine[kind]
        x = _parts(kind, index, c)[dist.get_rank(group)]
        y = echo_all_reduce(x, SPEC, group=group, compensator=states[kind], pow2_rescale=MODES[kind],
                            direction="forward", site=site)
        out["calls"].append((kind, index, c, y))

    for c in range(kCalls):
        call("tp", c, site=c)
        noise = torch.full((7,), float(rank))
        dist.all_reduce(noise, group=dp)  # plain traffic on the other group in between
        call("dp", c, site=100 + c)
        dist.all_reduce(noise, group=tp)

    # The wrong group: rank 0 issues its next tensor-parallel call on the data-parallel group, while rank 2
    # makes that group's own next call there.
    if rank in (0, 2):
        if rank == 0:
            x = _parts("tp", ti, kCalls)[0]
            args = dict(compensator=states["tp"], pow2_rescale=MODES["tp"], site=kCalls)
        else:
            x = _parts("dp", di, kCalls)[0]
            args = dict(compensator=states["dp"], pow2_rescale=MODES["dp"], site=100 + kCalls)
        try:
            echo_all_reduce(x, SPEC, group=dp, direction="forward", **args)
        except EchoCallMismatch as e:
            out["refused"] = (sorted(e.fields), str(e))
    dist.barrier()
    # Every group goes on, its state untouched by the refused call.
    call("tp", kCalls, site=kCalls)
    call("dp", kCalls, site=100 + kCalls)
    return out


def _emulate(kind: str, index: int, num_calls: int):
    state = make_compensator(DIRECTIONS[kind])
    return [emulated_echo_all_reduce(_parts(kind, index, c), SPEC, state, MODES[kind]) for c in range(num_calls)]


def _both_cases(rank, world_size, shm_port):
    return _reference_case(rank, world_size), _deepspeed_case(rank, world_size, shm_port)


@pytest.fixture(scope="module")
def results():
    return run_distributed(_both_cases, 4, free_port(), timeout=180)


def test_reference_groups_side_by_side_bit_identical_and_the_wrong_group_refused(results):
    results = [r[0] for r in results]
    expected = {(kind, i): _emulate(kind, i, kCalls + 1) for kind in ("tp", "dp") for i in range(2)}
    for rank, res in enumerate(results):
        assert len(res["calls"]) == 2 * (kCalls + 1)
        for kind, index, c, y in res["calls"]:
            assert torch.equal(y, expected[(kind, index)][c]), (rank, kind, index, c)
        if rank in (0, 2):
            fields, message = res["refused"]
            assert {"numel", "site", "compensator", "pow2_rescale"} <= set(fields), message
            assert "no data was exchanged" in message
        else:
            assert res["refused"] is None
    # every group has its own size: a message of another group could not pass for one of this group's
    assert len({tuple(expected[k][0].shape) for k in expected}) == len(expected)


# ------------------------------------------------------------------------------------------------------
# The DeepSpeed mode
# ------------------------------------------------------------------------------------------------------

def _mlp(group):
    """Two residual MLP blocks of DeepSpeed's AutoTP layers on ``group``: x + down(silu(gate(x)) * up(x))."""
    import torch.nn.functional as F
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer

    class Block(torch.nn.Module):
        def __init__(self, name):
            super().__init__()

            def lin(cls, i, o, n):
                return cls(torch.nn.Linear(i, o, bias=False), mp_group=group, name=f"{name}.{n}")

            self.gate = lin(LinearLayer, HIDDEN, 2 * HIDDEN, "gate")
            self.up = lin(LinearLayer, HIDDEN, 2 * HIDDEN, "up")
            self.down = lin(LinearAllreduce, 2 * HIDDEN, HIDDEN, "down")

        def forward(self, x):
            return x + self.down(F.silu(self.gate(x)) * self.up(x))

    torch.manual_seed(0)  # the same full weights on every rank before AutoTP shards them
    return torch.nn.Sequential(Block("blocks.0"), Block("blocks.1"))


def _deepspeed_case(rank, world_size, shm_port):
    import torch.distributed as dist

    import echo_ds.deepspeed as echo
    from echo_ds.reference import echo_all_reduce

    deepspeed_env(rank, world_size, shm_port)
    tp, ti, dp, di = _groups(rank)
    net = _mlp(tp)
    rt = echo.enable(net, EchoConfig(bits=4, backend="reference"))
    assert rt is not None and rt.group is tp and rt.world_size == 2
    visits = []
    echo_fn = rt._echo

    def recording(x, site, bits, compensator, pow2):
        y = echo_fn(x, site, bits, compensator, pow2)
        passes = rt.stats.forward_passes if site.direction == "forward" else rt.stats.backward_passes
        visits.append((site.direction, site.site_id, bits, passes, x.detach().clone(), y.detach().clone()))
        return y

    rt._echo = recording
    dp_state = make_compensator(DIRECTIONS["dp"])
    dp_calls = []
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * ti + step)  # one batch per tensor-parallel group
        x = torch.randn(2, 8, HIDDEN, generator=gen)
        g = torch.randn(2, 8, HIDDEN, generator=gen)
        (net(x) * g).sum().backward()
        for p in net.parameters():  # data parallelism: the gradients over the other group
            dist.all_reduce(p.grad, group=dp)
        part = _parts("dp", di, step)[dist.get_rank(dp)]
        dp_calls.append(echo_all_reduce(part, SPEC, group=dp, compensator=dp_state, pow2_rescale=MODES["dp"]))
        net.zero_grad(set_to_none=True)
    rt.check_site_order()
    out = {"tp": ti, "visits": visits, "dp": (di, dp_calls), "stats": rt.stats.summary()}

    # Exact calls at Echo sites (every message below min_message_bytes) carry their own check: one rank of
    # each tensor-parallel group runs the two blocks in the other order (same message sizes, so nothing else
    # would notice). The outputs are NaN, not a mix of two sites, and the next pass start raises.
    net = _mlp(tp)
    echo.enable(net, EchoConfig(bits=4, backend="reference", min_message_bytes=2**40))
    order = list(net) if dist.get_rank(tp) == 0 else list(net)[::-1]
    x = torch.randn(2, 8, HIDDEN, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        first = _run_in_order(net, order, x)
        out["swapped_finite"] = bool(torch.isfinite(first).all())
        try:
            _run_in_order(net, order, x)
            out["swapped_error"] = None
        except RuntimeError as e:
            out["swapped_error"] = str(e)
        net2 = _mlp(tp)  # the same, in one order on both ranks: finite, no error
        echo.enable(net2, EchoConfig(bits=4, backend="reference", min_message_bytes=2**40))
        out["agreed_finite"] = all(bool(torch.isfinite(net2(x)).all()) for _ in range(2))
    return out


def _run_in_order(net, order, x):
    """net's forward with its blocks in ``order`` (the root module is still ``net``, so a pass starts)."""
    saved = net.forward
    try:
        net.forward = lambda x: _chain(order, x)
        return net(x)
    finally:
        net.forward = saved


def _chain(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def _emulate_visits(visits_a, visits_b, config):
    """The emulator's result of each call of one tensor-parallel group, its state per direction reset per pass."""
    ops = {d: CompensatedAllReduce(2, config, d) for d in ("forward", "backward")}
    last_pass = {"forward": None, "backward": None}
    out = []
    for va, vb in zip(visits_a, visits_b):
        assert va[:4] == vb[:4], (va[:4], vb[:4])  # same site, direction, bits and pass on both ranks
        direction, _, bits, passes = va[:4]
        if last_pass[direction] != passes:
            ops[direction].reset()
            last_pass[direction] = passes
        out.append(ops[direction](torch.stack((va[4], vb[4])), bits))
    return out


def test_deepspeed_mode_dp2_tp2_bit_identical_per_group(results):
    results = [r[1] for r in results]
    config = EchoConfig(bits=4, backend="reference")
    seen = {}
    for index, members in enumerate(TP_GROUPS):
        a, b = (results[r] for r in members)
        assert a["tp"] == b["tp"] == index
        assert len(a["visits"]) == len(b["visits"]) > 0
        assert a["stats"] == b["stats"] and a["stats"]["forward_calls"] == 3 * 2
        expected = _emulate_visits(a["visits"], b["visits"], config)
        for k, y in enumerate(expected):
            assert torch.equal(a["visits"][k][5], y) and torch.equal(b["visits"][k][5], y), (index, k)
        seen[index] = expected[0]
    assert not torch.equal(seen[0], seen[1])  # the two groups' batches differ, and so do their results
    for index, members in enumerate(DP_GROUPS):
        expected = _emulate("dp", index, 3)
        for r in members:
            di, calls = results[r]["dp"]
            assert di == index and all(torch.equal(y, e) for y, e in zip(calls, expected)), (r, index)


def test_exact_calls_at_different_sites_are_refused_not_mixed(results):
    for r in (res[1] for res in results):
        assert r["swapped_finite"] is False
        msg = r["swapped_error"]
        assert msg is not None and "were refused" in msg and "different Echo sites" in msg, msg
        assert "rank 0 visited 0.down" in msg and "rank 1 visited 1.down" in msg, msg
        assert r["agreed_finite"] is True

