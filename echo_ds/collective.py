"""The Echo all-reduce as ``torch.library`` custom ops: ``torch.ops.echo_ds.all_reduce`` and, with a
compensator, ``torch.ops.echo_ds.all_reduce_compensated``.

Every backend sits behind these ops: the reference (:mod:`echo_ds.reference`, the specification) by
default, and a transport registered for the process group (:func:`register_backend`) where one is.
``echo_ds.reference.echo_all_reduce`` checks its arguments and calls :func:`all_reduce`, which calls an
op; the op's body runs eagerly, so

* ``torch.compile(fullgraph=True)`` traces one opaque node per call, whose output the fake
  implementation gives (``x``'s shape and dtype, contiguous, on ``x``'s device). Traced through instead,
  the reference's collectives, host reads (``.tolist()``, ``.item()``) and timed waits break the graph,
  and its Python state (call numbers, compensator counters) would be frozen at trace time;
* the body's fp32 arithmetic runs as the reference wrote it: inductor neither fuses nor reorders it
  (a compiled reference did not return the eager bits: docs/deepspeed.md, "torch.compile").

Arguments. A custom op takes tensors, ints, floats, bools and strings, so

* the group travels by name (``group.group_name``) and the body resolves it with torch's
  ``_resolve_process_group``, as torch's functional collectives do;
* the quantizer spec as its four fields, ``pow2_rescale`` as its code (``algorithm.pow2_code``),
  direction, site and timeout as optional scalars;
* the compensator as an int handle (``id(compensator)``, see :func:`handle`) into a weak registry of
  this module, and its state tensors (``compensator.state_names``: m1 and m2, "int8" adds the exponents,
  "int4" holds q and the exponents) as arguments the op mutates in place (``mutates_args``).

Why a handle rather than the compensator's coefficients as floats: the body needs the object itself
(its residual choice, its telemetry list, its call counter, its resize rule); rebuilding one from floats
would copy those rules into a second place. Why the state tensors travel nevertheless: the compiler must
see the in-place update, so that calls sharing a state stay in order and none is merged or dropped; and
under ``torch.compile`` the tensors the body receives may be the compiler's own (a functionalized copy
it writes back afterwards), so the body computes on them (set on the compensator for the call). The
state is allocated (``Compensator._ensure``) before the op with the call's shape, so the body never
reallocates it.

Why two ops: an op whose only mutable argument is an empty list does not compile (torch 2.13's inductor
fails on it), and an op without mutable arguments is pure to the compiler, which may merge two identical
calls or drop one whose result is unused. The uncompensated op is therefore registered as an ordered
side effect (:func:`ordered`); the compensated one is kept and ordered by its state.

The ops have no autograd formula: ``echo_all_reduce`` refuses an input that requires grad, and the
DeepSpeed mode keeps its ``autograd.Function``s around its own op (``echo_ds.deepspeed.mappings``).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import List, Optional

import torch
import torch.distributed as dist

from echo_ds import algorithm as A
from echo_ds.compensator import kStateTensorDtypes
from echo_ds.quant import QuantSpec

__all__ = ["all_reduce", "register_backend", "unregister_backend", "drop_backend", "backend_for", "reference_only",
           "handle", "resolve", "group_name", "ordered"]

# Objects the ops refer to by handle (id(obj)); weak: an object dies when its owner drops it, and
# torch.compile drops code that guarded on it (its ID_MATCH guard holds a finalizer).
_objects: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()

# backend: True while a backend's all_reduce runs on this thread, or inside reference_only().
_inside = threading.local()

# Backends by group name: objects with all_reduce(x, spec, compensator, pow2_rescale, *, site, direction).
_backends: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()


# NOTE: ``assume_constant_result`` makes torch.compile call this for real while it traces (and bake the
# handle into the graph), so the object is registered before the compiled graph first runs; a registry
# update traced like any other code would be replayed only after the graph, too late for its first call.
# The handle is id(obj), and handle() also takes id(obj) in traced code: that installs the guard
# (ID_MATCH) that recompiles for another object and drops the code when this one dies.
@torch.compiler.assume_constant_result
def _register(obj) -> int:
    _objects[id(obj)] = obj
    return id(obj)


def handle(obj) -> int:
    """The op's int handle of ``obj`` (registered weakly; ``obj`` must support weak references)."""
    h = id(obj)
    _register(obj)
    return h


