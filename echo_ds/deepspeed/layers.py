"""Echo versions of DeepSpeed AutoTP's tensor-parallel layers, swapped in after AutoTP built them.

DeepSpeed has no registry for these layers and ``deepspeed.comm.all_reduce`` also carries ZeRO and
data-parallel traffic, so Echo never patches a communication function. Instead each AutoTP layer
instance keeps its identity (parameters, hooks, names) and gets an Echo subclass of its own class as
``__class__``: the subclass overrides only ``forward``, which repeats DeepSpeed's forward with the
all-reduce replaced by the wrappers of ``mappings.py``. ``unpatch_layer`` restores the original class.

Which layers are patched (DeepSpeed 0.19, ``deepspeed/module_inject/layers.py``):

=========================================  ====================  ==========================================
layer (and subclasses that keep forward)   site                  DeepSpeed's all-reduce it replaces
=========================================  ====================  ==========================================
LinearAllreduce, SubParamLinearAllreduce   forward               ``RowParallel``: ``all_reduce`` in
                                                                 training, ``inference_all_reduce`` in
                                                                 inference
LinearLayer, SubParamLinearLayer           backward              ``ColumnParallel`` (input gradient);
                                                                 ``AsyncColumnParallel`` under
                                                                 ``tp_overlap_comm``
LmHeadLinearAllreduce                      forward (only with    ``inference_all_reduce`` of the logits
                                           quantize_lm_head)
=========================================  ====================  ==========================================

Left to DeepSpeed: output heads (``LmHeadLinearAllreduce`` and a column-parallel ``lm_head`` /
``embed_out``, ``VocabParallelLinear``, ``LinearAllreduceWithReplicatedInput``) unless
``quantize_lm_head``; ``VocabParallelEmbedding`` (its all-reduce assembles an embedding lookup in which
one rank contributes each row); the replicated-gradient hooks of AutoTP; convolution layers of vision
towers. A ``TensorParallel_Layer`` subclass whose forward Echo does not know is left alone with one
warning naming it.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Type

import torch
from deepspeed.module_inject import layers as ds_layers
from deepspeed.module_inject.layers import GatherFromTensorParallelRegion, add_bias

from . import policy
from .mappings import (copy_to_tensor_parallel_region, overlapped_column_parallel_linear,
                       reduce_from_tensor_parallel_region)
from .runtime import BACKWARD, FORWARD

ROW = "row"
COLUMN = "column"
LM_HEAD_ROW = "lm_head_row"

kDeepCompileMessage = (
    "echo: the DeepCompile 'autotp' pass moves the tensor-parallel all-reduces into the compiled graph, "
    "where Echo cannot reach them. Remove \"autotp\" from \"compile\": {\"passes\": [...]} in ds_config.json "
    "(or set \"compile\": {\"deepcompile\": false}), or remove the \"echo\" section to run without Echo.")


def _refuse_deferred(layer) -> None:
    if getattr(layer, "defer_collectives_to_compiler", False):
        raise RuntimeError(kDeepCompileMessage)


# ----------------------------------------------------------------------------------------------------
# Echo forwards: DeepSpeed's forwards with the communication replaced
# ----------------------------------------------------------------------------------------------------

def _echo_row_forward(self, input):
    """LinearAllreduce / SubParamLinearAllreduce: local matmul, Echo all-reduce, replicated bias."""
    _refuse_deferred(self)
    output = torch.matmul(input, self.weight.transpose(-1, -2))
    output = reduce_from_tensor_parallel_region(output, self._echo_site)
    if self.bias is not None:
        output = add_bias(output, self.bias)
    return output


def _echo_column_forward(self, input):
    """LinearLayer and its subclasses: Echo on the input gradient, then DeepSpeed's gather if any."""
    _refuse_deferred(self)
    site = self._echo_site
    if type(self).tp_overlap_comm and not site.runtime.coalesce:
        output = overlapped_column_parallel_linear(input, self.weight, self.bias, site)
    else:
        # NOTE: under tp_overlap_comm with coalescing on, the layer takes this path too: the reference
        # backend cannot overlap, and one call for q, k, v saves more than an overlap would hide.
        input = copy_to_tensor_parallel_region(input, site)
        output = torch.matmul(input, self.weight.transpose(-1, -2))
        if self.bias is not None:
            output = add_bias(output, self.bias)
    if self.gather_output:
        output = GatherFromTensorParallelRegion.apply(self.mp_group, output, self._partition_sizes)
    return output


