"""The "echo" section: defaults, every constraint with a message naming key/value/allowed, sources."""

import json

import pytest

from echo_ds.config import EchoConfig, EchoConfigError


def test_defaults_are_the_documented_schema():
    cfg = EchoConfig()
    assert cfg.enabled and cfg.bits == 4 and cfg.group_size == 128 and cfg.quantizer == "zero_aware"
    assert cfg.rotation == "hadamard" and cfg.backend == "auto" and cfg.min_message_bytes == 0
    for d, gain in ((cfg.forward, 1.0), (cfg.backward, 0.75)):
        assert (d.compensate, d.gain, d.blend, d.slow_decay, d.fast_decay, d.residual) == \
            (True, gain, 0.35, 0.7, 0.3, "local")
    # A partial direction section keeps that direction's own defaults.
    assert EchoConfig(forward={"blend": 0.4}).forward.gain == 1.0
    assert EchoConfig(backward={"blend": 0.4}).backward.gain == 0.75
    assert cfg.backward.pow2_rescale and not hasattr(cfg.forward, "pow2_rescale")
    assert (cfg.early_sites.bits, cfg.early_sites.fraction) == (8, 0.0)


@pytest.mark.parametrize("section, key, value, allowed", [
    ({"bits": 3}, "echo.bits", "3", "(4, 8)"),
    ({"bits": 16}, "echo.bits", "16", "(4, 8)"),
    ({"group_size": 100}, "echo.group_size", "100", "power of two"),
    ({"group_size": 8}, "echo.group_size", "8", "[16, 4096]"),
    ({"group_size": 8192}, "echo.group_size", "8192", "[16, 4096]"),
    ({"quantizer": "nf4"}, "echo.quantizer", "'nf4'", "'zero_aware', 'symmetric' or 'naive'"),
    ({"rotation": "dct"}, "echo.rotation", "'dct'", "'none' or 'hadamard'"),
    ({"backend": "nccl"}, "echo.backend", "'nccl'", "'auto', 'reference' or 'p2p'"),
    ({"min_message_bytes": -1}, "echo.min_message_bytes", "-1", "greater than or equal to 0"),
    ({"forward": {"gain": 1.5}}, "echo.forward.gain", "1.5", "less than or equal to 1"),
    ({"forward": {"gain": -0.1}}, "echo.forward.gain", "-0.1", "greater than or equal to 0"),
    ({"backward": {"blend": 2}}, "echo.backward.blend", "2", "less than or equal to 1"),
    ({"forward": {"slow_decay": 1.0}}, "echo.forward.slow_decay", "1.0", "less than 1"),
    ({"backward": {"fast_decay": 1}}, "echo.backward.fast_decay", "1", "less than 1"),
    ({"forward": {"residual": "input"}}, "echo.forward.residual", "'input'", "'output' or 'local'"),
    ({"early_sites": {"fraction": 1.2}}, "echo.early_sites.fraction", "1.2", "less than or equal to 1"),
    ({"early_sites": {"bits": 2}}, "echo.early_sites.bits", "2", "(4, 8)"),
    ({"bitz": 4}, "echo.bitz", "4", "allowed keys: enabled, bits"),
    ({"forward": {"gian": 1}}, "echo.forward.gian", "1", "allowed keys: compensate, gain"),
    ({"forward": {"pow2_rescale": True}}, "echo.forward.pow2_rescale", "True", "allowed keys"),
    ({"enabled": "maybe"}, "echo.enabled", "'maybe'", "boolean"),
])
def test_invalid_values_name_key_value_and_allowed(section, key, value, allowed):
    with pytest.raises(EchoConfigError) as e:
        EchoConfig(**section)
    msg = str(e.value)
    assert f"{key}={value}" in msg and allowed in msg, msg


def test_from_ds_config_sources(tmp_path):
    ds = {"train_batch_size": 8, "echo": {"bits": 8, "forward": {"residual": "local"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    for source in (ds, path, str(path)):
        cfg = EchoConfig.from_ds_config(source)
        assert cfg.bits == 8 and cfg.forward.residual == "local" and cfg.backward.gain == 0.75
    assert EchoConfig.from_ds_config({"bits": 8}).bits == 8  # a bare section
    assert not EchoConfig.from_ds_config({"train_batch_size": 8}).enabled  # no section: off
    with pytest.raises(EchoConfigError, match="echo.bits=5"):
        EchoConfig.from_ds_config({"echo": {"bits": 5}})
    with pytest.raises(EchoConfigError, match="must be an object"):
        EchoConfig.from_ds_config({"echo": 4})


def test_auto_survives_deepspeeds_auto_stripping():
    # DeepSpeed's models drop "auto" values unless strict; here "auto" is a real value.
    assert EchoConfig(backend="auto").backend == "auto"
    assert EchoConfig(backend="p2p").backend == "p2p"


def test_quant_spec_and_site_bits():
    cfg = EchoConfig(bits=4, group_size=64, rotation="hadamard", early_sites={"bits": 8, "fraction": 0.5})
    spec = cfg.quant_spec()
    assert (spec.bits, spec.group_size, spec.policy, spec.rotation) == (4, 64, "zero_aware", True)
    assert cfg.quant_spec(bits=8).bits == 8
    assert [cfg.bits_for_site(i, 6) for i in range(6)] == [8, 8, 8, 4, 4, 4]
    assert [EchoConfig().bits_for_site(i, 4) for i in range(4)] == [4, 4, 4, 4]
    full = EchoConfig(early_sites={"fraction": 1.0})
    assert all(full.bits_for_site(i, 5) == 8 for i in range(5))