def resolve(h: int):
    """The object of handle ``h`` (raises where it is gone or was never registered)."""
    obj = _objects.get(h)
    if obj is None:
        raise RuntimeError(f"echo_ds: op handle {h} names no live object (it was collected, or registered in "
                           f"another process); pass the object itself to echo_all_reduce")
    return obj


def group_name(group: Optional[dist.ProcessGroup]) -> str:
    """The registered name of ``group`` (None: the default group), as the op receives it."""
    return (dist.group.WORLD if group is None else group).group_name


def register_backend(group: Optional[dist.ProcessGroup], backend) -> None:
    """Run every Echo call on ``group`` through ``backend`` instead of the reference.

    backend: an object with ``all_reduce(x, spec, compensator, pow2_rescale, *, site, direction)`` that
    returns the reduced tensor (``EchoBuffer``'s signature), held weakly: it leaves the registry when it
    is collected, or at :func:`unregister_backend`; one whose ``active`` is false or ``closed`` true
    (``EchoBuffer`` after ``close()``) is skipped. The same registration serves eager calls and compiled graphs. A
    backend that declines a call may pass it to ``echo_all_reduce``: that inner call runs the reference.
    """
    _backends[group_name(group)] = backend


def unregister_backend(group: Optional[dist.ProcessGroup]) -> None:
    """Send ``group``'s calls back to the reference (a no-op where no backend is registered)."""
    _backends.pop(group_name(group), None)


def drop_backend(name: str, backend) -> None:
    """Unregister ``backend`` from the group named ``name`` if it is still the one registered there (a
    later backend of the same group stays). Needs no process group: safe at interpreter exit."""
    if _backends.get(name) is backend:
        _backends.pop(name, None)


@contextlib.contextmanager
def reference_only():
    """Within it, every Echo call of this thread runs the reference, whatever backend is registered (for
    tests that compare a backend with the specification on the same group; a backend's own fallback
    calls run inside it too)."""
    before = getattr(_inside, "backend", False)
    _inside.backend = True
    try:
        yield
    finally:
        _inside.backend = before


def backend_for(name: str):
    """The live backend registered for the group named ``name``, or None (the reference runs)."""
    backend = _backends.get(name)
    if backend is None or not getattr(backend, "active", True) or getattr(backend, "closed", False):
        return None
    return backend


