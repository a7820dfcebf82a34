"""The decisions of the DeepSpeed integration (pure functions) and its refusals, in one process."""

from __future__ import annotations

import pytest
import torch

from echo_ds import log as echo_log
from echo_ds.deepspeed import policy, runtime
from echo_ds.quant import wire_bytes



def test_backend_reference_and_auto_on_cpu():
    c = policy.select_backend("reference", "cpu", 2)
    assert (c.name, c.level) == ("reference", "debug")
    c = policy.select_backend("auto", "cpu", 2)
    assert (c.name, c.level) == ("reference", "info")
    assert '"auto" chose "reference"' in c.reason and "CUDA" in c.reason


def test_backend_p2p_falls_back_with_one_warning_naming_the_setting(log):
    no_kernels = policy.p2p_transport_status("cuda", 4, "echo_ds CUDA kernels unavailable: missing nvcc")
    assert no_kernels[0] is False and "nvcc" in no_kernels[1]
    for device, status in (("cuda", no_kernels), ("cpu", None)):
        c = policy.select_backend("p2p", device, 4, status)
        assert (c.name, c.level) == ("reference", "warning")
        assert '"backend": "reference"' in c.reason and "echo" in c.reason
    c = policy.select_backend("p2p", "cuda", 4, no_kernels)
    for _ in range(3):
        echo_log.log_once(c.level, "echo: " + c.reason)
    assert [lvl for lvl, _ in log.records] == ["warning"]


def test_a_group_size_no_kernel_runs_chooses_the_reference_backend():
    """echo.group_size outside the kernels' sizes: every call would take the reference path (the torch stages
    that ran them on the transport left the package), so "auto" chooses the reference backend at setup and
    "p2p" falls back with a warning naming the setting; the kernels' sizes keep the transport."""
    from echo_ds.ops.kernels import SUPPORTED_GROUP_SIZES

    for g in SUPPORTED_GROUP_SIZES:
        assert policy.p2p_transport_status("cuda", 4, group_size=g) == (True, "")
    ok, why = policy.p2p_transport_status("cuda", 4, group_size=32)
    assert ok is False and "echo.group_size=32" in why and "reference path" in why, why
    assert policy.select_backend("auto", "cuda", 4, (ok, why)).name == "reference"
    c = policy.select_backend("p2p", "cuda", 4, (ok, why))
    assert (c.name, c.level) == ("reference", "warning") and "group_size=32" in c.reason
    # the state's reason comes first where both apply; a group that cannot use the transport keeps its own
    assert "fp8" in policy.p2p_transport_status("cuda", 4, state_dtypes={"forward": "fp8"}, group_size=32)[1]
    assert "CUDA" in policy.p2p_transport_status("cpu", 4, group_size=32)[1]


def test_p2p_status_follows_the_transport_policy():
    assert policy.p2p_transport_status("cuda", 4)[0] is True
    assert policy.p2p_transport_status("cuda", 4, same_host=False)[0] is False
    assert policy.p2p_transport_status("cpu", 4)[0] is False


def test_backend_p2p_when_available():
    assert policy.select_backend("p2p", "cuda", 4, p2p_status=(True, "")).name == "p2p"
    c = policy.select_backend("auto", "cuda", 4, p2p_status=(True, ""))
    assert (c.name, c.level) == ("p2p", "info")


def test_backend_unknown_value_says_what_to_set():
    with pytest.raises(ValueError, match='"reference".*"p2p".*"auto"'):
        policy.select_backend("nccl", "cuda", 2)


@pytest.mark.parametrize("numel,elem,bits,threshold,expected", [
    (1024, 2, 4, 0, True), (1024, 2, 4, 2048, True), (1023, 2, 4, 2048, False), (1024, 4, 8, 4097, False),
    (1 << 20, 2, 16, 0, False)])
def test_use_compressed(numel, elem, bits, threshold, expected):
    assert policy.use_compressed(numel, elem, bits, threshold) is expected


