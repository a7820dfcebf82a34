"""The "echo" section: defaults, every constraint with a message naming key/value/allowed, sources."""

import json

import pytest

from echo_ds.config import DirectionConfig, EchoConfig, EchoConfigError


def test_defaults_are_the_documented_schema():
    cfg = EchoConfig()
    assert cfg.enabled and cfg.bits == 4 and cfg.group_size == 64 and cfg.quantizer == "zero_aware_int"
    assert cfg.rotation == "hadamard" and cfg.backend == "auto" and cfg.min_message_bytes == 0
    assert cfg.on_fault == "raise"
    for d, gain in ((cfg.forward, 1.0), (cfg.backward, 0.75)):
        assert (d.compensate, d.gain, d.blend, d.slow_decay, d.fast_decay, d.residual) == \
            (True, gain, 0.35, 0.7, 0.3, "local")
    # A partial direction section keeps that direction's own defaults.
    assert EchoConfig(forward={"blend": 0.4}).forward.gain == 1.0
    assert EchoConfig(backward={"blend": 0.4}).backward.gain == 0.75
    assert cfg.backward.pow2_rescale is True and cfg.forward.pow2_rescale == "auto"
    assert (cfg.early_sites.bits, cfg.early_sites.fraction) == (8, 0.0)
    # The compensator state is stored as int4 in both directions (issue 34); bf16 stays selectable.
    assert cfg.forward.state_dtype == cfg.backward.state_dtype == "int4"
    assert EchoConfig(forward={"state_dtype": "bf16"}).forward.state_dtype == "bf16"


