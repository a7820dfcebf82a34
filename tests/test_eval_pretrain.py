"""``python -m echo_ds.eval pretrain`` and its backward sites (echo_ds.eval.tp_backward), on tiny models.

Everything here runs on the CPU in seconds: decoders of 2 layers and 64 features, a few training steps,
a synthetic corpus in a temporary directory.
"""

import argparse
import json
import math
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from echo_ds.config import EchoConfig  # noqa: E402
from echo_ds.eval import pretrain as pt  # noqa: E402
from echo_ds.eval import tp_backward as tpb  # noqa: E402
from echo_ds.eval.tp_backward import BackwardSites, TrainingTPEmulator  # noqa: E402

kRepo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
kHeldout = os.path.join(kRepo, "echo_ds", "eval", "data", "shakespeare_heldout.txt")
kTinyModel = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "4", "--intermediate", "96",
              "--seq-len", "32", "--batch-size", "4"]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """Four 'plays' cut from the shipped held-out text: two to train on, tempest and macbeth held out."""
    with open(kHeldout, encoding="utf-8") as f:
        text = f.read()
    path = tmp_path_factory.mktemp("shakespeare")
    n = len(text) // 4
    for i, name in enumerate(("alpha", "beta", "tempest", "macbeth")):
        (path / f"{name}.txt").write_text(text[i * n:(i + 1) * n], encoding="utf-8")
    (path / "README.md").write_text("not a play")
    return str(path)


def parse(argv):
    parser = argparse.ArgumentParser()
    pt.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.dtype is None:
        args.dtype = "float32"
    return args


def tiny_args(corpus_dir, *extra):
    return parse(kTinyModel + ["--data", corpus_dir, "--device", "cpu", "--val-tokens", "256",
                               "--final-val-tokens", "512", "--warmup", "3", "--no-progress", *extra])


def tiny_model(arch="qwen3", seed=0, dtype=torch.float32, kv_heads=2):
    torch.manual_seed(seed)
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=kv_heads, max_position_embeddings=64)
    cfg = transformers.Qwen3Config(head_dim=16, **kw) if arch == "qwen3" else transformers.LlamaConfig(**kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype)
    with torch.no_grad():  # larger than the default init, so that the sites carry non-trivial values
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
    return model


