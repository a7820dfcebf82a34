"""Several Echo groups at once on the p2p transport (issue 35, item 3; tests/test_groups.py is the reference
path's test): data parallel 2 x tensor parallel 2 on four ranks sharing one GPU (skipped without CUDA), and
the same body on the CPU's host transport.

The tensor-parallel groups are {0, 1} and {2, 3}, the data-parallel groups {0, 2} and {1, 3}: every rank
holds one EchoBuffer on each of its two groups (each group its own workspace, flags and registration) and
makes its calls through echo_all_reduce, which runs a group's calls on the buffer registered for it. Every
group has its own p2p_suite.MixedCalls (4 and 8 bits, compensated with both residuals or not, its own sizes,
seed and compensators), and the calls interleave: TP, DP, TP, ... on every rank, both tensor-parallel
groups at once. Every call is compared on the rank that made it with the emulator of its group on the
same device, bit for bit, so that no group's data or state can have reached another's; every call must
have run on its group's buffer.

Then the wrong group (GPU): rank 0 issues its next tensor-parallel call on its data-parallel group {0, 2},
where rank 2 makes that group's own next call (another size, bit width, group size, rotation and pow2
mode). The
one-launch call's flags carry the call's descriptor, so both raise EchoP2PMismatch naming the fields that
differ, well before the timeout. On the p2p path that refusal comes after the codes moved: the refused
call's output, and the state of a compensator passed to it, are undefined (docs/errors.md), so the calls
of that step carry no compensator, and the buffer of {0, 2} is closed by both its ranks. From there that
group's calls run on the reference path and every other group's stay on its buffer; more rounds follow,
every group still bit-identical to its emulator.

The host transport runs the staged pipeline, whose flags carry no descriptor (docs/errors.md, "Known
gaps"), so the CPU run leaves the wrong-group step out; it closes the buffer of {0, 2} at the same point.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from host_transport import transport_arg
import p2p_suite
from echo_ds.p2p.protocol import kHashField
from utils import run_distributed

TP_GROUPS = ((0, 1), (2, 3))
DP_GROUPS = ((0, 2), (1, 3))
KINDS = {"tp": TP_GROUPS, "dp": DP_GROUPS}
DIRECTIONS = {"tp": "forward", "dp": "backward"}
# The data-parallel mixes start three configurations later, so that at the wrong-group step (a call index
# that is a multiple of len(MIX_CONFIGS)) the two calls differ in bits, group size, rotation and pow2 mode,
# and neither carries a compensator. Both rescale ("auto" and True): the one-launch kernel's rescaling waits
# for every peer's max flag, which a peer with pow2_rescale=False never writes, so a mismatch of that kind
# surfaces as EchoP2PTimeout after timeout_s, not as EchoP2PMismatch.
OFFSETS = {"tp": 0, "dp": 3}

GPU_CFG = {"transport": "cuda", "timeout_s": 10.0, "max_numel": 1 << 24, "wrong_group": True,
           # the last size (bf16: 18 MiB) is above one_launch_max_bytes: the staged pipeline
           "sizes": (1, 127, 4097, 65_537, 1_000_003, 9_000_001), "comp_numel": 65_537, "rounds": 24, "after": 8}
HOST_CFG = {"transport": "host", "timeout_s": 30.0, "max_numel": 1 << 14, "wrong_group": False,
            "sizes": (1, 127, 1000), "comp_numel": 1000, "rounds": 4, "after": 4}
for _cfg in (GPU_CFG, HOST_CFG):  # the wrong-group step's call index needs both mixes uncompensated
    assert _cfg["rounds"] % len(p2p_suite.MIX_CONFIGS) == 0


def _mix_args(kind: str, index: int, cfg):
    """(sizes, compensated size, seed, offset) of group (kind, index): each group its own sizes and data."""
    shift = {"tp": 0, "dp": 2}[kind] + index
    sizes = tuple(n + shift for n in cfg["sizes"])
    return sizes, cfg["comp_numel"] + 8 * shift, 1000 * (1 + shift), OFFSETS[kind]


def _groups(rank):
    """{kind: (group, its index)}; every rank creates all four groups, in one order."""
    import torch.distributed as dist

    made = {kind: [dist.new_group(list(r)) for r in groups] for kind, groups in KINDS.items()}
    return {kind: (made[kind][i], i) for kind, groups in KINDS.items() for i, r in enumerate(groups) if rank in r}


def _cap_grids(world_size: int) -> None:
    """Give every rank on the device half of an even share of its resident blocks, as EchoBuffer does for the
    ranks of one group: a buffer counts only its own group's ranks on its device (2 here, while 4 ranks of two
    groups share it), and at the full share one rank's block can wait for an SM that spinning blocks of the
    other group hold (EchoBuffer._init_runtime). ECHO_P2P_MAX_BLOCKS replaces the buffer's cap."""
    import echo_ds.ops as ops

    per_device = -(-world_size // torch.cuda.device_count())
    os.environ["ECHO_P2P_MAX_BLOCKS"] = str(max(1, int(ops.load().p2p_resident_blocks()) // (2 * per_device)))


class _Rank:
    """One rank's two groups, their buffers and mixes, and what its calls gave."""

    def __init__(self, rank, world_size, cfg):
        from echo_ds.p2p import EchoBuffer

        self.rank, self.cfg = rank, cfg
        if cfg["transport"] == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
            _cap_grids(world_size)
        else:
            self.device = torch.device("cpu")
        self.groups = _groups(rank)
        self.bufs = {}
        for kind in KINDS:  # every rank builds its tensor-parallel buffer first (collective per group)
            self.bufs[kind] = EchoBuffer(self.groups[kind][0], max_numel=cfg["max_numel"], timeout_s=cfg["timeout_s"],
                                         transport=transport_arg(cfg["transport"]))
            assert self.bufs[kind].active, self.bufs[kind].reason
        self.mixes = {kind: p2p_suite.MixedCalls(2, KINDS[kind][i].index(rank), self.device, *_mix_args(kind, i, cfg))
                      for kind, (_, i) in self.groups.items()}
        self.mismatches, self.paths = [], {}

    def call(self, kind: str, c: int) -> None:
        """Call ``c`` of this rank's group ``kind`` through echo_all_reduce: its result against the emulator,
        and which path ran it ("p2p": the group's buffer, "reference")."""
        from echo_ds.reference import call_count, echo_all_reduce

        group, buf = self.groups[kind][0], self.bufs[kind]

        def reduce(x, spec, comp, pow2):
            return echo_all_reduce(x, spec, group=group, compensator=comp, pow2_rescale=pow2, site=c,
                                   direction=DIRECTIONS[kind])

        before = (buf.num_calls, call_count(group))
        y, expected = self.mixes[kind].run(reduce, c, check=True)
        if not buf.closed:
            buf.synchronize()  # a failed wait raises here, before the comparison
        if not p2p_suite.same_bits(y, expected):
            self.mismatches.append((kind, c))
        ran = (buf.num_calls - before[0], call_count(group) - before[1])
        self.paths[(kind, c)] = {(1, 0): "p2p", (0, 1): "reference"}.get(ran, f"p2p and reference calls: {ran}")

    def rounds(self, calls) -> None:
        for c in calls:
            for kind in KINDS:
                self.call(kind, c)

    def wrong_group_call(self, c: int):
        """Rank 0: its tensor-parallel call ``c`` on its data-parallel group; rank 2: that group's own call ``c``.
        Returns (message, seconds to the error) of the EchoP2PMismatch both must raise."""
        from echo_ds.p2p import EchoP2PMismatch
        from echo_ds.reference import echo_all_reduce

        kind = "tp" if self.rank == 0 else "dp"
        mix = self.mixes[kind]
        _, spec, residual, pow2, _, _ = mix.config(c)
        assert residual is None, "the wrong-group step's calls carry no compensator (module docstring)"
        x = mix.parts(c)[mix.rank]
        t0 = time.perf_counter()
        echo_all_reduce(x, spec, group=self.groups["dp"][0], pow2_rescale=pow2, site=c, direction=DIRECTIONS[kind])
        try:
            self.bufs["dp"].synchronize()
        except EchoP2PMismatch as e:
            return str(e), time.perf_counter() - t0
        raise AssertionError(f"rank {self.rank}: no EchoP2PMismatch for a call on the wrong group")

    def close(self) -> None:
        for kind in KINDS:
            self.bufs[kind].close()  # collective over each group: both its ranks reach it


def _groups_body(rank, world_size, cfg):
    me = _Rank(rank, world_size, cfg)
    c_wrong = cfg["rounds"]
    me.rounds(range(c_wrong))
    refused = None
    if rank in DP_GROUPS[0]:
        if cfg["wrong_group"]:
            refused = me.wrong_group_call(c_wrong)
        me.bufs["dp"].close(abort=True)  # both ranks of {0, 2}: its calls go back to the reference path
    me.rounds(range(c_wrong + 1, c_wrong + 1 + cfg["after"]))  # no group makes call c_wrong
    me.close()
    return {"groups": {kind: KINDS[kind][i] for kind, (_, i) in me.groups.items()}, "mismatches": me.mismatches,
            "paths": me.paths, "refused": refused}


def _check(results, cfg):
    c_wrong = cfg["rounds"]
    calls = [c for c in range(c_wrong + 1 + cfg["after"]) if c != c_wrong]
    for rank, r in enumerate(results):
        assert r["groups"] == {kind: next(g for g in KINDS[kind] if rank in g) for kind in KINDS}, (rank, r["groups"])
        assert r["mismatches"] == [], f"rank {rank}: calls that differ from their group's emulator: {r['mismatches']}"
        for kind in KINDS:
            moved = kind == "dp" and r["groups"]["dp"] == DP_GROUPS[0]
            want = {c: "reference" if moved and c > c_wrong else "p2p" for c in calls}
            assert {c: r["paths"][(kind, c)] for c in calls} == want, (rank, kind, r["paths"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_dp2_tp2_groups_bit_identical_per_group_and_the_wrong_group_refused():
    results = run_distributed(_groups_body, 4, GPU_CFG, timeout=300)
    _check(results, GPU_CFG)
    for rank, r in enumerate(results):
        if rank not in DP_GROUPS[0]:
            assert r["refused"] is None
            continue
        message, waited_s = r["refused"]
        assert "different arguments" in message and "bits: rank" in message and kHashField in message, message
        assert waited_s < 5.0, (rank, waited_s, message)
    p2p_suite.log(0, f"DP 2 x TP 2 on one GPU: {len(results[0]['paths'])} interleaved calls per rank bit-identical to "
                     f"their group's emulator; a call on the wrong group refused: {results[0]['refused'][0]}")


def test_host_dp2_tp2_groups_bit_identical_per_group():
    _check(run_distributed(_groups_body, 4, HOST_CFG, timeout=240), HOST_CFG)
