"""``ECHO_DS_DISABLE`` and ``ECHO_DS_BACKEND``: parsed (pure), read by ``enable``, logged once.

The parsing and the messages are pure functions of echo_ds.deepspeed.policy (no process group); one spawn
of 2 gloo ranks checks what ``enable`` does with them on DeepSpeed's real AutoTP layers: Echo off leaves
the layer and its exact all-reduce untouched, and the backend override reaches the runtime without
changing the caller's config.
"""

from __future__ import annotations

import os

import pytest

from echo_ds.deepspeed import policy

from utils import RecordingLog, deepspeed_env, free_port, run_distributed



# ----------------------------------------------------------------------------------------------------
# Parsing (pure)
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("environ,disabled,backend", [
    ({}, False, None),
    ({"ECHO_DS_DISABLE": "1"}, True, None),
    ({"ECHO_DS_DISABLE": "true"}, True, None),
    ({"ECHO_DS_DISABLE": " ON "}, True, None),
    ({"ECHO_DS_DISABLE": "0"}, False, None),
    ({"ECHO_DS_DISABLE": ""}, False, None),
    ({"ECHO_DS_BACKEND": "reference"}, False, "reference"),
    ({"ECHO_DS_BACKEND": "P2P"}, False, "p2p"),
    ({"ECHO_DS_BACKEND": "auto", "ECHO_DS_DISABLE": "no"}, False, "auto"),
    ({"ECHO_DS_BACKEND": ""}, False, None),
    ({"ECHO_DS_BACKEND": "reference", "ECHO_DS_DISABLE": "1"}, True, "reference"),
])
def test_switches_are_read_from_the_environment(environ, disabled, backend):
    s = policy.environment_switches(environ)
    assert (s.disabled, s.backend) == (disabled, backend)


@pytest.mark.parametrize("environ,names", [
    ({"ECHO_DS_DISABLE": "2"}, ("ECHO_DS_DISABLE='2'", "must be 1")),
    ({"ECHO_DS_DISABLE": "disable"}, ("ECHO_DS_DISABLE='disable'",)),
    ({"ECHO_DS_BACKEND": "nccl"}, ("ECHO_DS_BACKEND='nccl'", "auto, reference, p2p")),
])
def test_a_bad_value_is_refused_with_the_variable_and_what_is_allowed(environ, names):
    with pytest.raises(ValueError) as e:
        policy.environment_switches(environ)
    for name in names:
        assert name in str(e.value)


def test_the_variables_are_those_the_docs_name():
    assert (policy.DISABLE_VAR, policy.BACKEND_VAR) == ("ECHO_DS_DISABLE", "ECHO_DS_BACKEND")


def test_messages_say_what_changed_and_how_to_undo_it():
    off = policy.environment_message(policy.EnvironmentSwitches(disabled=True), "auto")
    assert off[0] == "warning" and "ECHO_DS_DISABLE=1" in off[1] and "unset ECHO_DS_DISABLE" in off[1]
    over = policy.environment_message(policy.EnvironmentSwitches(backend="reference"), "auto")
    assert over[0] == "warning" and 'overrides "backend": "auto"' in over[1] and "unset ECHO_DS_BACKEND" in over[1]
    same = policy.environment_message(policy.EnvironmentSwitches(backend="reference"), "reference")
    assert same[0] == "info"
    assert policy.environment_message(policy.EnvironmentSwitches(), "auto") is None
    assert policy.environment_message(policy.EnvironmentSwitches(backend="p2p"), None) is None


# ----------------------------------------------------------------------------------------------------
# enable(): read once per call, before the model is looked at; logged once
# ----------------------------------------------------------------------------------------------------

def test_disabled_enable_returns_before_looking_at_the_engine(monkeypatch, log):
    from echo_ds.deepspeed import enable

    monkeypatch.delenv("ECHO_DS_DISABLE", raising=False)
    with pytest.raises(TypeError, match="expects a DeepSpeedEngine"):
        enable(object(), {"echo": {"bits": 4}})  # without the switch: the engine is checked (and refused)
    monkeypatch.setenv("ECHO_DS_DISABLE", "1")
    for _ in range(3):
        assert enable(object(), {"echo": {"bits": 4}}) is None
    assert [level for level, _ in log.records] == ["warning"]
    assert "ECHO_DS_DISABLE=1" in log.records[0][1]
    monkeypatch.setenv("ECHO_DS_DISABLE", "maybe")
    with pytest.raises(ValueError, match="ECHO_DS_DISABLE='maybe'"):
        enable(object(), {"echo": {"bits": 4}})