def state_shape(numel: int, world_size: int, group_size: int):
    """The compensator state's shape for a message of ``numel`` elements: [P, G, g] (algorithm.Layout),
    in integer arithmetic so that a symbolic ``numel`` traces."""
    chunk = world_size * group_size
    groups_per_segment = max(1, (numel + chunk - 1) // chunk)
    return (world_size, groups_per_segment, group_size)


def all_reduce(x: torch.Tensor, spec: QuantSpec, group: Optional[dist.ProcessGroup] = None, compensator=None,
               pow2_rescale="auto", *, direction: Optional[str] = None, site: Optional[int] = None,
               timeout_s: Optional[float] = None) -> torch.Tensor:
    """``torch.ops.echo_ds.all_reduce`` with echo_all_reduce's arguments (checked by the caller; the
    group has more than one rank). Call :func:`echo_ds.reference.echo_all_reduce`, not this."""
    name = group_name(group)
    pow2 = A.pow2_code(pow2_rescale)
    if compensator is None:
        return torch.ops.echo_ds.all_reduce(x, name, spec.bits, spec.group_size, spec.quantizer, spec.rotation,
                                            pow2, direction, site, timeout_s)
    # NOTE: allocated here, outside the op, with the shape the call needs (see the module docstring).
    compensator._ensure(state_shape(x.numel(), dist.get_world_size(group), spec.group_size), x.device)
    state = [getattr(compensator, a) for a in compensator.state_names]
    return torch.ops.echo_ds.all_reduce_compensated(x, state, name, spec.bits, spec.group_size, spec.quantizer,
                                                    spec.rotation, pow2, direction, site, timeout_s,
                                                    handle(compensator))


def _run(x: torch.Tensor, state: List[torch.Tensor], group: str, bits: int, group_size: int, quantizer: str,
         rotation: bool, pow2_rescale: int, direction: Optional[str], site: Optional[int], timeout_s: Optional[float],
         compensator: int) -> torch.Tensor:
    """The body of both ops: the registered backend's all-reduce, else the reference's."""
    spec = QuantSpec(bits, group_size, quantizer, rotation)
    pow2 = A.POW2_MODES[pow2_rescale]
    comp = None if compensator == 0 else resolve(compensator)
    names = () if comp is None else comp.state_names
    if len(state) != len(names):
        raise ValueError(f"echo_ds::all_reduce_compensated: {len(state)} state tensors for a compensator that "
                         f"holds {len(names)} ({', '.join(names)}); pass them in the order of its state_names")
    if comp is not None:  # a tensor of another dtype would be read and written as the format's bytes
        want = kStateTensorDtypes[comp.state_dtype]
        wrong = [f"{a} {t.dtype} (a {comp.state_dtype!r} state holds {want[a]})" for a, t in zip(names, state)
                 if t.dtype != want[a]]
        if wrong:
            raise ValueError(f"echo_ds::all_reduce_compensated: state tensors of the wrong dtype: {'; '.join(wrong)}")
    held = [getattr(comp, a) for a in names]
    if comp is not None:  # compute on the tensors the op was given (the same objects in eager mode)
        for a, t in zip(names, state):
            setattr(comp, a, t)
    try:
        # A backend that declines a call and falls back to echo_all_reduce gets the reference here.
        backend = None if getattr(_inside, "backend", False) else backend_for(group)
        if backend is not None:
            with reference_only():
                y = backend.all_reduce(x, spec, compensator=comp, pow2_rescale=pow2, site=site, direction=direction)
            # A backend may return a view of its workspace, which its next call overwrites: the op's
            # output is a tensor of its own.
            return y.clone() if y._base is not None else y
        from echo_ds import reference

        return reference._echo_all_reduce(x, spec, dist.distributed_c10d._resolve_process_group(group), comp,
                                          pow2, direction=direction, site=site, timeout_s=timeout_s)
    finally:
        if comp is not None:
            for a, t, h in zip(names, state, held):
                if getattr(comp, a) is t:  # left as it was unless the call replaced it (a resize)
                    setattr(comp, a, h)


@torch.library.custom_op("echo_ds::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group: str, bits: int, group_size: int, quantizer: str, rotation: bool,
                   pow2_rescale: int, direction: Optional[str], site: Optional[int],
                   timeout_s: Optional[float]) -> torch.Tensor:
    """The Echo all-reduce of ``x`` over the group named ``group``, without a compensator."""
    return _run(x, [], group, bits, group_size, quantizer, rotation, pow2_rescale, direction, site, timeout_s, 0)


@torch.library.custom_op("echo_ds::all_reduce_compensated", mutates_args=("state",))
def _all_reduce_compensated_op(x: torch.Tensor, state: List[torch.Tensor], group: str, bits: int, group_size: int,
                               quantizer: str, rotation: bool, pow2_rescale: int, direction: Optional[str],
                               site: Optional[int], timeout_s: Optional[float], compensator: int) -> torch.Tensor:
    """The same with the compensator of handle ``compensator``, whose state tensors ``state`` (in the order
    of its ``state_names``) it updates in place."""
    return _run(x, state, group, bits, group_size, quantizer, rotation, pow2_rescale, direction, site, timeout_s,
                compensator)


@_all_reduce_op.register_fake
def _(x, *args):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@_all_reduce_compensated_op.register_fake
def _(x, *args):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def ordered(op) -> None:
    """Declare ``op`` (an OpOverload without mutable arguments) a side effect that torch.compile keeps in
    program order: never merged with an identical call, dropped when its result is unused, or moved
    across another such call (an ORDERED effect token is threaded through them). Every rank then runs
    the collectives of a compiled graph in the order of the eager program. Ops that mutate arguments
    are kept and ordered by those instead (their schema forbids the token)."""
    try:
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
    except ImportError:  # a torch without effect tokens: calls with identical arguments may be merged
        return
    _register_effectful_op(op, _EffectType.ORDERED)


ordered(torch.ops.echo_ds.all_reduce.default)
