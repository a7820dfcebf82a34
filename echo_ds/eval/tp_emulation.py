"""Emulated tensor parallelism in one process: the all-reduce sites of a Hugging Face causal LM.

Megatron-style tensor parallelism at degree P ends every attention block and every MLP with a
row-parallel linear: GPU i holds the input features ``chunk_i`` of the projection (its heads of the
attention output, its slice of the MLP intermediate dim) and computes the partial product

    partial_i = x[..., chunk_i] @ W[:, chunk_i]^T            (shape [..., out_features])

which one all-reduce sums into the block's output (the bias, if any, is added once, after the sum).
:class:`TPEmulator` reproduces this on one device: at every such *forward site* it splits the
projection's input features as P GPUs would, stacks the P partials into a ``[P, ..., out]`` tensor and
passes it through the Echo emulator (:class:`echo_ds.emulate.CompensatedAllReduce`), which returns what
every GPU would hold after the quantized, compensated all-reduce. The compensator state lives in the
emulator, one instance per direction, and :meth:`TPEmulator.begin_pass` resets it at the start of each
forward pass (the paper resets the averages at the start of each pass, Sec. 5.1).

Sites, in execution order (site index k = 2 * layer + {0: attention, 1: MLP}, N = 2 x layers):

* ``self_attn.o_proj``: split by heads (num_heads / P contiguous heads per GPU) when P divides the
  number of heads; otherwise an even split of the input features (a GPU's chunk then cuts through a
  head, which no real TP deployment does; the numbers are still those of P partial sums of that size).
* ``mlp.down_proj``: P contiguous chunks of the intermediate dim.

With no config set (or one with ``enabled: false``) a site calls the original ``nn.Linear`` unchanged,
so the 16-bit baseline is bit for bit the unwrapped model.

The forward reduce is a ``torch.autograd.Function`` whose backward is the identity (each GPU's partial
receives the full output gradient, as in TP), so a training loop can run through the emulated forward
sites. The backward sites (the all-reduce of the input gradient at the column-parallel q/k/v and gate/up
projections) are :mod:`echo_ds.eval.tp_backward`'s :class:`~echo_ds.eval.tp_backward.BackwardSites`, with
a compensator of their own; :class:`~echo_ds.eval.tp_backward.TrainingTPEmulator` owns both directions of
a model (``python -m echo_ds.eval pretrain`` trains through it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# Module-name suffixes of the row-parallel projections (Llama, Qwen2/3, Mistral, Gemma naming).
kAttentionOutputSuffixes = ("self_attn.o_proj",)
kMlpDownSuffixes = ("mlp.down_proj",)
SITE_KINDS = ("attn_out", "mlp_down")

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# ----------------------------------------------------------------------------------------------------
# Partitions of the input features
# ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Partition:
    """How P GPUs split the ``num_features`` input features of a row-parallel projection.

    slices: P contiguous, disjoint slices that cover ``range(num_features)`` in order.
    how: a human-readable account ("by heads: 3 of 12 heads per GPU").
    """

    num_features: int
    slices: tuple
    how: str

    @property
    def world_size(self) -> int:
        return len(self.slices)


def even_partition(num_features: int, world_size: int, what: str = "features") -> Partition:
    """P contiguous chunks of ``num_features``; sizes differ by at most one (the first ones larger)."""
    if world_size < 1 or world_size > num_features:
        raise ValueError(f"cannot split {num_features} {what} over {world_size} GPUs")
    base, extra = divmod(num_features, world_size)
    sizes = [base + (1 if i < extra else 0) for i in range(world_size)]
    slices, start = [], 0
    for size in sizes:
        slices.append(slice(start, start + size))
        start += size
    if len(set(sizes)) == 1:
        how = f"even split: {sizes[0]} {what} per GPU"
    else:
        how = f"even split: {max(sizes)} or {min(sizes)} {what} per GPU"
    return Partition(num_features, tuple(slices), how)


def head_partition(num_heads: int, head_dim: int, world_size: int) -> Partition:
    """Split the attention output features by heads; an even feature split when P does not divide them."""
    num_features = num_heads * head_dim
    if num_heads % world_size == 0:
        per_gpu = num_heads // world_size
        width = per_gpu * head_dim
        slices = tuple(slice(i * width, (i + 1) * width) for i in range(world_size))
        return Partition(num_features, slices, f"by heads: {per_gpu} of {num_heads} heads per GPU")
    even = even_partition(num_features, world_size)
    how = (f"{even.how} (P={world_size} does not divide num_heads={num_heads}, so the split cuts "
           f"through heads; a real TP deployment could not run this model at P={world_size})")
    return Partition(num_features, even.slices, how)


def row_parallel_partials(x: torch.Tensor, weight: torch.Tensor, partition: Partition) -> torch.Tensor:
    """The P partial products of a row-parallel linear.

    x: [..., in_features], weight: [out_features, in_features] (any float dtype, the same for both).
    Returns [P, ..., out_features] in x's dtype, partial_i = x[..., chunk_i] @ weight[:, chunk_i]^T, so
    that their sum is ``x @ weight^T`` up to the order of the additions.
    """
    if x.shape[-1] != partition.num_features or weight.shape[1] != partition.num_features:
        raise ValueError(f"partition of {partition.num_features} features does not fit x {tuple(x.shape)} "
                         f"and weight {tuple(weight.shape)}")
    return torch.stack([F.linear(x[..., s], weight[:, s]) for s in partition.slices])


# ----------------------------------------------------------------------------------------------------
# Sites of a model
# ----------------------------------------------------------------------------------------------------

@dataclass
class SitePlan:
    """One forward all-reduce site: the row-parallel projection whose partials it sums."""

    index: int          # position in the pass, 0 .. num_sites - 1
    layer: int
    kind: str           # "attn_out" or "mlp_down"
    name: str           # module name in the model
    module: torch.nn.Linear
    partition: Partition


def _config_attr(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def site_layer_index(name: str, module: torch.nn.Module) -> int:
    """The layer index of the site ``name`` ("...layers.<i>...."), which must be an ``nn.Linear``."""
    if not isinstance(module, torch.nn.Linear):
        raise ValueError(f"{name} is a {type(module).__name__}, not an nn.Linear: cannot split it")
    match = _LAYER_RE.search(name)
    if match is None:
        raise ValueError(f"cannot tell the layer index of {name}")
    return int(match.group(1))


def plan_forward_sites(model: torch.nn.Module, world_size: int) -> list:
    """The forward sites of ``model`` at TP degree ``world_size``, in execution order.

    Finds every ``*.layers.<i>.self_attn.o_proj`` and ``*.layers.<i>.mlp.down_proj`` ``nn.Linear``.
    Raises ValueError when the model has none (not a Llama/Qwen/Mistral-style decoder).
    """
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = []
    for name, module in model.named_modules():
        kind = None
        if name.endswith(kAttentionOutputSuffixes):
            kind = "attn_out"
        elif name.endswith(kMlpDownSuffixes):
            kind = "mlp_down"
        if kind is None:
            continue
        found.append((site_layer_index(name, module), SITE_KINDS.index(kind), kind, name, module))
    if not found:
        raise ValueError("no tensor-parallel sites found: expected Llama-style modules named "
                         f"'layers.<i>.{kAttentionOutputSuffixes[0]}' and 'layers.<i>.{kMlpDownSuffixes[0]}'")
    found.sort(key=lambda t: (t[0], t[1]))

    plans = []
    for index, (layer, _, kind, name, module) in enumerate(found):
        if kind == "attn_out":
            num_heads = _config_attr(text_config, "num_attention_heads", "n_head")
            head_dim = _config_attr(text_config, "head_dim")
            if num_heads and not head_dim and module.in_features % num_heads == 0:
                head_dim = module.in_features // num_heads
            if num_heads and head_dim and num_heads * head_dim == module.in_features:
                partition = head_partition(num_heads, head_dim, world_size)
            else:
                partition = even_partition(module.in_features, world_size)
        else:
            partition = even_partition(module.in_features, world_size, "intermediate features")
        plans.append(SitePlan(index, layer, kind, name, module, partition))
    return plans


def describe_partitions(plans: list) -> dict:
    """{site kind: how its inputs are split}, one line per kind (all layers of a model agree)."""
    out = {}
    for plan in plans:
        out.setdefault(plan.kind, set()).add(plan.partition.how)
    return {kind: "; ".join(sorted(hows)) for kind, hows in out.items()}


# ----------------------------------------------------------------------------------------------------
# The emulated reduce
# ----------------------------------------------------------------------------------------------------

class _EmulatedForwardReduce(torch.autograd.Function):
    """forward: the Echo all-reduce of the P partials; backward: identity (every partial gets the grad)."""

    @staticmethod
    def forward(ctx, parts, op, bits):
        ctx.num_parts = parts.shape[0]
        return op(parts, bits=bits)

    @staticmethod
    def backward(ctx, grad):
        return grad.unsqueeze(0).expand(ctx.num_parts, *grad.shape), None, None


@dataclass
class WireStats:
    """Elements reduced and bytes each GPU puts on the wire per element, summed over one or more passes."""

    num_elements: int = 0
    num_wire_bytes: int = 0
    num_calls: int = 0
    bits_per_site: dict = field(default_factory=dict)

    @property
    def bits_per_element(self) -> float:
        return 8.0 * self.num_wire_bytes / self.num_elements if self.num_elements else float("nan")

    def record(self, numel: int, bits: int, group_size: int, site_index: int, quantizer: str = "zero_aware") -> None:
        """Account one reduce of ``numel`` elements at ``bits`` on the wire."""
        from echo_ds.quant import wire_bytes

        self.num_elements += numel
        self.num_wire_bytes += wire_bytes(numel, bits, group_size, quantizer)
        self.num_calls += 1
        self.bits_per_site[site_index] = bits


class SiteEmulator:
    """What the forward and backward site emulators share: while installed (``install``/``close``, or a
    ``with`` block) the ``forward`` of every site's module is replaced; ``set_config`` takes an EchoConfig
    (None, or ``"enabled": false``: the exact path). Subclasses say which modules and what replaces them,
    and what state a new config or ``close`` drops. ``plans`` None: ``planner(model, world_size)``."""

    def __init__(self, model: torch.nn.Module, world_size: int, plans: list | None, planner):
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        self.model = model
        self.world_size = world_size
        self.plans = plans if plans is not None else planner(model, world_size)
        self.config = None
        self.stats = WireStats()
        self._installed = False

    @property
    def num_sites(self) -> int:
        return len(self.plans)

    def _site_forwards(self):
        """(module, replacement forward) of every site."""
        raise NotImplementedError

    def _site_modules(self):
        """Every module whose forward install() replaces."""
        raise NotImplementedError

    def _drop_config_state(self) -> None:
        """Forget what belongs to the current config (compensator state, per-pass records)."""

    def install(self) -> None:
        if self._installed:
            return
        for module, forward in self._site_forwards():
            module.forward = forward
        self._installed = True

    def close(self) -> None:
        """Give every site its original ``forward`` back."""
        if not self._installed:
            return
        for module in self._site_modules():
            del module.forward
        self._installed = False
        self._drop_config_state()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def set_config(self, config) -> None:
        """Use ``config`` from now on; None or disabled: the exact path."""
        if config is not None and not getattr(config, "enabled", True):
            config = None
        self.config = config
        self.stats = WireStats()
        self._drop_config_state()


class TPEmulator(SiteEmulator):
    """Owns the emulated TP sites of one model: installs them, runs the reduce, restores the model.

    Usage::

        with TPEmulator(model, world_size=4) as tp:
            tp.set_config(echo_config)      # an EchoConfig; None for the exact 16-bit path
            tp.begin_pass()                 # new sequence: compensator state back to zero
            logits = model(input_ids).logits

    Each site's ``nn.Linear`` keeps its parameters and state-dict names; only its ``forward`` is
    replaced while the emulator is installed.
    """

    def __init__(self, model: torch.nn.Module, world_size: int, plans: list | None = None):
        super().__init__(model, world_size, plans, plan_forward_sites)
        self._ops = {}
        self.install()

    # -- lifecycle and configuration (SiteEmulator) ----------------------------------------------------
    def _site_forwards(self):
        return [(plan.module, self._site_forward(plan)) for plan in self.plans]

    def _site_modules(self):
        return [plan.module for plan in self.plans]

    def _drop_config_state(self) -> None:
        self._ops = {}

    def begin_pass(self) -> None:
        """Start a new pass: every compensator's averages back to zero."""
        for op in self._ops.values():
            op.reset()

    def bits_for_site(self, index: int) -> int:
        """Bit width of site ``index`` under the current config (16 on the exact path)."""
        if self.config is None:
            return 16
        return int(self.config.bits_for_site(index, self.num_sites))

    def _op(self, direction: str):
        op = self._ops.get(direction)
        if op is None:
            from echo_ds.emulate import CompensatedAllReduce
            op = CompensatedAllReduce(self.world_size, self.config, direction=direction)
            self._ops[direction] = op
        return op

    # -- the reduce ------------------------------------------------------------------------------------
    def reduce(self, parts: torch.Tensor, site_index: int, direction: str = "forward") -> torch.Tensor:
        """The all-reduce of ``parts`` ([P, ...], any float dtype) at ``site_index``: shape parts.shape[1:].

        Exact sum on the exact path; otherwise the Echo emulator at the site's bit width.
        """
        if self.config is None:
            return parts.sum(0)
        bits = self.bits_for_site(site_index)
        self.stats.record(parts[0].numel(), bits, self.config.group_size, site_index, self.config.quantizer)
        return _EmulatedForwardReduce.apply(parts, self._op(direction), bits)

    def _site_forward(self, plan: SitePlan):
        module, partition = plan.module, plan.partition

        def forward(x: torch.Tensor) -> torch.Tensor:
            if self.config is None:
                return type(module).forward(module, x)
            parts = row_parallel_partials(x, module.weight, partition)
            y = self.reduce(parts, plan.index)
            if module.bias is not None:
                y = y + module.bias
            return y

        return forward
