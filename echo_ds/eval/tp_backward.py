"""Emulated tensor parallelism in one process, backward direction: the column-parallel input gradients.

Megatron-style tensor parallelism at degree P starts every attention block and every MLP with a
column-parallel linear: GPU i holds the output features ``cols_i`` of the projection (its query heads and
its key/value heads; its slice of the MLP intermediate dim) and, in the backward pass, only the partial
input gradient

    grad_x_i = sum over the projections p sharing the input of  grad_p[..., cols_i] @ W_p[cols_i, :]

which one all-reduce sums into the gradient of the shared input. Megatron fuses q/k/v into one QKV
linear and gate/up into one linear, so there is ONE backward site per shared input:

* ``qkv_in``: the input of ``self_attn.{q,k,v}_proj`` (the output of ``input_layernorm``), split by
  query heads for q and by key/value heads for k and v (an even feature split where P does not divide
  the head count, as :func:`echo_ds.eval.tp_emulation.head_partition` says);
* ``gate_up_in``: the input of ``mlp.{gate,up}_proj``, P contiguous chunks of the intermediate dim.

Site index k = 2 * layer + {0: qkv_in, 1: gate_up_in} (forward order); the backward pass visits them in
reverse, k = N - 1 down to 0, and the backward compensator runs along that sequence.

:class:`BackwardSites` reproduces this on one device with a fan-out ``torch.autograd.Function`` on the
shared input. Forward: the input x, handed to the P emulated GPUs (P aliases of x; each GPU's output
columns are ``F.linear(x, W_p[cols_i])``, concatenated). Backward: autograd sums, per GPU, the input
gradients of that GPU's q/k/v (or gate/up) columns, which is exactly ``grad_x_i`` above; the fan-out's
backward stacks the P partials into ``[P, ..., hidden]`` and reduces them through the backward emulator
(:class:`echo_ds.emulate.CompensatedAllReduce` with ``direction="backward"``: the backward compensator,
its own state, and the power-of-two rescaling of section 5.4).

:class:`TrainingTPEmulator` owns both directions of one model: the forward sites of
:class:`echo_ds.eval.tp_emulation.TPEmulator` (o_proj and down_proj outputs, backward identity) and the
backward sites here, each with its own compensator, both reset by :meth:`TrainingTPEmulator.begin_pass`.

With no config (or ``enabled: false``) a site calls the original ``nn.Linear`` unchanged, so the 16-bit
baseline is bit for bit the unwrapped model; ``always_split=True`` keeps the split with the exact sum of
the P partials instead (to check the split itself against autograd). Without autograd (``no_grad``, or
an input that needs no gradient) there is no backward site, and the unsplit projection runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from echo_ds.eval.tp_emulation import (Partition, SiteEmulator, TPEmulator, _config_attr, even_partition,
                                       head_partition, site_layer_index)

# Module-name suffixes of the column-parallel projections, per shared input (Llama/Qwen naming).
kQkvSuffixes = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
kGateUpSuffixes = ("mlp.gate_proj", "mlp.up_proj")
BACKWARD_SITE_KINDS = ("qkv_in", "gate_up_in")



# ----------------------------------------------------------------------------------------------------
# Sites of a model
# ----------------------------------------------------------------------------------------------------

@dataclass
class ColumnSitePlan:
    """One backward all-reduce site: the column-parallel projections that share one input."""

    index: int              # forward order, 0 .. num_sites - 1 (the backward pass visits them reversed)
    layer: int
    kind: str               # "qkv_in" or "gate_up_in"
    names: tuple            # module names, e.g. ("model.layers.0.self_attn.q_proj", ...)
    modules: tuple          # their nn.Linear
    partitions: tuple       # one Partition of each module's OUTPUT features


def _column_partition(kind: str, suffix: str, module: torch.nn.Linear, text_config, world_size: int) -> Partition:
    if kind == "gate_up_in":
        return even_partition(module.out_features, world_size, "intermediate features")
    num_heads = _config_attr(text_config, "num_attention_heads", "n_head")
    num_kv_heads = _config_attr(text_config, "num_key_value_heads", default=num_heads)
    heads = num_heads if suffix.endswith("q_proj") else num_kv_heads
    head_dim = _config_attr(text_config, "head_dim")
    if heads and not head_dim and module.out_features % heads == 0:
        head_dim = module.out_features // heads
    if heads and head_dim and heads * head_dim == module.out_features:
        return head_partition(heads, head_dim, world_size)
    return even_partition(module.out_features, world_size)


def plan_backward_sites(model: torch.nn.Module, world_size: int) -> list:
    """The backward sites of ``model`` at TP degree ``world_size``, in forward order.

    One site per layer and shared input: ``layers.<i>.self_attn.{q,k,v}_proj`` (all three required) and
    ``layers.<i>.mlp.{gate,up}_proj``. Raises ValueError when the model has none.
    """
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = {}
    for name, module in model.named_modules():
        for kind, suffixes in zip(BACKWARD_SITE_KINDS, (kQkvSuffixes, kGateUpSuffixes)):
            suffix = next((s for s in suffixes if name.endswith(s)), None)
            if suffix is None:
                continue
            key = (site_layer_index(name, module), BACKWARD_SITE_KINDS.index(kind))
            found.setdefault(key, {})[suffixes.index(suffix)] = (name, module, suffix)
    if not found:
        raise ValueError("no column-parallel sites found: expected Llama-style modules named "
                         f"'layers.<i>.{kQkvSuffixes[0]}' and 'layers.<i>.{kGateUpSuffixes[0]}'")
    plans = []
    for index, ((layer, kind_index), members) in enumerate(sorted(found.items())):
        kind = BACKWARD_SITE_KINDS[kind_index]
        expected = len((kQkvSuffixes, kGateUpSuffixes)[kind_index])
        if len(members) != expected:
            raise ValueError(f"layer {layer}: {kind} needs all of "
                             f"{(kQkvSuffixes, kGateUpSuffixes)[kind_index]}, found {sorted(m[0] for m in members.values())}")
        ordered = [members[i] for i in range(expected)]
        parts = tuple(_column_partition(kind, suffix, module, text_config, world_size)
                      for _, module, suffix in ordered)
        plans.append(ColumnSitePlan(index, layer, kind, tuple(m[0] for m in ordered),
                                    tuple(m[1] for m in ordered), parts))
    return plans


def describe_column_partitions(plans: list) -> dict:
    """{"qkv_in.q_proj": how its output features are split, ...}, one line per kind and projection."""
    out = {}
    for plan in plans:
        for name, partition in zip(plan.names, plan.partitions):
            out.setdefault(f"{plan.kind}.{name.rsplit('.', 1)[-1]}", set()).add(partition.how)
    return {key: "; ".join(sorted(hows)) for key, hows in out.items()}


# ----------------------------------------------------------------------------------------------------
# The fan-out
# ----------------------------------------------------------------------------------------------------

class _BackwardSiteFanOut(torch.autograd.Function):
    """forward: P aliases of x (one per GPU); backward: the all-reduce of the P partial input gradients."""

    @staticmethod
    def forward(ctx, x, reduce_fn, world_size):
        ctx.reduce_fn = reduce_fn
        return tuple(x.view_as(x) for _ in range(world_size))

    @staticmethod
    def backward(ctx, *grads):
        return ctx.reduce_fn(torch.stack(grads)), None, None


def column_parallel_linear(xs: tuple, module: torch.nn.Linear, partition: Partition) -> torch.Tensor:
    """The output of a column-parallel linear from the P GPUs' inputs ``xs`` (each [..., in_features]).

    GPU i computes ``F.linear(xs[i], W[cols_i], b[cols_i])``; the columns are concatenated in order, so
    the result is ``module(x)`` up to the blocking of the matrix products.
    """
    sizes = [s.stop - s.start for s in partition.slices]
    weights = module.weight.split(sizes, dim=0)
    biases = module.bias.split(sizes, dim=0) if module.bias is not None else (None,) * len(sizes)
    return torch.cat([F.linear(x, w, b) for x, w, b in zip(xs, weights, biases)], dim=-1)


def exact_reduce(parts: torch.Tensor) -> torch.Tensor:
    """Sum of ``parts`` [P, ...] over dim 0 in rank order (the exact all-reduce)."""
    acc = parts[0]
    for r in range(1, parts.shape[0]):
        acc = acc + parts[r]
    return acc


class BackwardSites(SiteEmulator):
    """Owns the emulated backward sites of one model (one compensator for the backward direction).

    Usage (normally through :class:`TrainingTPEmulator`)::

        sites = BackwardSites(model, world_size=4)
        sites.set_config(echo_config)       # None: the unmodified projections
        sites.begin_pass()
        loss = model(ids).loss; loss.backward()
        sites.close()
    """

    def __init__(self, model: torch.nn.Module, world_size: int, plans: list | None = None,
                 always_split: bool = False):
        super().__init__(model, world_size, plans, plan_backward_sites)
        self.always_split = always_split
        self._op = None
        self._fanouts = {}          # site index -> (input tensor, its P aliases), this pass only
        self.num_reduces = 0        # backward reduces since the last set_config
        self.install()

    def _site_forwards(self):
        return [(module, self._site_forward(plan, module, partition))
                for plan in self.plans for module, partition in zip(plan.modules, plan.partitions)]

    def _site_modules(self):
        return [module for plan in self.plans for module in plan.modules]

    def _drop_config_state(self) -> None:
        self._op = None
        self._fanouts = {}

    def set_config(self, config) -> None:
        """Use ``config`` (an EchoConfig) from now on; None or disabled: exact (unsplit unless always_split)."""
        super().set_config(config)
        if self.config is not None:
            from echo_ds.emulate import CompensatedAllReduce
            self._op = CompensatedAllReduce(self.world_size, self.config, direction="backward")
        self.num_reduces = 0

    def begin_pass(self) -> None:
        """Start a new pass: the backward compensator's averages back to zero."""
        if self._op is not None:
            self._op.reset()
        self._fanouts = {}

    def _reduce(self, parts: torch.Tensor, site_index: int) -> torch.Tensor:
        self.num_reduces += 1
        if self._op is None:
            return exact_reduce(parts)
        bits = self.config.bits  # early-site bits are a forward-pass setting (EchoConfig.bits_for_site)
        self.stats.record(parts[0].numel(), bits, self.config.group_size, site_index, self.config.quantizer)
        return self._op(parts, bits=bits)

    def _fan_out(self, plan: ColumnSitePlan, x: torch.Tensor) -> tuple:
        cached = self._fanouts.get(plan.index)
        if cached is not None and cached[0] is x:
            return cached[1]
        index = plan.index
        xs = _BackwardSiteFanOut.apply(x, lambda parts: self._reduce(parts, index), self.world_size)
        self._fanouts[plan.index] = (x, xs)
        return xs

    def _site_forward(self, plan: ColumnSitePlan, module: torch.nn.Linear, partition: Partition):
        def forward(x: torch.Tensor) -> torch.Tensor:
            active = self.config is not None or self.always_split
            if not active or not (torch.is_grad_enabled() and x.requires_grad):
                return type(module).forward(module, x)
            return column_parallel_linear(self._fan_out(plan, x), module, partition)

        return forward


