"""The ``"echo"`` section of ds_config.json.

::

    "echo": {
      "enabled": true,
      "bits": 4,                    // 4 or 8
      "group_size": 128,            // power of two, 16..4096
      "quantizer": "zero_aware",    // "zero_aware" | "symmetric" | "naive"
      "rotation": "hadamard",       // "none" | "hadamard"
      "forward":  {"compensate": true, "gain": 1.0, "blend": 0.35, "slow_decay": 0.7,
                   "fast_decay": 0.3, "residual": "local"},
      "backward": {"compensate": true, "gain": 0.75, "blend": 0.35, "slow_decay": 0.7,
                   "fast_decay": 0.3, "residual": "local", "pow2_rescale": true},
      "early_sites": {"bits": 8, "fraction": 0.0},
      "backend": "auto",            // "auto" | "reference" | "p2p"
      "min_message_bytes": 0,
      "telemetry": false,           // record the norm of each call's revealed error
      "quantize_lm_head": false     // also compress the output head's all-reduce (inference)
    }

Defaults: the accuracy study (docs/accuracy.md, SmolLM2-135M at P = 4) and the pretraining study
(docs/training.md) decided them. Against the paper's method (no rotation, residual "output", gain 0.75),
the Hadamard rotation and the "local" residual at forward gain 1.0 cut the 4-bit perplexity increase
from +42 % to +6.8 % and the 8-bit one from +0.25 % to 0.00 %; in training, "local" had the smallest
4-bit gap. The paper's method is ``rotation: "none"`` with ``residual: "output"`` and ``gain: 0.75`` in
both directions (ds_configs/eval/4bit_full.json).

The models are DeepSpeed's own ``DeepSpeedConfigModel`` (pydantic, unknown keys forbidden). Every invalid
value raises :class:`EchoConfigError` with the key's dotted path, the value and what is allowed.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Literal, Mapping, Optional, Union

from pydantic import Field, ValidationError, field_validator

from deepspeed.runtime.config_utils import DeepSpeedConfigModel

from echo_ds.quant import MAX_GROUP_SIZE, MIN_GROUP_SIZE, SUPPORTED_BITS, QuantSpec

ECHO_KEY = "echo"


class EchoConfigError(ValueError):
    """An invalid ``"echo"`` section: the message names the key, the value and what is allowed."""


def _supported_bits(v: int) -> int:
    if v not in SUPPORTED_BITS:
        raise ValueError(f"must be one of {SUPPORTED_BITS}")
    return v


class DirectionConfig(DeepSpeedConfigModel):
    """Compensator of one pass direction (equations 10-11 of the paper).

    compensate: apply the error feedback at all.
    gain (eta, in [0, 1]): share of the estimated error fed back.
    blend (a, in [0, 1]): weight of the slow average m1 against the fast one m2.
    slow_decay (beta1, in [0, 1)) and fast_decay (beta2, in [0, 1)): decay rates of the two averages.
    residual: ``"output"`` is the paper's u_i = x'_i - y/P; ``"local"`` feeds each rank its own rounding
        error, u_i = -e_i (bounded state, see echo_ds.compensator).
    """

    compensate: bool = True
    gain: float = Field(0.75, ge=0.0, le=1.0)
    blend: float = Field(0.35, ge=0.0, le=1.0)
    slow_decay: float = Field(0.7, ge=0.0, lt=1.0)
    fast_decay: float = Field(0.3, ge=0.0, lt=1.0)
    residual: Literal["output", "local"] = "local"


class ForwardConfig(DirectionConfig):
    """Forward-pass compensator. Its gain defaults to 1.0 (docs/accuracy.md: with the rotation and the
    "local" residual, gain 1.0 beat 0.75 at every group size measured)."""

    gain: float = Field(1.0, ge=0.0, le=1.0)


class BackwardConfig(DirectionConfig):
    """Backward-pass compensator plus the exact power-of-two gradient rescaling (section 5.4)."""

    pow2_rescale: bool = True


class EarlySitesConfig(DeepSpeedConfigModel):
    """The first ``fraction`` of the forward sites of each pass use ``bits`` (early-site 8-bit)."""

    bits: int = 8
    fraction: float = Field(0.0, ge=0.0, le=1.0)

    _bits = field_validator("bits")(classmethod(lambda cls, v: _supported_bits(v)))


class EchoConfig(DeepSpeedConfigModel):
    """The whole ``"echo"`` section. Construct from keywords, a dict, or :meth:`from_ds_config`."""

    enabled: bool = True
    bits: int = 4
    group_size: int = 128
    quantizer: Literal["zero_aware", "symmetric", "naive"] = "zero_aware"
    rotation: Literal["none", "hadamard"] = "hadamard"
    forward: ForwardConfig = Field(default_factory=ForwardConfig)
    backward: BackwardConfig = Field(default_factory=BackwardConfig)
    early_sites: EarlySitesConfig = Field(default_factory=EarlySitesConfig)
    backend: Literal["auto", "reference", "p2p"] = "auto"
    min_message_bytes: int = Field(0, ge=0)
    telemetry: bool = False
    quantize_lm_head: bool = False

    def __init__(self, strict: bool = True, **data):
        # DeepSpeed's models drop values equal to "auto" unless strict; "auto" is a real backend here.
        try:
            super().__init__(strict=strict, **data)
        except ValidationError as e:
            raise EchoConfigError(_describe(e)) from None

    _bits = field_validator("bits")(classmethod(lambda cls, v: _supported_bits(v)))

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, v):
        if not (MIN_GROUP_SIZE <= v <= MAX_GROUP_SIZE) or v & (v - 1):
            raise ValueError(f"must be a power of two in [{MIN_GROUP_SIZE}, {MAX_GROUP_SIZE}]")
        return v

    # ------------------------------------------------------------------------------------------------

    @classmethod
    def from_ds_config(cls, ds_config: Union[str, os.PathLike, Mapping[str, Any]]) -> "EchoConfig":
        """The ``"echo"`` section of a ds_config (a path to a JSON file or a dict).

        A missing section gives ``enabled=False``. A mapping without an ``"echo"`` key whose keys are all
        fields of the section is read as a bare section.
        """
        if isinstance(ds_config, (str, os.PathLike)):
            with open(ds_config) as f:
                ds_config = json.load(f)
        if not isinstance(ds_config, Mapping):
            raise EchoConfigError(f"a ds_config must be a path or a mapping, got {type(ds_config).__name__}")
        if ECHO_KEY in ds_config:
            section = ds_config[ECHO_KEY]
            if not isinstance(section, Mapping):
                raise EchoConfigError(f"echo: must be an object, got {section!r}")
            return cls(**section)
        if ds_config and set(ds_config) <= set(cls.model_fields):
            return cls(**ds_config)
        return cls(enabled=False)

    def quant_spec(self, bits: Optional[int] = None) -> QuantSpec:
        """The quantizer settings of one call (``bits`` overrides the section's, e.g. early sites)."""
        return QuantSpec(bits=self.bits if bits is None else bits, group_size=self.group_size,
                         policy=self.quantizer, rotation=self.rotation == "hadamard")

    def bits_for_site(self, site_index: int, num_sites: int) -> int:
        """Bit width of forward site ``site_index`` (0-based) of a pass with ``num_sites`` sites."""
        num_early = math.floor(self.early_sites.fraction * num_sites + 1e-9)
        return self.early_sites.bits if site_index < num_early else self.bits

    def direction(self, direction: str) -> DirectionConfig:
        if direction not in ("forward", "backward"):
            raise ValueError(f"direction={direction!r} must be 'forward' or 'backward'")
        return self.forward if direction == "forward" else self.backward


def _model_at(path) -> type:
    model = EchoConfig
    for part in path:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation,
                                                                                     DeepSpeedConfigModel):
            break
        model = field.annotation
    return model


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "echo"
        allowed = e["msg"]
        if e["type"] == "extra_forbidden":
            allowed = "unknown key; allowed keys: " + ", ".join(_model_at(e["loc"][:-1]).model_fields)
        value = e.get("input")
        lines.append(f"echo.{key}={value!r}: {allowed}")
    return "invalid \"echo\" config: " + "; ".join(lines)