@pytest.mark.parametrize("training,in_graph,checkpointed,override,expected", [
    (True, True, False, None, False),    # plain training: nothing is recomputed
    (True, True, True, None, True),      # Hugging Face gradient checkpointing
    (True, False, False, None, True),    # reentrant checkpoint: original forward without grad
    (False, False, False, None, False),  # eval under no_grad
    (True, True, False, True, True), (True, False, True, False, False), (False, True, True, True, False)])
def test_cache_for_recompute(training, in_graph, checkpointed, override, expected):
    assert policy.cache_for_recompute(training, in_graph, checkpointed, override) is expected


def test_lm_head_names():
    assert policy.is_lm_head_name("lm_head") and policy.is_lm_head_name("model.embed_out")
    assert not policy.is_lm_head_name("model.layers.0.mlp.down_proj") and not policy.is_lm_head_name(None)


def test_stats_summary_and_wire_bytes_ratio():
    s = runtime.EchoStats(forward_calls=3, backward_calls=2, bytes_sent=10, bytes_16bit=40)
    assert s.summary() == {"forward_calls": 3, "backward_calls": 2, "bytes_sent": 10, "bytes_16bit": 40}
    # The 4-bit message of 128 elements: 64 bytes of codes, 4 of fp16 scale and zero, vs 256 at 16 bits.
    assert wire_bytes(128, 4, 128) == 68 and wire_bytes(128, 8, 128) == 132


def test_enable_without_tensor_parallel_layers_is_a_noop(log):
    import echo_ds.deepspeed as echo

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert echo.enable(model, {"bits": 4}) is None
    assert echo.get_runtime(model) is None
    assert any("no tensor-parallel layer" in msg and "autotp_size" in msg for _, msg in log.records)


def test_enable_disabled_section_is_a_noop():
    import echo_ds.deepspeed as echo
    from echo_ds.config import EchoConfigError

    assert echo.enable(torch.nn.Linear(2, 2), {"echo": {"enabled": False}}) is None
    assert echo.enable(torch.nn.Linear(2, 2), {"enabled": False}) is None
    # A dict without an "echo" key is read as the section itself, strictly (a typo must not disable Echo).
    with pytest.raises(EchoConfigError, match="train_batch_size"):
        echo.enable(torch.nn.Linear(2, 2), {"train_batch_size": 8})


def test_bad_echo_section_names_the_key():
    import echo_ds.deepspeed as echo
    from echo_ds.config import EchoConfigError

    with pytest.raises(EchoConfigError, match=r"echo\.bits=3"):
        echo.enable(torch.nn.Linear(2, 2), {"echo": {"bits": 3}})
    with pytest.raises(EchoConfigError, match="backend"):
        echo.enable(torch.nn.Linear(2, 2), {"backend": "nccl"})


def test_enable_rejects_what_it_cannot_use():
    import echo_ds.deepspeed as echo

    with pytest.raises(TypeError, match="DeepSpeedEngine, an InferenceEngine or an nn.Module"):
        echo.enable(object())
    with pytest.raises(TypeError, match="EchoConfig"):
        echo.enable(torch.nn.Linear(2, 2), 42)


def test_init_inference_conflicting_sections():
    import echo_ds.deepspeed as echo

    with pytest.raises(ValueError, match="both in 'config' and as a keyword"):
        echo.init_inference(torch.nn.Linear(2, 2), config={"echo": {"bits": 4}}, echo={"bits": 8})
    with pytest.raises(ValueError, match="dict or a path"):
        echo.init_inference(torch.nn.Linear(2, 2), config=42)


def test_ds_configs_parse():
    """The shipped configs: the echo sections are valid, the 16-bit ones are the same minus Echo."""
    import json
    import os

    from echo_ds.config import EchoConfig

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ds_configs")
    load = lambda name: json.load(open(os.path.join(root, name)))  # noqa: E731
    for pair in (("tp2_cpu_echo4.json", "tp2_cpu_16bit.json"), ("tp4_gpu_echo4.json", "tp4_gpu_16bit.json")):
        echo_cfg, plain = load(pair[0]), load(pair[1])
        assert EchoConfig.from_ds_config(echo_cfg).bits == 4
        assert {k: v for k, v in echo_cfg.items() if k != "echo"} == plain
        assert not EchoConfig.from_ds_config(plain).enabled
    assert load("tp2_cpu_echo4.json")["optimizer"]["params"]["torch_adam"] is True
    assert load("tp2_cpu_echo4.json")["tensor_parallel"]["autotp_size"] == 2
    assert load("tp4_gpu_echo4.json")["tensor_parallel"]["autotp_size"] == 4
    inf = load("inference_tp4_echo4.json")
    assert EchoConfig.from_ds_config(inf).enabled and inf["tensor_parallel"]["tp_size"] == 4


