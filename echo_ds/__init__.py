"""echo_ds: Echo, a 4-bit (or 8-bit) compensated tensor-parallel all-reduce for DeepSpeed.

Numerics core (runs anywhere): :mod:`echo_ds.quant` (quantizers), :mod:`echo_ds.compensator`
(two-timescale error feedback), :mod:`echo_ds.reference` (the all-reduce over torch.distributed, the
specification), :mod:`echo_ds.emulate` (the same for P ranks in one process), :mod:`echo_ds.config`
(the ``"echo"`` section of ds_config.json).
"""

from echo_ds.config import EchoConfig, EchoConfigError
from echo_ds.quant import QuantSpec, Quantized, dequantize, fake_quantize, quantize

__version__ = "0.1.0"

__all__ = [
    "EchoConfig",
    "EchoConfigError",
    "QuantSpec",
    "Quantized",
    "quantize",
    "dequantize",
    "fake_quantize",
    "__version__",
]
