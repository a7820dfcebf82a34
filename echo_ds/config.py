"""The ``"echo"`` section of ds_config.json.

::

    "echo": {
      "enabled": true,
      "bits": 4,                    // 4 or 8
      "group_size": 64,             // power of two, 16..4096
      "quantizer": "zero_aware_int", // "zero_aware_int" | "zero_aware" | "symmetric" | "naive"
      "rotation": "hadamard",       // "none" | "hadamard"
      "forward":  {"compensate": true, "gain": 1.0, "blend": 0.35, "slow_decay": 0.7,
                   "fast_decay": 0.3, "residual": "local", "pow2_rescale": "auto",
                   "state_dtype": "int4"},  // "int4" | "int8" | "bf16" (echo_ds.compensator)
      "backward": {"compensate": true, "gain": 0.75, "blend": 0.35, "slow_decay": 0.7,
                   "fast_decay": 0.3, "residual": "local", "pow2_rescale": true, "state_dtype": "int4"},
      "early_sites": {"bits": 8, "fraction": 0.0},
      "backend": "auto",            // "auto" | "reference" | "p2p"
      "on_fault": "raise",          // "raise" | "reference": after a p2p peer fault (EchoBuffer)
      "min_message_bytes": 0,
      "telemetry": false,           // record the norm of each call's revealed error
      "quantize_lm_head": false     // also compress the output head's all-reduce (inference)
    }

Defaults: the accuracy study (docs/accuracy.md, SmolLM2-135M at P = 4) and the pretraining study
(docs/training.md) decided them: the Hadamard rotation and the "local" residual at forward gain 1.0 cut
the perplexity increase of the paper's method at 4 and 8 bits (docs/accuracy.md, "What we conclude"),
quantizer "zero_aware_int" at g = 64 is the shipped 4-bit format ("The shipped default"), and in
training "local" had the smallest 4-bit gap. The compensator state is stored as "int4" in both
directions: within issue 34's accuracy goals against "bf16", in about a quarter of its bytes
(docs/kernels.md, "Narrow states"). The paper's method is ``rotation: "none"`` with ``residual:
"output"`` and ``gain: 0.75`` in both directions (ds_configs/eval/4bit_full.json).

The models are DeepSpeed's own ``DeepSpeedConfigModel`` (pydantic, unknown keys forbidden). Every invalid
value raises :class:`EchoConfigError` with the key's dotted path, the value and what is allowed.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import math
import os
from typing import Any, ClassVar, Literal, Mapping, Optional, Union, get_args

import hjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deepspeed.runtime.config_utils import DeepSpeedConfigModel

from echo_ds.quant import MAX_GROUP_SIZE, MIN_GROUP_SIZE, SUPPORTED_BITS, Quantizer, QuantSpec, is_group_size

ECHO_KEY = "echo"
# The values of "backend": "auto" (p2p where the group can use it, else reference), "reference"
# (torch.distributed), "p2p" (the CUDA peer-to-peer transport).
Backend = Literal["auto", "reference", "p2p"]
BACKENDS = get_args(Backend)
# What the p2p backend does after a failed wait (a peer stopped, killed or too far behind; a call with other
# arguments): "raise" the named error at that call and every later one, or raise it once and go on over the
# reference path ("reference"). echo_ds.p2p.EchoBuffer's on_fault has the guarantees and what the caller owes.
OnFault = Literal["raise", "reference"]
ON_FAULT = get_args(OnFault)
# The stored formats of the compensator's state (echo_ds.compensator, "Storage"): "bf16" m1 and m2 as
# bfloat16; "int8" / "int4" as 8- or 4-bit integers with one power-of-two exponent per group.
StateDtype = Literal["bf16", "int8", "int4"]
STATE_DTYPES = get_args(StateDtype)


class EchoConfigError(ValueError):
    """An invalid ``"echo"`` section: the message names the key, the value and what is allowed."""


def _supported_bits(v: int) -> int:
    if v not in SUPPORTED_BITS:
        raise ValueError(f"must be one of {SUPPORTED_BITS}")
    return v


# How many section constructors are running in this thread: pydantic builds nested sections through their
# own __init__, and only the outermost one turns the errors into one EchoConfigError with full paths.
_depth = contextvars.ContextVar("echo_config_depth", default=0)


class _Section(DeepSpeedConfigModel):
    """A level of the ``"echo"`` section: strict types, unknown keys refused, errors as EchoConfigError."""

    # Strict types: lax pydantic reads "0.5" as 0.5, "no" as False and True as the integer 1. Ints still
    # pass as floats, and dicts still build nested sections.
    model_config = ConfigDict(strict=True)
    _key: ClassVar[str] = "echo"  # dotted key of this section, for messages

    def __init__(self, **data):
        # DeepSpeedConfigModel.__init__ silently drops every value equal to "auto" unless strict=True, and
        # pydantic calls it for each nested section with strict left False ("gain": "auto" became the
        # default). Skip it: every "auto" reaches validation, and a "strict" key is an unknown key.
        with _errors(type(self)):
            BaseModel.__init__(self, **data)
        self._deprecated_fields_check()

    def __setattr__(self, name, value):
        with _errors(type(self)):  # assignments are validated too (validate_assignment)
            super().__setattr__(name, value)

    @classmethod
    def model_validate(cls, obj, **kwargs):
        with _errors(cls):
            return super().model_validate(obj, **kwargs)


@contextlib.contextmanager
def _errors(model: type):
    """The ValidationError of the outermost section being built or assigned, as one EchoConfigError."""
    outermost = _depth.get() == 0
    token = _depth.set(_depth.get() + 1)
    try:
        yield
    except ValidationError as e:
        if not outermost:
            raise
        raise EchoConfigError(_describe(e, model)) from None
    finally:
        _depth.reset(token)


class DirectionConfig(_Section):
    """Compensator of one pass direction (equations 10-11 of the paper).

    compensate: apply the error feedback at all.
    gain (eta, in [0, 1]): share of the estimated error fed back.
    blend (a, in [0, 1]): weight of the slow average m1 against the fast one m2.
    slow_decay (beta1, in [0, 1)) and fast_decay (beta2, in [0, 1)): decay rates of the two averages.
    residual: ``"output"`` is the paper's u_i = x'_i - y/P; ``"local"`` feeds each rank its own rounding
        error, u_i = -e_i (bounded state, see echo_ds.compensator).
    pow2_rescale: the exact power-of-two rescaling of the message before it is quantized (section 5.4):
        true at every call, ``"auto"`` only for a message whose largest magnitude lies outside
        [2^-6, 2^15), where fp16 group scales would clip it or flush it to zero (echo_ds.algorithm), false
        never. It applies whether or not the direction compensates.
    state_dtype: how m1 and m2 are stored between calls (echo_ds.compensator, "Storage"): ``"int4"``, the
        default with the "local" residual (1 + 1/g bytes per element for both), ``"int8"`` (2 + 1/g), the
        integers in units of one power-of-two step per group of g elements, or ``"bf16"`` (4), the default
        with the "output" residual. The reference path and the p2p kernels hold every format. Why the
        default follows the residual: "output" stores each rank's deviation from the mean contribution,
        which is large and which 4 bits round coarsely; on the residual-stream test (P = 4, 56 calls) the
        paper's method accumulated 1.27x the uncompensated error with an int4 state and 0.32x with bf16
        (tests/test_reference.py). An explicit "int4" with "output" is taken, with one warning.
    """

    _key: ClassVar[str] = "echo.<direction>"

    compensate: bool = True
    gain: float = Field(0.75, ge=0.0, le=1.0)
    blend: float = Field(0.35, ge=0.0, le=1.0)
    slow_decay: float = Field(0.7, ge=0.0, lt=1.0)
    fast_decay: float = Field(0.3, ge=0.0, lt=1.0)
    residual: Literal["output", "local"] = "local"
    pow2_rescale: Union[bool, Literal["auto"]] = "auto"
    state_dtype: StateDtype = "int4"

    @field_validator("pow2_rescale", mode="before")
    @classmethod
    def _pow2_mode(cls, v):
        if not (isinstance(v, bool) or v == "auto"):
            raise ValueError('must be true, false or "auto"')
        return v

    @model_validator(mode="after")
    def _state_dtype_for_the_residual(self):
        # NOTE: object.__setattr__: an assignment through pydantic would validate the model again.
        if "state_dtype" not in self.model_fields_set and self.residual == "output":
            object.__setattr__(self, "state_dtype", "bf16")
        elif self.compensate and self.residual == "output" and self.state_dtype == "int4":
            from echo_ds.log import log_once

            log_once("warning", f'echo: {self._key}.state_dtype="int4" with residual "output": the "output" state '
                                f'holds each rank\'s deviation from the mean, which 4 bits round coarsely (measured '
                                f'worse than no compensation on the residual-stream test); "bf16", the default '
                                f'with "output", or residual "local" avoid it')
        return self


class ForwardConfig(DirectionConfig):
    """Forward-pass compensator. Its gain defaults to 1.0 (docs/accuracy.md: with the rotation and the
    "local" residual, gain 1.0 beat 0.75 at every group size measured)."""

    _key: ClassVar[str] = "echo.forward"

    gain: float = Field(1.0, ge=0.0, le=1.0)


class BackwardConfig(DirectionConfig):
    """Backward-pass compensator; gradients are rescaled by a power of two at every call by default
    (section 5.4: they span many orders of magnitude over training)."""

    _key: ClassVar[str] = "echo.backward"

    pow2_rescale: Union[bool, Literal["auto"]] = True


class EarlySitesConfig(_Section):
    """The first ``fraction`` of the forward sites of each pass use ``bits`` (early-site 8-bit)."""

    _key: ClassVar[str] = "echo.early_sites"

    bits: int = 8
    fraction: float = Field(0.0, ge=0.0, le=1.0)

    _bits = field_validator("bits")(classmethod(lambda cls, v: _supported_bits(v)))


class EchoConfig(_Section):
    """The whole ``"echo"`` section. Construct from keywords, a dict, or :meth:`from_ds_config`."""

    enabled: bool = True
    bits: int = 4
    group_size: int = 64
    quantizer: Quantizer = "zero_aware_int"
    rotation: Literal["none", "hadamard"] = "hadamard"
    forward: ForwardConfig = Field(default_factory=ForwardConfig)
    backward: BackwardConfig = Field(default_factory=BackwardConfig)
    early_sites: EarlySitesConfig = Field(default_factory=EarlySitesConfig)
    backend: Backend = "auto"
    on_fault: OnFault = "raise"
    min_message_bytes: int = Field(0, ge=0)
    telemetry: bool = False
    quantize_lm_head: bool = False

    _bits = field_validator("bits")(classmethod(lambda cls, v: _supported_bits(v)))

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, v):
        if not is_group_size(v):
            raise ValueError(f"must be a power of two in [{MIN_GROUP_SIZE}, {MAX_GROUP_SIZE}]")
        return v

    # ------------------------------------------------------------------------------------------------

    @classmethod
    def from_ds_config(cls, ds_config: Union[str, os.PathLike, Mapping[str, Any]]) -> "EchoConfig":
        """The ``"echo"`` section of a ds_config (a path to a JSON file or a dict).

        A file is read as DeepSpeed reads it (:func:`read_ds_config`). Without an ``"echo"`` key, a mapping
        whose keys all are (or nearly are) fields of the section is read as a bare section, so a misspelt
        key is refused rather than disabling Echo; one where only some are is refused; otherwise (a
        ds_config without the section) the result has ``enabled=False``.
        """
        if isinstance(ds_config, (str, os.PathLike)):
            ds_config = read_ds_config(ds_config)
        if not isinstance(ds_config, Mapping):
            raise EchoConfigError(f"a ds_config must be a path or a mapping, got {type(ds_config).__name__}")
        if ECHO_KEY in ds_config:
            section = ds_config[ECHO_KEY]
            if not isinstance(section, Mapping):
                raise EchoConfigError(f"echo: must be an object, got {section!r}")
            return cls(**section)
        for key in ds_config:
            if _close(key, [ECHO_KEY]):
                raise EchoConfigError(f"{key}={ds_config[key]!r}: unknown key, did you mean \"echo\"?")
        ours = [k for k in ds_config if k in cls.model_fields or _close(k, cls.model_fields)]
        if ours and len(ours) < len(ds_config):
            raise EchoConfigError(
                "the ds_config has no \"echo\" section but has keys of one at its top level ("
                + ", ".join(f"{k}={ds_config[k]!r}" for k in ours) + "): move them into \"echo\": {...}")
        return cls(**ds_config) if ours else cls(enabled=False)

    def quant_spec(self, bits: Optional[int] = None) -> QuantSpec:
        """The quantizer settings of one call (``bits`` overrides the section's, e.g. early sites)."""
        return QuantSpec(bits=self.bits if bits is None else bits, group_size=self.group_size,
                         quantizer=self.quantizer, rotation=self.rotation == "hadamard")

    def bits_for_site(self, site_index: int, num_sites: int) -> int:
        """Bit width of forward site ``site_index`` (0-based) of a pass with ``num_sites`` sites."""
        num_early = math.floor(self.early_sites.fraction * num_sites + 1e-9)
        return self.early_sites.bits if site_index < num_early else self.bits

    def direction(self, direction: str) -> DirectionConfig:
        if direction not in ("forward", "backward"):
            raise ValueError(f"direction={direction!r} must be 'forward' or 'backward'")
        return self.forward if direction == "forward" else self.backward


def read_ds_config(path: Union[str, os.PathLike]) -> dict:
    """A ds_config file read as ``deepspeed.DeepSpeedConfig`` reads it: hjson, so comments (``//``,
    ``#``, ``/* */``) are allowed, and duplicate keys refused. Every error names the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = hjson.load(f, object_pairs_hook=_refuse_duplicates)
    except ValueError as e:  # hjson's decode errors, duplicates, bad UTF-8
        raise EchoConfigError(f"{os.fspath(path)}: {e}") from None
    if not isinstance(data, Mapping):
        raise EchoConfigError(f"{os.fspath(path)}: a ds_config must be a JSON object, got {type(data).__name__}")
    return data


def _refuse_duplicates(pairs) -> dict:
    # DeepSpeed refuses duplicate keys too (dict_raise_error_on_duplicate_keys); plain json keeps the last.
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r} (values {out[key]!r} and {value!r})")
        out[key] = value
    return out


def check_flag(where: str, name: str, value, optional: bool = False):
    """``value`` if it is a bool (or None when ``optional``), else TypeError: bool("no") is True."""
    if isinstance(value, bool) or (optional and value is None):
        return value
    raise TypeError(f"{where}: {name}={value!r} must be {'None, ' if optional else ''}True or False")


def check_count(where: str, name: str, value) -> int:
    """``value`` if it is an int >= 0 (not a bool), else TypeError / ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {name}={value!r} must be an int >= 0")
    if value < 0:
        raise ValueError(f"{where}: {name}={value!r} must be >= 0")
    return value


def _close(key, names) -> list:
    # One wrong, missing or extra letter in a name of 4+ letters scores >= 0.75; difflib's default 0.6
    # would take DeepSpeed's own "quantize_training" (0.69) for a misspelt "quantizer".
    return difflib.get_close_matches(str(key), list(names), n=1, cutoff=0.75)


def _model_at(model: type, path) -> type:
    for part in path:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, _Section):
            break
        model = field.annotation
    return model


def _allowed(err: dict, model: type) -> str:
    loc = err["loc"]
    if err["type"] == "extra_forbidden":
        fields = _model_at(model, loc[:-1]).model_fields
        hint = _close(loc[-1], fields)
        return ("unknown key" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                + "; allowed keys: " + ", ".join(fields))
    msg = err["msg"].removeprefix("Value error, ")
    # A type error alone does not say the range: add the field's bounds (e.g. a gain in [0, 1]).
    field = _model_at(model, loc[:-1]).model_fields.get(str(loc[-1])) if loc else None
    if err["type"].endswith("_type") and field is not None:
        bounds = [f"{op} {getattr(m, attr)}" for m in field.metadata
                  for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if hasattr(m, attr)]
        if bounds:
            msg += " (" + ", ".join(bounds) + ")"
    return msg


def _describe(err: ValidationError, model: type) -> str:
    lines = []
    for e in err.errors():
        key = ".".join([model._key] + [str(p) for p in e["loc"]])
        lines.append(f"{key}={e.get('input')!r}: {_allowed(e, model)}")
    return "invalid \"echo\" config: " + "; ".join(lines)
