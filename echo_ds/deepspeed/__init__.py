"""Echo under DeepSpeed AutoTP: the tensor-parallel all-reduces of training and inference through Echo.

Public API (see docs/deepspeed.md):

* ``initialize(...)``: ``deepspeed.initialize`` with the ``"echo"`` section of ds_config applied.
* ``init_inference(model, config, ...)``: ``deepspeed.init_inference`` with the ``"echo"`` section
  taken out of the strict inference config and applied.
* ``enable(engine, ...)`` / ``disable(engine)`` / ``get_runtime(engine)``: for engines built elsewhere.
* ``EchoRuntime``, ``EchoStats``: the per-model state and its counters.
* ``reduce_from_tensor_parallel_region``, ``copy_to_tensor_parallel_region``: the public wrappers, for
  hand-written tensor-parallel layers.
* ``shutdown()``: the end of a run, after the last collective (echo_ds/deepspeed/teardown.py).
"""

from .api import disable, enable, get_runtime, init_inference, initialize
from .mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from .runtime import BACKWARD, FORWARD, EchoRuntime, EchoStats, Site
from .teardown import shutdown

__all__ = [
    "initialize", "init_inference", "enable", "disable", "get_runtime", "EchoRuntime", "EchoStats", "Site",
    "FORWARD", "BACKWARD", "reduce_from_tensor_parallel_region", "copy_to_tensor_parallel_region", "shutdown",
]