# ----------------------------------------------------------------------------------------------------
# Both directions
# ----------------------------------------------------------------------------------------------------

class TrainingTPEmulator:
    """The emulated TP sites of one model in both directions, one compensator state per direction.

    forward sites: o_proj and down_proj outputs (:class:`TPEmulator`: Echo all-reduce; backward identity);
    backward sites: the q/k/v and gate/up input gradients (:class:`BackwardSites`: forward identity;
    backward Echo all-reduce with power-of-two rescaling). ``set_config(cfg, directions=...)`` picks the
    directions that go through the emulator (the others stay exact), for ablations.
    """

    def __init__(self, model: torch.nn.Module, world_size: int, always_split: bool = False):
        self.forward_sites = TPEmulator(model, world_size)
        try:
            self.backward_sites = BackwardSites(model, world_size, always_split=always_split)
        except BaseException:
            self.forward_sites.close()
            raise
        self.world_size = world_size
        self.config = None
        self.directions = ()

    def set_config(self, config, directions=("forward", "backward")) -> None:
        unknown = set(directions) - {"forward", "backward"}
        if unknown:
            raise ValueError(f"unknown directions {sorted(unknown)}: use 'forward' and/or 'backward'")
        if config is not None and not getattr(config, "enabled", True):
            config = None
        self.config = config
        self.directions = tuple(directions) if config is not None else ()
        self.forward_sites.set_config(config if "forward" in directions else None)
        self.backward_sites.set_config(config if "backward" in directions else None)

    def begin_pass(self) -> None:
        """Start a pass (a micro-batch's forward and backward): both compensators back to zero."""
        self.forward_sites.begin_pass()
        self.backward_sites.begin_pass()

    @property
    def num_forward_sites(self) -> int:
        return self.forward_sites.num_sites

    @property
    def num_backward_sites(self) -> int:
        return self.backward_sites.num_sites

    def close(self) -> None:
        self.backward_sites.close()
        self.forward_sites.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
