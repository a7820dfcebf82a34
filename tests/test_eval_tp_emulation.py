"""Emulated tensor-parallel sites of a causal LM (echo_ds.eval.tp_emulation), on tiny random Llamas."""

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from echo_ds.config import EchoConfig  # noqa: E402
from echo_ds.eval import tp_emulation as tpe  # noqa: E402
from echo_ds.eval.tp_emulation import TPEmulator  # noqa: E402

kHidden = 64
kHeads = 4          # head_dim 16
kIntermediate = 96
kVocab = 128


def tiny_llama(num_layers=3, bias=False, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=kVocab, hidden_size=kHidden, intermediate_size=kIntermediate,
                                   num_hidden_layers=num_layers, num_attention_heads=kHeads,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   attention_bias=bias, mlp_bias=bias)
    model = transformers.LlamaForCausalLM(cfg).eval()
    # Larger than the default init (std 0.02) so that the sites carry non-trivial values.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            elif bias:
                p.normal_(0.0, 0.1)
    return model


def random_ids(length=48, batch=1, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, kVocab, (batch, length), generator=gen)


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


class RecordingOp:
    """Stands in for CompensatedAllReduce: records each call and returns the exact sum."""

    instances = []

    def __init__(self, world_size, config, direction="forward"):
        self.world_size, self.config, self.direction = world_size, config, direction
        self.calls, self.num_resets = [], 0
        RecordingOp.instances.append(self)

    def reset(self):
        self.num_resets += 1

    def __call__(self, parts, bits=None):
        self.calls.append((bits, tuple(parts.shape), parts.dtype))
        return parts.sum(0)


@pytest.fixture
def recording_op(monkeypatch):
    import echo_ds.emulate
    RecordingOp.instances = []
    monkeypatch.setattr(echo_ds.emulate, "CompensatedAllReduce", RecordingOp)
    return RecordingOp


# ----------------------------------------------------------------------------------------------------
# Partitions and partials
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_features,world_size", [(96, 4), (576, 4), (64, 3), (1536, 8), (7, 7), (10, 1)])
def test_even_partition_is_contiguous_and_balanced(num_features, world_size):
    part = tpe.even_partition(num_features, world_size)
    assert part.world_size == world_size
    sizes = [s.stop - s.start for s in part.slices]
    assert part.slices[0].start == 0 and part.slices[-1].stop == num_features
    assert all(a.stop == b.start for a, b in zip(part.slices, part.slices[1:]))
    assert max(sizes) - min(sizes) <= 1


def test_head_partition_splits_by_heads_when_p_divides_them():
    part = tpe.head_partition(num_heads=12, head_dim=64, world_size=4)
    assert [(s.start, s.stop) for s in part.slices] == [(0, 192), (192, 384), (384, 576), (576, 768)]
    assert part.how.startswith("by heads: 3 of 12")


