"""Tensor-parallel communication through Echo, in Megatron's three tiers.

1. Private primitive: ``_echo_reduce(x, site)`` all-reduces through the site's runtime into a tensor of
   its own (a copy of ``x`` when the group has one rank), as one custom op,
   ``torch.ops.echo_ds.site_all_reduce``: ``torch.compile(fullgraph=True)`` traces it as one node, and the
   runtime's bookkeeping runs at every call (docs/deepspeed.md, "torch.compile").
2. Small ``torch.autograd.Function``s whose forward and backward are one line each (the overlapped
   column-parallel linear, which mirrors DeepSpeed's ``AsyncColumnParallel``, is the one exception: its
   backward computes the three gradients of a linear layer).
3. Public wrappers whose docstring says what happens in each direction. The layers of ``layers.py`` call
   only these.

A ``site`` (``runtime.Site``) names the all-reduce: its process group, its direction and the runtime that
holds the compensator states and counters.
"""

from __future__ import annotations

import torch

from echo_ds import collective

from .runtime import Site


# ----------------------------------------------------------------------------------------------------
# Tier 1: private primitive
# ----------------------------------------------------------------------------------------------------

def _echo_reduce(x: torch.Tensor, site: Site) -> torch.Tensor:
    """Echo all-reduce of ``x`` over ``site.group`` into a tensor of its own (a copy of ``x`` at world size 1).

    Never ``x`` nor a view (of ``x`` or of a buffer): an autograd Function whose output is an input or a view
    hands the model a view that it may not modify in place (Falcon's ``mlp_output += attention_output``
    raises "Output 0 of _ReduceFromTensorParallelRegion is a view and is being modified inplace"). The
    reference path's result is a view of its padded segments whenever no dtype conversion copies it, i.e. in
    fp32; a backend's result may be a view of its workspace. Those are copied here, once.
    """
    if site.world_size == 1:
        return _own(x, x)
    return torch.ops.echo_ds.site_all_reduce(x, collective.handle(site.runtime), site.site_id, x.requires_grad)


@torch.library.custom_op("echo_ds::site_all_reduce", mutates_args=())
def _site_all_reduce(x: torch.Tensor, runtime: int, site: int, requires_grad: bool) -> torch.Tensor:
    """``runtime.reduce(x, runtime.sites[site])`` as one op (``runtime``: a handle, echo_ds.collective).

    The runtime's bookkeeping (which pass, which bit width and state, the counters, the recompute cache)
    runs here, eagerly, at every call; traced by torch.compile it would run once, at trace time. Under
    no_grad, as in the autograd Functions' forward and backward that call it; ``requires_grad`` is the
    caller's ``x.requires_grad`` (the runtime's recompute policy reads it), which a compiled graph's
    tensors do not carry.
    """
    rt = collective.resolve(runtime)
    if x.requires_grad != requires_grad:
        x = x.detach().requires_grad_(requires_grad)
    with torch.no_grad():
        return _own(rt.reduce(x, rt.sites[site]), x)


@_site_all_reduce.register_fake
def _(x, runtime, site, requires_grad):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


# Kept in program order by torch.compile, never merged or dropped (see collective.ordered).
collective.ordered(torch.ops.echo_ds.site_all_reduce.default)


def _own(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y`` when it owns its memory, else a contiguous copy (``y`` is ``x``, a view, or shares x's memory)."""
    if y is x or y._base is not None or y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        return y.clone(memory_format=torch.contiguous_format)
    return y


# ----------------------------------------------------------------------------------------------------
# Tier 2: autograd functions
# ----------------------------------------------------------------------------------------------------

class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Row-parallel output: Echo all-reduce in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x, site):
        return _echo_reduce(x, site)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Column-parallel input: identity in forward, Echo all-reduce of the input gradient in backward."""

    @staticmethod
    def forward(ctx, x, site):
        ctx.site = site
        return x

    @staticmethod
    def backward(ctx, grad_output):
        return _echo_reduce(grad_output, ctx.site), None


class _OverlappedColumnParallelLinear(torch.autograd.Function):
    """DeepSpeed's ``AsyncColumnParallel`` (``tp_overlap_comm``) with the input-gradient all-reduce
    through Echo. The reference backend is blocking, so nothing overlaps yet: the all-reduce runs between
    the input gradient and the weight gradient, where DeepSpeed's asynchronous one would be in flight."""

    @staticmethod
    def forward(ctx, x, weight, bias, site):
        ctx.site = site
        ctx.use_bias = bias is not None
        ctx.save_for_backward(x, weight)
        output = torch.matmul(x, weight.transpose(-1, -2))
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_input = _echo_reduce(grad_output.matmul(weight), ctx.site)
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_weight = grad_2d.t().matmul(x.reshape(-1, x.shape[-1]))
        grad_bias = grad_2d.sum(0) if ctx.use_bias else None
        return grad_input, grad_weight, grad_bias, None


# ----------------------------------------------------------------------------------------------------
# Tier 3: public wrappers
# ----------------------------------------------------------------------------------------------------

def reduce_from_tensor_parallel_region(x: torch.Tensor, site: Site) -> torch.Tensor:
    """Sum a row-parallel layer's partial outputs across the group.

    forward: Echo compressed all-reduce of ``x`` with the forward compensator state (``x`` any shape,
        fp32/bf16/fp16; the result has its shape and dtype and is identical on every rank).
    backward: identity (the output gradient is already replicated).
    """
    return _ReduceFromTensorParallelRegion.apply(x, site)


def copy_to_tensor_parallel_region(x: torch.Tensor, site: Site) -> torch.Tensor:
    """Hand a replicated input to a column-parallel layer.

    forward: identity, without a copy: the result is ``x`` or autograd's view of it, which only the layer's
        matmul reads (the model gets the matmul's output, a tensor of its own, never this one).
    backward: Echo compressed all-reduce of the input gradient with the backward compensator state and
        the power-of-two rescaling. Column-parallel layers that consume the very same ``x`` in one forward
        (q, k and v; gate and up) get the same wrapped tensor, so autograd sums their local gradients and
        one Echo call reduces the sum (the all-reduce is linear), under the first layer's site.
    """
    if site.world_size == 1 or not (torch.is_grad_enabled() and x.requires_grad):
        # No backward will reach this input through here, so there is nothing to reduce.
        return x
    return site.runtime.coalesced(x, site, lambda: _CopyToTensorParallelRegion.apply(x, site))


def overlapped_column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias, site: Site) -> torch.Tensor:
    """``x @ weight.T + bias`` for a column-parallel layer under ``tp_overlap_comm`` without coalescing.

    forward: the local matmul (no communication).
    backward: Echo compressed all-reduce of the input gradient (backward state, power-of-two rescaling),
        then the weight and bias gradients.
    """
    return _OverlappedColumnParallelLinear.apply(x, weight, bias, site)
