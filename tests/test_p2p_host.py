"""The p2p pipeline on a CPU: the host transport (shared memory between gloo ranks) carries the same
tiling, offsets, flag values and stages as the CUDA transport, so everything above the kernels is
checked bit for bit against the reference here, and a dead rank must turn into a timeout error."""

import os

import pytest
import torch

import p2p_suite
from utils import run_distributed, run_with_dying_rank

HOST_CFG = {
    "transport": "host",
    "max_numel": 1 << 16,
    "tile_bytes": 600,  # several tiles even for small messages: the tiling is what is under test
    "timeout_s": 30.0,
    "option_numel": 333,
    "sizes": [(1, "float32"), (7, "bfloat16"), (127, "float16"), (129, "float32"), (4097, "bfloat16"),
              (20_001, "float32")],
    "emulator_from": 4097,
    "stress_calls": 40,
    "stress_sizes": [1, 100, 1000, 3333],
    "stress_sample_every": 10,
}


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=[pytest.mark.slow, pytest.mark.skipif(
    not os.environ.get("ECHO_SLOW_TESTS"), reason="four CPU ranks take ~20 s to start and stop on a small machine; "
    "ECHO_SLOW_TESTS=1 runs them (the GPU suite runs P = 4 on every device run)")])])
def test_host_transport_suite(world_size):
    cfg = dict(HOST_CFG)
    if world_size == 4:  # the same checks, fewer of the slow CPU reference calls
        cfg.update(sizes=[(7, "float32"), (4097, "bfloat16")], stress_calls=16, option_stride=5, comp_calls=2)
    results = run_distributed(p2p_suite.suite, world_size, cfg, timeout=240)
    calls = {r["device_calls"] for r in results}
    assert len(calls) == 1, f"ranks counted different numbers of calls: {calls}"


def test_host_transport_dead_rank_times_out():
    cfg = {"transport": "host", "timeout_s": 1.5, "kill_call": 3}
    survivors = run_with_dying_rank(p2p_suite.killed_body, 2, cfg, timeout=120)
    (r0,) = survivors
    msg = r0["message"]
    assert r0["call"] == 3, r0
    assert "rank 0 of 2" in msg and "waiting for rank 1" in msg and "call 3" in msg and "tail" in msg, msg
    assert r0["waited_s"] < 1.5 + 5.0, r0


def test_unavailable_device_falls_back_with_one_reason():
    from echo_ds.p2p import policy

    d = policy.group_decision(policy.GroupFacts("cpu", 2, True, True, True))
    assert not d and "reference" in d.reason
    assert torch.float64 not in policy.SUPPORTED_DTYPES