@pytest.mark.parametrize("section, key, value, allowed", [
    ({"bits": 3}, "echo.bits", "3", "(4, 8)"),
    ({"bits": 16}, "echo.bits", "16", "(4, 8)"),
    ({"group_size": 100}, "echo.group_size", "100", "power of two"),
    ({"group_size": 8}, "echo.group_size", "8", "[16, 4096]"),
    ({"group_size": 8192}, "echo.group_size", "8192", "[16, 4096]"),
    ({"quantizer": "nf4"}, "echo.quantizer", "'nf4'", "'zero_aware', 'symmetric', 'naive' or 'zero_aware_int'"),
    ({"rotation": "dct"}, "echo.rotation", "'dct'", "'none' or 'hadamard'"),
    ({"backend": "nccl"}, "echo.backend", "'nccl'", "'auto', 'reference' or 'p2p'"),
    ({"on_fault": "ignore"}, "echo.on_fault", "'ignore'", "'raise' or 'reference'"),
    ({"min_message_bytes": -1}, "echo.min_message_bytes", "-1", "greater than or equal to 0"),
    ({"forward": {"gain": 1.5}}, "echo.forward.gain", "1.5", "less than or equal to 1"),
    ({"forward": {"gain": -0.1}}, "echo.forward.gain", "-0.1", "greater than or equal to 0"),
    ({"backward": {"blend": 2}}, "echo.backward.blend", "2", "less than or equal to 1"),
    ({"forward": {"slow_decay": 1.0}}, "echo.forward.slow_decay", "1.0", "less than 1"),
    ({"backward": {"fast_decay": 1}}, "echo.backward.fast_decay", "1", "less than 1"),
    ({"forward": {"residual": "input"}}, "echo.forward.residual", "'input'", "'output' or 'local'"),
    ({"forward": {"state_dtype": "int3"}}, "echo.forward.state_dtype", "'int3'", "'bf16', 'int8' or 'int4'"),
    ({"backward": {"state_dtype": 8}}, "echo.backward.state_dtype", "8", "'bf16', 'int8' or 'int4'"),
    ({"backward": {"state_dtyp": "int8"}}, "echo.backward.state_dtyp", "'int8'", "did you mean 'state_dtype'?"),
    ({"early_sites": {"fraction": 1.2}}, "echo.early_sites.fraction", "1.2", "less than or equal to 1"),
    ({"early_sites": {"bits": 2}}, "echo.early_sites.bits", "2", "(4, 8)"),
    ({"bitz": 4}, "echo.bitz", "4", "allowed keys: enabled, bits"),
    ({"forward": {"gian": 1}}, "echo.forward.gian", "1", "allowed keys: compensate, gain"),
    ({"forward": {"pow2_rescale": "yes"}}, "echo.forward.pow2_rescale", "'yes'", 'true, false or "auto"'),
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
    assert (spec.bits, spec.group_size, spec.quantizer, spec.rotation) == (4, 64, "zero_aware_int", True)
    assert cfg.quant_spec(bits=8).bits == 8
    assert [cfg.bits_for_site(i, 6) for i in range(6)] == [8, 8, 8, 4, 4, 4]
    assert [EchoConfig().bits_for_site(i, 4) for i in range(4)] == [4, 4, 4, 4]
    full = EchoConfig(early_sites={"fraction": 1.0})
    assert all(full.bits_for_site(i, 5) == 8 for i in range(5))


# ---------------------------------------------------------------------------------------------------------
# Misuse: every level refuses ill-typed values ("auto" included), the message naming key, value, allowed.
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("section, key, value, allowed", [
    # DeepSpeed's models drop "auto" unless strict, and pydantic builds nested sections with strict off.
    ({"forward": {"gain": "auto"}}, "echo.forward.gain", "'auto'", "valid number (>= 0.0, <= 1.0)"),
    ({"backward": {"slow_decay": "auto"}}, "echo.backward.slow_decay", "'auto'", "valid number (>= 0.0, < 1.0)"),
    ({"early_sites": {"fraction": "auto"}}, "echo.early_sites.fraction", "'auto'", "valid number"),
    ({"early_sites": {"bits": "auto"}}, "echo.early_sites.bits", "'auto'", "valid integer"),
    ({"bits": "auto"}, "echo.bits", "'auto'", "valid integer"),
    ({"min_message_bytes": "auto"}, "echo.min_message_bytes", "'auto'", "valid integer (>= 0)"),
    # Strings, bools and floats are not coerced.
    ({"backward": {"blend": "0.5"}}, "echo.backward.blend", "'0.5'", "valid number"),
    ({"group_size": "128"}, "echo.group_size", "'128'", "valid integer"),
    ({"group_size": 128.5}, "echo.group_size", "128.5", "valid integer"),  # (hjson reads 128.0 as 128)
    ({"bits": True}, "echo.bits", "True", "valid integer"),
    ({"forward": {"gain": True}}, "echo.forward.gain", "True", "valid number"),
    ({"forward": {"compensate": "no"}}, "echo.forward.compensate", "'no'", "valid boolean"),
    ({"backward": {"pow2_rescale": 1}}, "echo.backward.pow2_rescale", "1", 'true, false or "auto"'),
    ({"telemetry": "true"}, "echo.telemetry", "'true'", "valid boolean"),
    ({"forward": "off"}, "echo.forward", "'off'", "valid dictionary"),
    # "strict" is not a way around the checks, at any level.
    ({"strict": False}, "echo.strict", "False", "unknown key"),
    ({"early_sites": {"strict": False}}, "echo.early_sites.strict", "False", "unknown key"),
    # Unknown keys suggest the close one.
    ({"group_sise": 64}, "echo.group_sise", "64", "did you mean 'group_size'?"),
    ({"backward": {"pow2_rescal": True}}, "echo.backward.pow2_rescal", "True", "did you mean 'pow2_rescale'?"),
])
def test_ill_typed_values_refused_at_every_level(section, key, value, allowed, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"echo": section}))
    for build in (lambda: EchoConfig(**section), lambda: EchoConfig.from_ds_config(path)):
        with pytest.raises(EchoConfigError) as e:
            build()
        msg = str(e.value)
        assert f"{key}={value}" in msg and allowed in msg, msg


