"""The p2p backend on CUDA, several ranks per GPU allowed (skipped without a CUDA device).

Ranks bootstrap over gloo (NCCL refuses two ranks on one GPU) and share the GPU through CUDA IPC; with
MPS their spinning waits and kernels run side by side (benchmarks/p2p_gpu.sh starts it). At P = 2 and 4:
every dtype, bit width, quantizer, rotation, compensator residual and pow2 setting bit-identical to the
specification on the device (the emulator, i.e. the reference's operations on CUDA tensors) and across
ranks, the CPU reference over gloo compared and its differences reported; sizes from 1 element to
256 MiB (P = 8: to 32 MiB), and 1 GiB (fp32) at P = 2 through the default workspace; CUDA graph
capture and replay with new inputs; 10,000 back-to-back calls of mixed sizes; a rank killed in the
middle of a call turns into EchoP2PTimeout on the others within the timeout. The checks are in
tests/p2p_suite.py (the CPU run of the same checks is tests/test_p2p_host.py).
"""

import os

import pytest
import torch

import p2p_suite
from utils import run_distributed, run_with_dying_rank

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MIB = 1 << 20
GPU_CFG = {
    "transport": "cuda",
    "stages": os.environ.get("ECHO_P2P_STAGES", "auto"),
    "max_numel": 1 << 27,  # 256 MiB of bf16
    "tile_bytes": int(os.environ.get("ECHO_P2P_TILE_BYTES", MIB)),
    "timeout_s": 20.0,
    "option_numel": 3001,
    # (elements, dtype): 1 element to 256 MiB, odd lengths that need padding.
    "sizes": [(1, "float32"), (7, "bfloat16"), (127, "float16"), (4097, "float32"), (65_537, "bfloat16"),
              (1_000_003, "float32"), (16_777_259, "bfloat16"), (64 * MIB, "float32"), (128 * MIB, "bfloat16")],
    "emulator_from": 65_537,  # below: the emulator on every rank; from here: on rank 0
    "cpu_reference": "report",  # the reference over gloo on CPU copies: differences counted, not asserted
    "stress_calls": int(os.environ.get("ECHO_P2P_STRESS_CALLS", 10_000)),
    "stress_sizes": [1, 333, 1000, 4097, 12_345, 65_537, 100_000, 262_147],
    "stress_sample_every": 1000,
}
if os.environ.get("ECHO_P2P_QUICK"):  # a short smoke run: the same checks, smaller and fewer
    GPU_CFG.update(sizes=[(1, "float32"), (4097, "bfloat16"), (65_537, "float16"), (1_000_003, "float32")],
                   stress_calls=int(os.environ.get("ECHO_P2P_STRESS_CALLS", 1000)), stress_sample_every=250,
                   option_stride=3, comp_calls=2)


@pytest.mark.parametrize("world_size", (2, 4, 8))
def test_gpu_suite(world_size):
    # P = 8 on one GPU: eight contexts and 16 blocks each; sizes up to 16,777,259 elements (32 MiB of bf16).
    cfg = GPU_CFG if world_size < 8 else dict(GPU_CFG, sizes=[(n, d) for n, d in GPU_CFG["sizes"] if n <= 16_777_259])
    results = run_distributed(p2p_suite.suite, world_size, cfg, timeout=400)
    assert len({r["device_calls"] for r in results}) == 1


def test_gpu_one_gib():
    """A 1 GiB message (the top of the issue's range: 256 Mi fp32 elements) at P = 2: one binding call, chunk by
    chunk through the default workspace, compensated then rotated with an odd length, bit-identical to the
    emulator and across ranks. (512 Mi bf16 elements did not fit: the emulator's intermediates on rank 0 took
    over 58 GiB of an 80 GB H100 beside the other rank.)"""
    cfg = dict(GPU_CFG, sizes=[(256 * MIB, "float32"), (256 * MIB - 3, "float32")])
    results = run_distributed(p2p_suite.largest, 2, cfg, timeout=500)
    assert all(len(r["lines"]) == 2 for r in results), results


def test_gpu_staged_kernels():
    """The staged pipeline through the kernels of echo_ds.ops (several launches per tile), the path the
    one-launch call replaced as the default; the buffer is left open, so the interpreter-exit hook frees it (the
    harness fails a rank that hangs there)."""
    cfg = dict(GPU_CFG, stages="kernels", sizes=[(4097, "float32"), (1_000_003, "bfloat16")], stress_calls=200,
               stress_sample_every=100, leave_open=True)
    run_distributed(p2p_suite.suite, 2, cfg, timeout=300)


@pytest.mark.parametrize("field", ("bits", "numel"))
@pytest.mark.parametrize("world_size", (2, 4))
def test_gpu_one_launch_mismatch_is_named(world_size, field):
    """Ranks that make call 3 with different arguments: the flags of the one launch carry the call's
    descriptor, so every rank raises EchoP2PMismatch naming the field (long before the timeout)."""
    cfg = {"timeout_s": 10.0, "field": field}
    results = run_distributed(p2p_suite.mismatch_body, world_size, cfg, timeout=120)
    want = {"bits": "bits: rank", "numel": "numel/site/direction (hash): rank"}[field]
    for rank, r in enumerate(results):
        assert r["call"] == 3 and want in r["message"] and "different arguments" in r["message"], r
        assert r["waited_s"] < 5.0, r
    p2p_suite.log(0, f"P={world_size}: a rank calling with another {field} in call 3: every rank raised "
                     f"EchoP2PMismatch: {results[0]['message']}")


def test_gpu_one_shot_threshold_must_agree():
    """The one-shot regions are sized by one_shot_max_bytes and ranks making the same call must take the same
    variant: ranks that pass different values are refused at the handshake, every one of them."""
    results = run_distributed(p2p_suite.one_shot_disagree_body, 2, {}, timeout=120)
    for r in results:
        assert "same one_shot_max_bytes" in r and "rank 0: 0" in r and "rank 1: 262144" in r, r


@pytest.mark.parametrize("stages", ("kernels", "fused"))
@pytest.mark.parametrize("world_size", (2, 4))
def test_gpu_rank_killed_mid_call(world_size, stages):
    timeout_s = 2.0
    cfg = {"transport": "cuda", "timeout_s": timeout_s, "kill_call": 5, "stages": stages}
    survivors = run_with_dying_rank(p2p_suite.killed_body, world_size, cfg, timeout=120)
    for rank, r in enumerate(survivors):
        msg = r["message"]
        assert r["call"] == 5, r
        assert f"rank {rank} of {world_size}" in msg and "call 5" in msg, msg
        assert "timed out" in msg or "abandoned" in msg, msg
        assert r["waited_s"] < timeout_s + 5.0, r
        p2p_suite.log(0, f"P={world_size}: rank {world_size - 1} killed in call 5: rank {rank} raised after "
                         f"{r['waited_s']:.2f} s: {msg}")