def test_init_inference_reads_a_path_as_deepspeed_does(tmp_path):
    """A config path is read as DeepSpeed reads it: comments allowed, duplicate keys refused naming the file."""
    import echo_ds.deepspeed as echo
    from echo_ds.config import EchoConfigError

    commented = tmp_path / "inference.json"
    commented.write_text('{\n  // the Echo section\n  "echo": {"bits": 4}\n}\n')
    with pytest.raises(ValueError, match="both in 'config' and as a keyword"):  # read, then the sections compared
        echo.init_inference(torch.nn.Linear(2, 2), config=str(commented), echo={"bits": 8})
    duplicated = tmp_path / "dup.json"
    duplicated.write_text('{"echo": {"bits": 4, "bits": 8}}')
    with pytest.raises(EchoConfigError, match="dup.json.*duplicate key 'bits'"):
        echo.init_inference(torch.nn.Linear(2, 2), config=duplicated)


def test_a_narrow_compensator_state_keeps_the_p2p_transport(log):
    # The one-launch kernel holds every stored format (echo_ds.ops.kernels.SUPPORTED_STATE_DTYPES): a
    # config with echo.<direction>.state_dtype "int8" / "int4" keeps the transport; a format the kernels
    # did not hold would send the group to the reference path with a warning naming the setting.
    for states in ({"forward": "bf16", "backward": "bf16"}, {"forward": "int4", "backward": "int8"}):
        assert policy.p2p_transport_status("cuda", 4, state_dtypes=states) == (True, "")
    ok, why = policy.p2p_transport_status("cuda", 4, state_dtypes={"forward": "fp8", "backward": "bf16"})
    assert ok is False and 'echo.forward.state_dtype="fp8"' in why and "backward" not in why
    # A group that cannot use the transport anyway keeps its own reason.
    assert "CUDA" in policy.p2p_transport_status("cpu", 4, state_dtypes={"forward": "int4"})[1]
    c = policy.select_backend("p2p", "cuda", 4, (ok, why))
    assert (c.name, c.level) == ("reference", "warning") and "fp8" in c.reason
    for _ in range(3):
        echo_log.log_once(c.level, "echo: " + c.reason)
    assert [lvl for lvl, _ in log.records] == ["warning"]


def test_the_kernel_wrappers_take_every_stored_format_and_refuse_a_mismatch():
    from echo_ds.compensator import Compensator
    from echo_ds.config import DirectionConfig
    from echo_ds.ops import kernels as K

    comps = {}
    for state_dtype in ("bf16", "int8", "int4"):
        comp = comps[state_dtype] = Compensator(DirectionConfig(state_dtype=state_dtype))
        comp.correction((2, 1, 64), "cpu")
        state = K.kernel_state(comp)
        assert K._state_args(state["m1"], state["m2"], state["exponent"], comp)[:3] == tuple(state.values())
    # An "int4" compensator's own m1, m2 are None: passed as they are, they would read as "no compensator".
    with pytest.raises(ValueError, match="come with the state's m1"):
        K._state_args(comps["int4"].m1, comps["int4"].m2, comps["int4"].exponent, comps["int4"])
    with pytest.raises(ValueError, match="come with the state's m1"):
        K._state_args(None, None, None, comps["int4"])
    # codes handed over with another format's coefficients
    with pytest.raises(K.UnsupportedStateDtype, match="state_dtype 'bf16' takes"):
        K._state_args(comps["int8"].m1, comps["int8"].m2, comps["int8"].exponent, comps["bf16"])