def test_sections_and_assignments_checked_on_their_own():
    from echo_ds.config import ForwardConfig

    with pytest.raises(EchoConfigError, match=r"echo\.forward\.gain='auto': Input should be a valid number"):
        ForwardConfig(gain="auto")
    cfg = EchoConfig()
    with pytest.raises(EchoConfigError, match=r"echo\.bits='8': Input should be a valid integer"):
        cfg.bits = "8"
    with pytest.raises(EchoConfigError, match=r"echo\.forward\.blend=2: Input should be less than or equal to 1"):
        cfg.forward.blend = 2
    assert cfg.bits == 4 and cfg.forward.blend == 0.35


@pytest.mark.parametrize("ds, match", [
    ({"bitz": 4}, r"echo\.bitz=4: unknown key \(did you mean 'bits'\?\)"),
    ({"enable": True, "bits": 8}, r"echo\.enable=True: unknown key \(did you mean 'enabled'\?\)"),
    ({"bits": 8, "forward": {"gian": 1.0}}, r"echo\.forward\.gian=1\.0: unknown key \(did you mean 'gain'\?\)"),
    ({"train_batch_size": 8, "bits": 4}, r"no \"echo\" section but has keys of one at its top level \(bits=4\)"),
    ({"train_batch_size": 8, "ecoh": {"bits": 4}}, r"ecoh=\{'bits': 4\}: unknown key, did you mean \"echo\"\?"),
])
def test_bare_section_with_misspelt_key_is_refused(ds, match):
    with pytest.raises(EchoConfigError, match=match):
        EchoConfig.from_ds_config(ds)


@pytest.mark.parametrize("ds", [
    {},
    {"train_batch_size": 8, "fp16": {"enabled": True}, "zero_optimization": {"stage": 1, "sub_group_size": 1e9},
     "tensor_parallel": {"autotp_size": 2}, "gradient_clipping": 1.0, "steps_per_print": 10,
     "quantize_training": {"enabled": False}, "compile": {"backend": "inductor"}},
])
def test_ds_config_without_echo_section_is_off(ds):
    assert not EchoConfig.from_ds_config(ds).enabled


def test_files_read_as_deepspeed_reads_them(tmp_path):
    readme = (tmp_path / "readme.json")
    # The README's own example: // comments, and DeepSpeed (hjson) also takes # and /* */.
    readme.write_text('{"train_batch_size": 8, # batch\n "echo": {\n  "bits": 8,      // 4 or 8\n'
                      '  /* hadamard or none */ "rotation": "none",\n  "backend": "auto"\n }\n}\n')
    cfg = EchoConfig.from_ds_config(readme)
    assert (cfg.bits, cfg.rotation, cfg.backend) == (8, "none", "auto")
    assert not EchoConfig.from_ds_config(_write(tmp_path, "empty.json", "")).enabled


@pytest.mark.parametrize("text, match", [
    ('{"echo": {"bits": 4, "bits": 8}}', r"duplicate key 'bits' \(values 4 and 8\)"),
    ('{"echo": {"forward": {"gain": 1, "gain": 0.5}}}', r"duplicate key 'gain' \(values 1 and 0\.5\)"),
    ('{"echo": {}, "echo": {"bits": 8}}', r"duplicate key 'echo'"),
    ('{"echo": {"bits": 4,, }}', r"line 1 column"),
    ('[{"echo": {}}]', r"must be a JSON object, got list"),
    (b'{"echo": {"backend": "\xff"}}', r"utf-8"),
])
def test_file_errors_name_the_file(tmp_path, text, match):
    path = _write(tmp_path, "my_ds.json", text)
    with pytest.raises(EchoConfigError, match=match) as e:
        EchoConfig.from_ds_config(str(path))
    assert str(e.value).startswith(f"{path}: ")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        EchoConfig.from_ds_config(tmp_path / "missing.json")


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