def _echo_subparam_column_forward(self, input):
    """SubParamLinearLayer: Echo on the input gradient."""
    _refuse_deferred(self)
    input = copy_to_tensor_parallel_region(input, self._echo_site)
    output = torch.matmul(input, self.weight.transpose(-1, -2))
    if self.bias is not None:
        output = add_bias(output, self.bias)
    return output


def _echo_lm_head_forward(self, input):
    """LmHeadLinearAllreduce (inference head), when quantize_lm_head asks for it."""
    input_shard_sizes = self._partition_sizes
    assert sum(input_shard_sizes) == input.shape[-1], (
        f"lm_head was partitioned for an input of {sum(input_shard_sizes)} features, but got {input.shape[-1]}.")
    offset = sum(input_shard_sizes[:self.tp_index])
    size = input_shard_sizes[self.tp_index]
    output = torch.matmul(input[:, :, offset:offset + size], self.weight.transpose(-1, -2))
    output = reduce_from_tensor_parallel_region(output, self._echo_site)
    if self.bias is not None:
        output = add_bias(output, self.bias)
    return output


# The DeepSpeed forwards each Echo forward reproduces. A layer is patched only when its class's forward
# is one of these, so a subclass with a forward of its own is never silently changed.
_KNOWN_FORWARDS = {
    ds_layers.LinearAllreduce.forward: (ROW, _echo_row_forward),
    ds_layers.SubParamLinearAllreduce.forward: (ROW, _echo_row_forward),
    ds_layers.LinearLayer.forward: (COLUMN, _echo_column_forward),
    ds_layers.SubParamLinearLayer.forward: (COLUMN, _echo_subparam_column_forward),
    ds_layers.LmHeadLinearAllreduce.forward: (LM_HEAD_ROW, _echo_lm_head_forward),
}

# Layers whose all-reduce Echo deliberately leaves to DeepSpeed (see the module docstring).
_LEFT_TO_DEEPSPEED = (ds_layers.VocabParallelEmbedding, ds_layers.HiddenParallelEmbedding,
                      ds_layers.LinearAllreduceWithReplicatedInput)

_echo_classes: Dict[type, type] = {}


def echo_class(cls: Type[torch.nn.Module]) -> type:
    """The Echo subclass of an AutoTP layer class (created once, registered in this module for pickle)."""
    sub = _echo_classes.get(cls)
    if sub is None:
        _, forward = _KNOWN_FORWARDS[cls.forward]
        name = f"Echo{cls.__name__}"
        sub = type(name, (cls, ), {"forward": forward, "_echo_original_class": cls, "__module__": __name__})
        sub.__qualname__ = name
        globals()[name] = sub
        _echo_classes[cls] = sub
    return sub


def classify(name: str, module: torch.nn.Module, quantize_lm_head: bool,
             training: bool) -> Tuple[Optional[str], str]:
    """How Echo treats one module: ``(kind, why)`` with kind ROW/COLUMN/LM_HEAD_ROW, or None to leave it.

    training: AutoTP's mode; in inference a column-parallel layer has no all-reduce (its only one is in
    backward), so it is left as it is. Pure apart from reading the module's class and attributes.
    """
    if not isinstance(module, ds_layers.TensorParallel_Layer):
        return None, "not a tensor-parallel layer"
    if isinstance(module, _LEFT_TO_DEEPSPEED):
        return None, f"{type(module).__name__}'s all-reduce is left to DeepSpeed"
    if getattr(module, "mp_group", None) is None or getattr(module, "tp_world_size", 1) <= 1:
        return None, "no tensor-parallel group"
    known = _KNOWN_FORWARDS.get(type(module).forward)
    if known is None:
        return None, f"unknown forward of {type(module).__name__}"
    kind = known[0]
    if kind == COLUMN and not training:
        return None, "column-parallel layer in inference (no all-reduce)"
    is_head = (kind == LM_HEAD_ROW or isinstance(module, ds_layers.VocabParallelLinear)
               or policy.is_lm_head_name(getattr(module, "name", None)) or policy.is_lm_head_name(name))
    if is_head and not quantize_lm_head:
        return None, "output head (pass quantize_lm_head=True to compress it)"
    return kind, "patched"


def patch_layer(module: torch.nn.Module, site) -> None:
    """Give ``module`` its Echo class and its site (its parameters, hooks and name stay as they are)."""
    module.__class__ = echo_class(type(module))
    module._echo_site = site


def unpatch_layer(module: torch.nn.Module) -> None:
    """Restore DeepSpeed's class."""
    original = getattr(type(module), "_echo_original_class", None)
    if original is not None:
        module.__class__ = original
    if "_echo_site" in module.__dict__:
        del module._echo_site


def direction_of(kind: str) -> str:
    return BACKWARD if kind == COLUMN else FORWARD
