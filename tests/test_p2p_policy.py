"""The p2p backend's decisions are pure functions of sizes, dtypes, world size and capabilities; every
"no" names the setting to change."""

import pytest
import torch

from echo_ds.p2p import policy
from echo_ds.p2p.layout import Capacity

OK = policy.GroupFacts("cuda", 4, same_host=True, peer_access=True, kernels_built=True)


def facts(**kw):
    return policy.GroupFacts(**{**OK.__dict__, **kw})


def test_a_healthy_group_uses_p2p():
    assert policy.group_decision(OK)
    assert policy.group_decision(facts(probe_ok=True))
    for P in (2, 4, 8):
        assert policy.group_decision(facts(world_size=P))


@pytest.mark.parametrize("change, words", [
    (dict(device_type="cpu"), ["CUDA", '"backend": "reference"']),
    (dict(world_size=3), ["(2, 4, 8)", "3 ranks", "autotp_size"]),
    (dict(world_size=16), ["16 ranks"]),
    (dict(same_host=False), ["several hosts", "NCCL"]),
    (dict(peer_access=False), ["peer access", "nvidia-smi topo"]),
    (dict(kernels_built=False, kernels_error="nvcc missing"), ["nvcc missing", "nvcc"]),
    (dict(probe_ok=False, probe_error="rank 1 read [0, 0, 0]"), ["probe", "rank 1 read"]),
])
def test_each_missing_prerequisite_declines_with_its_reason(change, words):
    d = policy.group_decision(facts(**change))
    assert not d
    for w in words:
        assert w in d.reason, (w, d.reason)


def test_world_size_one_declines():
    assert not policy.group_decision(facts(world_size=1))


def call(**kw):
    base = dict(dtype=torch.bfloat16, numel=1 << 20, element_size=2, world_size=4, bits=4, group_size=128,
                capacity=Capacity(4, 1 << 22))
    return policy.call_decision(**{**base, **kw})


def test_call_decision():
    assert call()
    assert call(dtype=torch.float32, element_size=4) and call(dtype=torch.float16)
    assert "dtype" in call(dtype=torch.float64, element_size=8).reason
    assert "max_numel" in call(numel=1 << 24).reason
    assert call(numel=1 << 23), "4-bit codes of twice max_numel still fit"
    assert "max_numel" in call(numel=1 << 23, bits=8).reason
    assert "telemetry" in call(telemetry=True).reason
    assert "min_message_bytes" in call(min_message_bytes=1 << 30).reason
    assert "device" in call(device_matches=False).reason
    assert not call(numel=0)


def test_a_call_no_kernel_runs_takes_the_reference_path():
    """A group size the kernels are not built for: neither the one launch nor the staged kernels run it (the torch
    stages left the package), so the call declines with the kernels' reason; where the stages a transport brings
    take it (the tests' host transport), the staged pipeline serves it."""
    from echo_ds.ops import kernels as K
    from echo_ds.quant import QuantSpec

    why = K.unsupported_reason(4, QuantSpec(4, 32), torch.bfloat16)
    assert why and "group_size=32" in why
    d = call(group_size=32, staged_unsupported=why)
    assert not d and "group_size=32" in d.reason and "reference path" in d.reason, d.reason
    assert call(group_size=32, staged_unsupported="")
    assert call(group_size=128, staged_unsupported=why, chunked=True), "the one launch serves it"


def test_p2p_transport_status_has_the_deepspeed_policy_shape():
    assert policy.p2p_transport_status("cuda", 2) == (True, "")
    ok, why = policy.p2p_transport_status("cuda", 8, same_host=False)
    assert not ok and "hosts" in why


def test_every_configurable_state_dtype_is_held_by_the_p2p_kernels():
    # The one-launch kernel holds every stored format the config accepts (echo_ds.ops.kernels.
    # SUPPORTED_STATE_DTYPES; EchoBuffer sends a narrow state there at every size); a format it did not
    # hold would decline the call with a reason naming the setting.
    from echo_ds.config import STATE_DTYPES

    assert set(STATE_DTYPES) <= set(policy.SUPPORTED_STATE_DTYPES)
    for state_dtype in STATE_DTYPES:
        assert call(state_dtype=state_dtype)
    assert policy.state_dtype_decision({"forward": "bf16", "backward": "int4"})
    d = policy.state_dtype_decision({"forward": "bf16", "backward": "fp8"})
    assert not d and 'echo.backward.state_dtype="fp8"' in d.reason and "forward" not in d.reason


def test_one_launch_takes_every_size_where_each_rank_has_its_own_gpu():
    """The staged pipeline serves large messages only where ranks share a GPU (the co-resident grid's rig)."""
    assert policy.one_launch_max_bytes(1) >= 1 << 40
    for sharing in (2, 4, 8):
        assert policy.one_launch_max_bytes(sharing) == policy.kSharedGpuOneLaunchMaxBytes == 16 << 20


def test_one_shot_threshold_by_world_size_and_sharing():
    """The one-shot variant: 256 KiB at P = 2 and 4 where each rank has its own GPU (a prediction); where ranks
    share one (the measured rig) at P = 2 only; never at P = 8, where its kernel is not built."""
    assert policy.one_shot_max_bytes(2) == policy.one_shot_max_bytes(4) == 256 << 10
    assert policy.one_shot_max_bytes(2, ranks_per_device=2) == 256 << 10
    assert policy.one_shot_max_bytes(4, ranks_per_device=4) == 0
    assert policy.one_shot_max_bytes(4, ranks_per_device=2) == 0
    assert policy.one_shot_max_bytes(8) == policy.one_shot_max_bytes(8, ranks_per_device=8) == 0
    assert policy.one_shot_max_bytes(3) == 0


@pytest.mark.parametrize("world_size", (2, 4))
def test_one_shot_region_holds_every_call_up_to_its_size(world_size):
    """P2PRuntime.plan refuses a one-shot call whose sender region exceeds Capacity.shot_sender_bytes
    (csrc/echo_binding.cpp, shot_sender_need, replicated here and checked to be that line): every 16-bit message
    up to the workspace's one-shot size fits, at every group size and bit width the kernels take."""
    import math
    from pathlib import Path

    from echo_ds.ops.builder import CSRC_DIR
    from echo_ds.ops.kernels import SUPPORTED_GROUP_SIZES

    formula = ("return world_size_ * round_up(G * group_code_bytes, 256) + round_up(4 * world_size_ * G, 256) + "
               "G * group_size * 4;")
    assert formula in (Path(CSRC_DIR) / "echo_binding.cpp").read_text(), "shot_sender_need changed: update this test"
    P = world_size
    cap = Capacity(P, 1 << 20, shot_numel=policy.kOneShotMaxBytes // 2)

    def r(v):
        return -(-v // 256) * 256

    top = cap.shot_numel
    for g in SUPPORTED_GROUP_SIZES:
        for bits in (4, 8):
            for n in (1, g - 1, g, P * g + 1, top // 3, top - P * g + 1, top - 1, top):
                G = math.ceil(n / (P * g))
                need = P * r(G * g * bits // 8) + r(4 * P * G) + G * g * 4
                assert need <= cap.shot_sender_bytes, (g, bits, n, need, cap.shot_sender_bytes)
    assert Capacity(P, 1 << 20).shot_bytes == 0