# ---------------------------------------------------------------------------------------------------------
# Misuse of the public constructors and functions around the config.
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    ({"rotation": "none"}, TypeError, r"rotation='none' must be True or False"),
    ({"rotation": "hadamard"}, TypeError, r"rotation='hadamard' must be True or False"),
    ({"rotation": 1}, TypeError, r"rotation=1 must be True or False"),
    ({"bits": True}, TypeError, r"bits=True must be an int"),
    ({"bits": 4.0}, TypeError, r"bits=4\.0 must be an int"),
    ({"group_size": 128.0}, TypeError, r"group_size=128\.0 must be an int"),
    ({"quantizer": None}, TypeError, r"quantizer=None must be one of"),
    ({"bits": 3}, ValueError, r"bits=3 is not supported"),
])
def test_quant_spec_refuses_misuse(kwargs, error, match):
    from echo_ds.quant import QuantSpec

    with pytest.raises(error, match=match):
        QuantSpec(**kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"coalesce": "no"}, TypeError, r"coalesce='no' must be True or False"),
    ({"coalesce": None}, TypeError, r"coalesce=None must be True or False"),
    ({"site_check_interval": -1}, ValueError, r"site_check_interval=-1 must be >= 0"),
    ({"site_check_interval": 1.5}, TypeError, r"site_check_interval=1\.5 must be an int >= 0"),
    ({"site_check_interval": True}, TypeError, r"site_check_interval=True must be an int >= 0"),
    ({"telemetry": "yes"}, TypeError, r"telemetry='yes' must be (None, )?True or False"),
    ({"quantize_lm_head": 1}, TypeError, r"quantize_lm_head=1 must be None, True or False"),
    ({"recompute_cache": "auto"}, TypeError, r"recompute_cache='auto' must be None, True or False"),
])
def test_enable_and_runtime_refuse_misuse(kwargs, error, match):
    import torch

    import echo_ds.deepspeed as echo

    with pytest.raises(error, match="echo_ds.enable: " + match):
        echo.enable(torch.nn.Linear(2, 2), {"bits": 4}, **kwargs)
    if "quantize_lm_head" not in kwargs:  # (an enable() argument only)
        # The runtime checks before it touches the process group (none exists here).
        with pytest.raises(error, match="EchoRuntime: " + match):
            echo.EchoRuntime(EchoConfig(), None, "cpu", **kwargs)


def test_runtime_refuses_a_config_that_is_not_one():
    import echo_ds.deepspeed as echo

    with pytest.raises(TypeError, match="EchoRuntime: config must be an EchoConfig, got dict"):
        echo.EchoRuntime({"bits": 4}, None, "cpu")
    with pytest.raises(ValueError, match="EchoRuntime: log_interval=-5 must be >= 0"):
        echo.EchoRuntime(EchoConfig(), None, "cpu", log_interval=-5)


def test_the_default_state_dtype_follows_the_residual(log):
    # "local" (the default residual): int4; "output": bf16, whose state holds each rank's deviation from the
    # mean, which 4 bits round coarsely. An explicit choice is kept; int4 with "output" is warned about once.
    assert DirectionConfig().state_dtype == "int4"
    assert DirectionConfig(residual="output").state_dtype == "bf16"
    cfg = EchoConfig.from_ds_config({"echo": {"forward": {"residual": "output"}}})
    assert (cfg.forward.state_dtype, cfg.backward.state_dtype) == ("bf16", "int4")
    assert DirectionConfig(residual="output", state_dtype="int8").state_dtype == "int8"
    assert not log.records
    for _ in range(2):
        assert DirectionConfig(residual="output", state_dtype="int4").state_dtype == "int4"
    assert [lvl for lvl, _ in log.records] == ["warning"]
    assert 'state_dtype="int4" with residual "output"' in log.records[0][1]
    DirectionConfig(residual="output", state_dtype="int4", compensate=False)  # no state: nothing to say
    assert len(log.records) == 1


@pytest.mark.parametrize("state_dtype", ("bf16", "int8", "int4"))
def test_state_dtype_per_direction_reaches_the_compensator(state_dtype):
    from echo_ds.compensator import make_compensator

    cfg = EchoConfig.from_ds_config({"echo": {"forward": {"state_dtype": state_dtype}}})
    assert cfg.forward.state_dtype == state_dtype and cfg.backward.state_dtype == "int4"  # the default
    assert make_compensator(cfg.forward).state_dtype == state_dtype
    assert make_compensator(cfg.backward).state_dtype == "int4"