def test_head_partition_falls_back_to_an_even_split_and_says_so():
    # SmolLM2-135M: 9 heads of 64 at P=4.
    part = tpe.head_partition(num_heads=9, head_dim=64, world_size=4)
    assert [s.stop - s.start for s in part.slices] == [144] * 4
    assert "does not divide num_heads=9" in part.how


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_partials_sum_to_the_projection(world_size):
    gen = torch.Generator().manual_seed(world_size)
    # Small integers: every product and partial sum is exact in fp32, so the split is exact too.
    x = torch.randint(-8, 9, (2, 5, 96), generator=gen).float()
    w = torch.randint(-8, 9, (40, 96), generator=gen).float()
    part = tpe.even_partition(96, world_size)
    parts = tpe.row_parallel_partials(x, w, part)
    assert parts.shape == (world_size, 2, 5, 40)
    assert torch.equal(parts.sum(0), F.linear(x, w))
    # Random fp64 values: equal up to the order of the additions.
    x = torch.randn(2, 5, 96, generator=gen, dtype=torch.float64)
    w = torch.randn(40, 96, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(tpe.row_parallel_partials(x, w, part).sum(0), F.linear(x, w),
                               rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------------
# Sites of a model
# ----------------------------------------------------------------------------------------------------

def test_sites_are_o_proj_and_down_proj_of_every_layer_in_order():
    model = tiny_llama(num_layers=3)
    plans = tpe.plan_forward_sites(model, world_size=2)
    assert [p.index for p in plans] == list(range(6))
    assert [(p.layer, p.kind) for p in plans] == [(i, k) for i in range(3) for k in ("attn_out", "mlp_down")]
    assert plans[0].name == "model.layers.0.self_attn.o_proj"
    assert plans[1].name == "model.layers.0.mlp.down_proj"
    assert plans[0].partition.how.startswith("by heads: 2 of 4")
    assert [s.stop - s.start for s in plans[1].partition.slices] == [48, 48]
    # P=3 does not divide 4 heads: even split of the 64 features.
    assert "does not divide" in tpe.plan_forward_sites(model, world_size=3)[0].partition.how


def test_model_without_sites_is_rejected():
    with pytest.raises(ValueError, match="no tensor-parallel sites"):
        tpe.plan_forward_sites(torch.nn.Sequential(torch.nn.Linear(4, 4)), world_size=2)


def test_world_size_below_one_is_rejected_before_planning():
    from echo_ds.eval.tp_backward import BackwardSites

    for cls in (TPEmulator, BackwardSites):
        with pytest.raises(ValueError, match="world_size=0 must be >= 1"):
            cls(tiny_llama(num_layers=1), 0)


def test_site_that_cannot_be_split_is_rejected():
    # A site name whose module is not an nn.Linear, and an nn.Linear site outside any "layers.<i>".
    model = tiny_llama(num_layers=1)
    model.model.layers[0].mlp.down_proj = torch.nn.Identity()
    with pytest.raises(ValueError, match="not an nn.Linear"):
        tpe.plan_forward_sites(model, world_size=2)
    stray = torch.nn.Module()
    stray.self_attn = torch.nn.Module()
    stray.self_attn.o_proj = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="cannot tell the layer index of self_attn.o_proj"):
        tpe.plan_forward_sites(stray, world_size=2)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_16bit_path_is_bit_for_bit_the_unhooked_model(world_size):
    model = tiny_llama(bias=True)
    ids = random_ids(batch=2)
    ref = logits_of(model, ids)
    keys = list(model.state_dict())
    with TPEmulator(model, world_size) as tp:
        tp.set_config(None)
        tp.begin_pass()
        assert torch.equal(logits_of(model, ids), ref)
        tp.set_config(EchoConfig(enabled=False))
        assert tp.config is None
        assert torch.equal(logits_of(model, ids), ref)
        assert list(model.state_dict()) == keys
    assert all("forward" not in vars(p.module) for p in tp.plans)
    assert torch.equal(logits_of(model, ids), ref)


@pytest.mark.parametrize("world_size", [2, 3])
def test_sites_reduce_the_partials_and_add_the_bias_once(recording_op, world_size):
    model = tiny_llama(bias=True)
    ids = random_ids()
    ref = logits_of(model, ids)
    with TPEmulator(model, world_size) as tp:
        tp.set_config(EchoConfig(bits=8))
        tp.begin_pass()
        out = logits_of(model, ids)
    (op,) = recording_op.instances
    assert [c[1] for c in op.calls] == [(world_size, 1, ids.shape[1], kHidden)] * 6
    assert op.direction == "forward" and op.world_size == world_size
    # The exact sum in place of the Echo all-reduce: the model again, up to the order of additions.
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_early_sites_get_their_bits(recording_op):
    model = tiny_llama(num_layers=4)   # 8 sites
    cfg = EchoConfig(bits=4, group_size=64, early_sites={"bits": 8, "fraction": 0.5})
    with TPEmulator(model, 2) as tp:
        tp.set_config(cfg)
        tp.begin_pass()
        logits_of(model, random_ids())
        stats = tp.stats
    (op,) = recording_op.instances
    assert [c[0] for c in op.calls] == [8, 8, 8, 8, 4, 4, 4, 4]
    assert stats.bits_per_site == {i: (8 if i < 4 else 4) for i in range(8)}
    # Per element on the wire: the codes plus one packed 16-bit parameter word per group of 64.
    assert stats.bits_per_element == pytest.approx((8 + 4) / 2 + 16 / 64)


def test_compensator_state_spans_a_pass_and_resets_between_passes():
    model = tiny_llama()
    ids = random_ids()
    ref = logits_of(model, ids)
    with TPEmulator(model, 2) as tp:
        tp.set_config(EchoConfig(bits=4, group_size=32))
        tp.begin_pass()
        first = logits_of(model, ids)
        carried = logits_of(model, ids)          # no reset: the averages of the first pass leak in
        tp.begin_pass()
        again = logits_of(model, ids)
    assert not torch.equal(first, ref)
    assert torch.equal(first, again)
    assert not torch.equal(first, carried)


def test_backward_through_the_sites_is_the_identity(recording_op):
    """forward: the reduce of the partials; backward: every partial gets the output gradient (TP)."""
    ids = random_ids()

    def grads(emulate):
        model = tiny_llama(bias=True)
        tp = TPEmulator(model, 2) if emulate else None
        if tp is not None:
            tp.set_config(EchoConfig(bits=4))
            tp.begin_pass()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        if tp is not None:
            tp.close()
        return {n: p.grad for n, p in model.named_parameters()}

    ref, emulated = grads(False), grads(True)
    for name in ref:
        torch.testing.assert_close(emulated[name], ref[name], rtol=1e-4, atol=1e-5, msg=name)