def test_initialize_reads_the_switches_before_it_builds_the_engine(monkeypatch, log):
    from echo_ds.deepspeed import api

    built = []

    def fake_initialize(*args, **kwargs):
        built.append(kwargs)
        return object(), None, None, None  # not an engine: only the disabled path may accept it

    monkeypatch.setattr(api.deepspeed, "initialize", fake_initialize)
    monkeypatch.setenv("ECHO_DS_BACKEND", "nccl")
    with pytest.raises(ValueError, match="ECHO_DS_BACKEND='nccl'"):
        api.initialize(model=None, config={"echo": {"bits": 4}})
    assert built == []  # refused before DeepSpeed built anything
    monkeypatch.delenv("ECHO_DS_BACKEND")
    monkeypatch.setenv("ECHO_DS_DISABLE", "1")
    result = api.initialize(model=None, config={"echo": {"bits": 4}})
    assert len(built) == 1 and result[1:] == (None, None, None)
    assert [level for level, _ in log.records] == ["warning"]


# ----------------------------------------------------------------------------------------------------
# On DeepSpeed's AutoTP layers, 2 gloo ranks
# ----------------------------------------------------------------------------------------------------

HIDDEN = 64


def _layers_case(rank, world_size, shm_port):
    import torch
    import torch.distributed as dist

    from deepspeed.module_inject.layers import LinearAllreduce

    import echo_ds.deepspeed as echo
    from echo_ds import log as echo_log_mod
    from echo_ds.config import EchoConfig

    deepspeed_env(rank, world_size, shm_port)
    echo_log_mod.logger = RecordingLog()
    records = echo_log_mod.logger.records

    def layer():
        torch.manual_seed(0)
        return LinearAllreduce(torch.nn.Linear(2 * HIDDEN, HIDDEN, bias=False), mp_group=dist.group.WORLD,
                               name="down")

    x = torch.randn(4, 2 * HIDDEN // world_size, generator=torch.Generator().manual_seed(10 + rank))
    out = {}
    for case, env in (("plain", {}), ("disabled", {"ECHO_DS_DISABLE": "1"}),
                      ("forced", {"ECHO_DS_BACKEND": "reference"})):
        for var in ("ECHO_DS_DISABLE", "ECHO_DS_BACKEND"):
            os.environ.pop(var, None)
        os.environ.update(env)
        del records[:]
        cfg = EchoConfig(backend="p2p")  # on CPU, "p2p" falls back with a warning; the override silences it
        module = layer()
        with torch.no_grad():
            exact = module(x)  # DeepSpeed's own all-reduce
        runtime = echo.enable(module, cfg)
        with torch.no_grad():
            y = module(x)
        out[case] = {
            "runtime": runtime is not None,
            "patched": type(module) is not LinearAllreduce,
            "equal_to_deepspeed": torch.equal(y, exact),
            "backend": None if runtime is None else runtime.backend,
            "runtime_config_backend": None if runtime is None else runtime.config.backend,
            "caller_config_backend": cfg.backend,
            "warnings": [m for level, m in records if level == "warning"] if rank == 0 else None,
        }
        if runtime is not None:
            echo.disable(module)
    return out


@pytest.fixture(scope="module")
def layer_results():
    return run_distributed(_layers_case, 2, free_port(), timeout=180)


def test_echo_on_without_the_switches(layer_results):
    r = layer_results[0]["plain"]
    assert r["runtime"] and r["patched"] and not r["equal_to_deepspeed"]  # 4-bit Echo: not the exact sum
    assert r["backend"] == "reference" and r["runtime_config_backend"] == "p2p"
    assert any('echo.backend="p2p" is unavailable' in w for w in r["warnings"])


def test_disable_leaves_deepspeeds_all_reduce(layer_results):
    for rank_result in layer_results:
        r = rank_result["disabled"]
        assert not r["runtime"] and not r["patched"] and r["equal_to_deepspeed"]
    assert [w for w in layer_results[0]["disabled"]["warnings"] if "ECHO_DS_DISABLE=1" in w]


def test_backend_override_reaches_the_runtime_not_the_callers_config(layer_results):
    r = layer_results[0]["forced"]
    assert r["runtime"] and r["patched"] and not r["equal_to_deepspeed"]
    assert r["backend"] == r["runtime_config_backend"] == "reference"
    assert r["caller_config_backend"] == "p2p"
    assert len([w for w in r["warnings"] if "ECHO_DS_BACKEND=reference" in w]) == 1
    assert not any("is unavailable" in w for w in r["warnings"])
