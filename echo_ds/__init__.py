"""echo_ds: Echo, a 4-bit (or 8-bit) compensated tensor-parallel all-reduce for DeepSpeed.

Numerics core (runs anywhere): :mod:`echo_ds.quant` (quantizers), :mod:`echo_ds.compensator`
(two-timescale error feedback), :mod:`echo_ds.reference` (the all-reduce over torch.distributed, the
specification), :mod:`echo_ds.emulate` (the same for P ranks in one process), :mod:`echo_ds.algorithm`
(the arithmetic both share, without the communication), :mod:`echo_ds.config` (the ``"echo"`` section of
ds_config.json).

DeepSpeed mode: ``echo_ds.initialize(...)`` (the arguments and returns of ``deepspeed.initialize``),
``echo_ds.init_inference(...)`` and ``echo_ds.enable(engine)``: every AutoTP all-reduce goes through Echo.
"""

from echo_ds.config import EchoConfig, EchoConfigError
from echo_ds.quant import QuantSpec, Quantized, dequantize, fake_quantize, quantize

__version__ = "0.1.0"

# The DeepSpeed mode pulls in deepspeed's engine: import it on first use.
_DEEPSPEED_API = ("initialize", "init_inference", "enable", "disable", "get_runtime")


def __getattr__(name):
    if name in _DEEPSPEED_API:
        from echo_ds import deepspeed as _mode

        return getattr(_mode, name)
    raise AttributeError(f"module 'echo_ds' has no attribute {name!r}")

__all__ = [
    "EchoConfig",
    "EchoConfigError",
    "QuantSpec",
    "Quantized",
    "quantize",
    "dequantize",
    "fake_quantize",
    "__version__",
    *_DEEPSPEED_API,
]