def flat_grad(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return g, out.loss.detach()


def random_ids(batch=2, length=24, seed=1):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------
# Backward sites
# ----------------------------------------------------------------------------------------------------

def test_backward_sites_are_one_per_shared_input_in_forward_order():
    model = tiny_model()
    plans = tpb.plan_backward_sites(model, world_size=2)
    assert [(p.index, p.layer, p.kind) for p in plans] == [(0, 0, "qkv_in"), (1, 0, "gate_up_in"),
                                                           (2, 1, "qkv_in"), (3, 1, "gate_up_in")]
    assert [n.rsplit(".", 1)[-1] for n in plans[0].names] == ["q_proj", "k_proj", "v_proj"]
    assert [n.rsplit(".", 1)[-1] for n in plans[1].names] == ["gate_proj", "up_proj"]
    q, k, v = plans[0].partitions
    assert q.how.startswith("by heads: 2 of 4") and k.how.startswith("by heads: 1 of 2")
    assert [s.stop - s.start for s in plans[1].partitions[0].slices] == [48, 48]
    with pytest.raises(ValueError, match="no column-parallel sites"):
        tpb.plan_backward_sites(torch.nn.Sequential(torch.nn.Linear(4, 4)), world_size=2)


class _Toy(torch.nn.Module):
    """layers.0.self_attn.{q,k,v}_proj and layers.0.mlp.{gate,up}_proj, for the partials by hand."""

    def __init__(self, hidden=16, inter=24, bias=True):
        super().__init__()
        attn = torch.nn.Module()
        for name, out in (("q_proj", hidden), ("k_proj", hidden // 2), ("v_proj", hidden // 2)):
            setattr(attn, name, torch.nn.Linear(hidden, out, bias=bias))
        mlp = torch.nn.Module()
        mlp.gate_proj = torch.nn.Linear(hidden, inter, bias=bias)
        mlp.up_proj = torch.nn.Linear(hidden, inter, bias=bias)
        layer = torch.nn.Module()
        layer.self_attn, layer.mlp = attn, mlp
        self.layers = torch.nn.ModuleList([layer])

    def forward(self, x):
        a = self.layers[0].self_attn
        m = self.layers[0].mlp
        qkv = torch.cat([a.q_proj(x), a.k_proj(x), a.v_proj(x)], -1)
        return qkv, m.gate_proj(x) * m.up_proj(x)


class _Recorder:
    """Stands in for CompensatedAllReduce: records the partials and returns their exact sum."""

    instances = []

    def __init__(self, world_size, config, direction="forward"):
        self.world_size, self.config, self.direction = world_size, config, direction
        self.calls, self.num_resets = [], 0
        _Recorder.instances.append(self)

    def reset(self):
        self.num_resets += 1

    def __call__(self, parts, bits=None):
        self.calls.append((parts.detach().clone(), bits))
        return tpb.exact_reduce(parts)


@pytest.fixture
def recorder(monkeypatch):
    import echo_ds.emulate
    _Recorder.instances = []
    monkeypatch.setattr(echo_ds.emulate, "CompensatedAllReduce", _Recorder)
    return _Recorder


@pytest.mark.parametrize("world_size", [2, 4])
def test_backward_partials_are_the_column_splits_of_the_input_gradient(recorder, world_size):
    torch.manual_seed(world_size)
    toy = _Toy().double()
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    w_qkv, w_mlp = torch.randn(3, 5, 32, dtype=torch.float64), torch.randn(3, 5, 24, dtype=torch.float64)
    with BackwardSites(toy, world_size) as sites:
        sites.set_config(EchoConfig(bits=8))
        sites.begin_pass()
        qkv, mlp = toy(x)
        ((qkv * w_qkv).sum() + (mlp * w_mlp).sum()).backward()
    (op,) = recorder.instances
    assert op.direction == "backward" and op.world_size == world_size and op.num_resets == 1
    # The MLP's site is reduced first: the backward pass visits the sites in reverse.
    (mlp_parts, bits_mlp), (qkv_parts, bits_qkv) = op.calls
    assert bits_mlp == bits_qkv == 8
    plan_qkv, plan_mlp = sites.plans
    # grad of the outputs, by hand; then partial_i = sum_p grad_p[..., cols_i] @ W_p[cols_i, :].
    with torch.no_grad():
        m = toy.layers[0].mlp
        g_q, g_k, g_v = w_qkv.split([16, 8, 8], -1)
        g_gate, g_up = w_mlp * m.up_proj(x), w_mlp * m.gate_proj(x)
        for plan, grads, parts in ((plan_qkv, (g_q, g_k, g_v), qkv_parts), (plan_mlp, (g_gate, g_up), mlp_parts)):
            assert parts.shape == (world_size, 3, 5, 16)
            for i in range(world_size):
                expect = sum(g[..., part.slices[i]] @ mod.weight[part.slices[i]]
                             for g, mod, part in zip(grads, plan.modules, plan.partitions))
                torch.testing.assert_close(parts[i], expect, rtol=0, atol=1e-12)
    assert x.grad is not None


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_backward_sites_at_16bit_give_autograds_gradient(arch):
    """The split with the exact sum in place of the all-reduce: autograd's gradient, to the order of the
    additions. In fp64 that is < 1e-12 relative; in fp32 < 1e-5 (per parameter, relative to its norm:
    the split reorders sums of at most 3 P matrix-product terms, a few fp32 ulps of the largest)."""
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        model = tiny_model(arch, dtype=dtype)
        ids = random_ids()
        ref, ref_loss = flat_grad(model, ids)
        with TrainingTPEmulator(model, 4, always_split=True) as tp:
            tp.set_config(None)
            tp.begin_pass()
            got, loss = flat_grad(model, ids)
            assert tp.backward_sites.num_reduces == tp.num_backward_sites == 4
        # The split computes each rank's output columns as a matrix product of its own: equal to the
        # unsplit product up to the blocking of the products, which depends on the CPU's BLAS kernels (bit
        # for bit on some machines, not on others), so the forward loss agrees to the same tolerance.
        assert abs(float(loss) - float(ref_loss)) <= tol * abs(float(ref_loss)), (dtype, float(loss), float(ref_loss))
        offset = 0
        for name, p in model.named_parameters():
            n = p.numel()
            err = (got[offset:offset + n] - ref[offset:offset + n]).norm() / ref[offset:offset + n].norm()
            assert err <= tol, (dtype, name, float(err))
            offset += n


def test_16bit_emulator_is_the_unhooked_model_bit_for_bit():
    model = tiny_model()
    ids = random_ids()
    ref, ref_loss = flat_grad(model, ids)
    with TrainingTPEmulator(model, 4) as tp:
        tp.set_config(None)
        tp.begin_pass()
        got, loss = flat_grad(model, ids)
        assert tp.backward_sites.num_reduces == 0
        tp.set_config(EchoConfig(enabled=False))
        assert tp.config is None
    assert torch.equal(loss, ref_loss) and torch.equal(got, ref)
    assert all("forward" not in vars(m) for m in model.modules())


def test_both_directions_have_their_own_compensator(recorder):
    model = tiny_model()
    ids = random_ids()
    with TrainingTPEmulator(model, 2) as tp:
        tp.set_config(EchoConfig(bits=4, group_size=32))
        tp.begin_pass()
        flat_grad(model, ids)
    ops = {op.direction: op for op in recorder.instances}
    assert sorted(ops) == ["backward", "forward"] and len(recorder.instances) == 2
    assert len(ops["forward"].calls) == len(ops["backward"].calls) == 4
    # Every backward message is the [P, batch, seq, hidden] partial input gradient.
    assert {tuple(c[0].shape) for c in ops["backward"].calls} == {(2, 2, 24, 64)}


def test_compensator_states_start_from_zero_every_pass():
    model = tiny_model()
    ids = random_ids()
    with TrainingTPEmulator(model, 2) as tp:
        tp.set_config(EchoConfig(bits=4, group_size=32))
        tp.begin_pass()
        first, _ = flat_grad(model, ids)
        carried, _ = flat_grad(model, ids)      # no reset: both directions' averages leak into this pass
        tp.begin_pass()
        again, _ = flat_grad(model, ids)
        tp.begin_pass()
        flat_grad(model, ids)
        tp.forward_sites.begin_pass()           # the forward state alone reset: the backward one leaks
        bwd_carried, _ = flat_grad(model, ids)
    assert torch.equal(first, again)
    assert not torch.equal(first, carried)
    assert not torch.equal(first, bwd_carried)


def test_gradient_fidelity_8bit_cosine_above_0999_and_4bit_worse():
    model = tiny_model()
    ids = random_ids(batch=4, length=32)
    exact, _ = flat_grad(model, ids)
    rel, cos = {}, {}
    with TrainingTPEmulator(model, 4) as tp:
        for name, cfg in (("echo8", EchoConfig(bits=8)), ("echo4", EchoConfig(bits=4))):
            tp.set_config(cfg)
            tp.begin_pass()
            g, _ = flat_grad(model, ids)
            cos[name] = float(g @ exact / (g.norm() * exact.norm()))
            rel[name] = float((g - exact).norm() / exact.norm())
        # the backward direction alone, at 8 bits, with its power-of-two rescaling
        tp.set_config(EchoConfig(bits=8), directions=("backward",))
        tp.begin_pass()
        g, _ = flat_grad(model, ids)
        assert tp.backward_sites.stats.num_calls == 4 and tp.forward_sites.stats.num_calls == 0
        cos["echo8 bwd-only"] = float(g @ exact / (g.norm() * exact.norm()))
    assert cos["echo8"] > 0.999 and cos["echo8 bwd-only"] > 0.999
    assert rel["echo4"] > rel["echo8"] > 0 and cos["echo4"] < cos["echo8"]


# ----------------------------------------------------------------------------------------------------
# Pieces of the trainer
# ----------------------------------------------------------------------------------------------------

def test_corpus_holds_out_the_validation_plays(corpus_dir):
    corpus = pt.load_corpus(corpus_dir, ("tempest", "macbeth"))
    assert corpus.train_files == ["alpha.txt", "beta.txt"] and corpus.val_files == ["tempest.txt", "macbeth.txt"]
    with open(os.path.join(corpus_dir, "tempest.txt"), encoding="utf-8") as f:
        tempest = f.read()
    assert pt.ByteTokenizer.decode(corpus.val[:200].tolist()) == tempest[:200]
    assert corpus.train.dtype == torch.uint8
    with pytest.raises(SystemExit, match="hamlet"):
        pt.load_corpus(corpus_dir, ("hamlet",))


def test_batches_are_a_function_of_seed_and_step(corpus_dir):
    tokens = pt.load_corpus(corpus_dir).train
    a = pt.train_batch(tokens, 7, 4, 32, seed=0)
    assert a.shape == (4, 33) and a.dtype == torch.int64
    assert torch.equal(a, pt.train_batch(tokens, 7, 4, 32, seed=0))
    assert not torch.equal(a, pt.train_batch(tokens, 8, 4, 32, seed=0))
    assert not torch.equal(a, pt.train_batch(tokens, 7, 4, 32, seed=1))
    val = pt.val_batches(tokens, 4, 32, 32 * 10)
    assert [b.shape[0] for b in val] == [4, 4, 2] and torch.equal(val[0][1, 0:1], tokens[32:33].long())


def test_schedule_warms_up_then_decays_to_min_lr():
    lrs = [pt.lr_at(s, 100, 1e-3, 10, 1e-4) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(1e-4)


def test_plan_steps_fits_the_slowest_worker():
    fast, slow = pt.RunCost(0.01, 0.005, 1.0), pt.RunCost(0.05, 0.02, 2.0)
    # worker 0: fast + slow; worker 1: slow. 10 val batches, 4 evals + 1.
    steps = pt.plan_steps(100.0, [[fast, slow], [slow]], num_val_batches=10, num_evals=4)
    per_step, fixed = 0.06, 3.0 + 5 * 10 * 0.025
    assert steps == int((100.0 - fixed) / per_step // 10 * 10)
    assert pt.plan_steps(1.0, [[slow]], num_val_batches=1, num_evals=1) == 10   # never below round_to


def test_runs_and_lr_sweep(corpus_dir):
    args = tiny_args(corpus_dir, "--runs", "echo4,4bit-nocomp", "--lr", "1e-3", "--lr-sweep", "5e-4,1e-3,2e-3")
    runs = pt.build_runs(args)
    assert [r.name for r in runs] == ["16bit", "echo4", "4bit-nocomp", "echo4@lr=0.0005", "echo4@lr=0.002"]
    assert runs[0].config is None and runs[3].config.bits == 4 and runs[3].config.forward.compensate
    assert not runs[2].config.forward.compensate and not runs[2].config.backward.compensate
    assert runs[2].config.backward.pow2_rescale
    assert [r.lr for r in runs] == [1e-3, 1e-3, 1e-3, 5e-4, 2e-3]
    with pytest.raises(SystemExit, match="unknown run"):
        pt.build_runs(tiny_args(corpus_dir, "--runs", "echo5"))


# ----------------------------------------------------------------------------------------------------
# Whole runs
# ----------------------------------------------------------------------------------------------------

def test_16bit_run_is_a_plain_training_run_bit_for_bit(corpus_dir):
    """The 16bit run (emulator installed, evaluations and gradient checks in between) against a bare
    training loop: the same losses and the same final weights, bit for bit."""
    steps = 6
    args = tiny_args(corpus_dir, "--eval-interval", "2", "--grad-check", "0.5")
    corpus = pt.load_corpus(args.data)
    trainer = pt.Trainer(args, corpus)
    runs = pt.build_runs(parse(kTinyModel + ["--data", corpus_dir, "--runs", "echo8"]))
    settings = pt.make_settings(args, steps)
    result = trainer.run(runs[0], settings, progress=False, grad_variants=pt.grad_check_variants(runs))
    assert [r["variant"] for r in result["gradient_fidelity"]] == ["echo8"]

    model = pt.build_model(args, args.seed)
    opt = pt.make_optimizer(model, args.lr, args.weight_decay, (args.beta1, args.beta2), args.adam_eps)
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = pt.lr_at(step, steps, args.lr, args.warmup, args.lr * args.min_lr_ratio)
        loss = pt.loss_of(model, pt.train_batch(corpus.train, step, args.batch_size, args.seq_len, args.seed), None)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert result["train_loss"] == losses
    trained = trainer.model.state_dict()
    assert all(torch.equal(trained[k], v) for k, v in model.state_dict().items())


def test_cli_json_schema_and_plot(corpus_dir, tmp_path):
    out, png = tmp_path / "pretrain.json", tmp_path / "pretrain.png"
    steps = 8
    argv = kTinyModel + ["--data", corpus_dir, "--device", "cpu", "--steps", str(steps), "--warmup", "2",
                         "--val-tokens", "256", "--final-val-tokens", "512", "--num-evals", "2",
                         "--runs", "16bit,echo8,4bit-nocomp", "--lr-sweep", "5e-4,1e-3", "--grad-check", "0,1",
                         "--json", str(out), "--plot", str(png), "--no-progress", "--no-bench"]
    assert pt.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == pt.SCHEMA and doc["command"].startswith("python -m echo_ds.eval pretrain")
    for key in ("date", "machine", "model", "tokenizer", "data", "train", "tp", "runs", "summary",
                "gradient_fidelity", "lr_sweep"):
        assert key in doc, key
    assert doc["tp"]["num_forward_sites"] == doc["tp"]["num_backward_sites"] == 4
    assert doc["data"]["val_files"] == ["tempest.txt", "macbeth.txt"]
    assert [r["name"] for r in doc["runs"]] == ["16bit", "echo8", "4bit-nocomp", "echo4@lr=0.0005", "echo4@lr=0.001"]
    for r in doc["runs"]:
        assert len(r["train_loss"]) == steps and all(math.isfinite(v) for v in r["train_loss"])
        assert [v["step"] for v in r["val"]] == [0, 4, 8]
        assert r["final_val_loss"] is not None and r["tail100"] == pytest.approx(sum(r["train_loss"]) / steps)
    base = doc["runs"][0]
    assert base["echo"] is None and base["wire_bits_per_element"] == {"forward": 16.0, "backward": 16.0}
    assert doc["runs"][1]["wire_bits_per_element"]["backward"] == pytest.approx(8.25)
    rows = {r["name"]: r for r in doc["summary"]}
    assert rows["16bit"]["tail100_pct"] == 0.0 and rows["echo8"]["final_val_pct"] is not None
    checks = {(r["step"], r["variant"]) for r in doc["gradient_fidelity"]}
    assert (0, "echo8") in checks and (steps, "4bit-nocomp bwd-only") in checks and (0, "echo4") not in checks
    assert all(-1 <= r["cosine"] <= 1 and r["rel_error"] >= 0 for r in doc["gradient_fidelity"])
    assert [r["lr"] for r in doc["lr_sweep"]] == [5e-4, 1e-3]
    assert doc["lr_sweep"][1]["delta_to_main_lr"] == 0.0
    assert png.stat().st_size > 10_000


def test_subcommand_is_registered():
    from echo_ds.eval import SUBCOMMANDS
    from echo_ds.eval.__main__ import build_parser
    assert SUBCOMMANDS["pretrain"] == "echo_ds.eval.pretrain"
    args = build_parser().parse_args(["pretrain", "--steps", "3"])
    assert args.run is pt.run and args.steps == 3
