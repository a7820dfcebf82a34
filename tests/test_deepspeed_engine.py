"""``echo_ds.deepspeed.initialize`` / ``init_inference`` on a tiny transformers Llama, 2 gloo ranks.

One spawn for training (``deepspeed.initialize`` with AutoTP), one for inference
(``deepspeed.init_inference`` with AutoTP); each returns plain data that the tests assert on.
"""

from __future__ import annotations

import pytest

from utils import deepspeed_env, free_port, run_distributed

pytest.importorskip("transformers")

LAYERS = 2


def _llama(seed=0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _ds_config(echo=None, gas=1, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "steps_per_print": 10**6,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 0}, "tensor_parallel": {"autotp_size": 2}}
    if echo is not None:
        cfg["echo"] = echo
    cfg.update(extra)
    return cfg


def _training(rank, world_size, shm_port, csv_dir):
    import os

    import deepspeed
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    import echo_ds.deepspeed as echo

    deepspeed_env(rank, world_size, shm_port)
    res = {}
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))

    def grads_of(engine):
        engine.zero_grad()
        out = engine(input_ids=tokens, labels=tokens)
        engine.backward(out.loss)
        grads = {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}
        return out.loss.item(), grads

    # initialize: DeepSpeed's return shape; AutoTP layers patched, the output head left to DeepSpeed.
    model = _llama()
    result = echo.initialize(model=model, model_parameters=model.parameters(),
                             config=_ds_config({"bits": 8, "backend": "reference"}))
    engine = result[0]
    rt = echo.get_runtime(engine)
    res["returns"] = (len(result), isinstance(engine, DeepSpeedEngine), result[1] is engine.optimizer)
    res["classes"] = {n: type(m).__name__ for n, m in engine.module.named_modules() if n.endswith("proj") or
                      n == "lm_head"}
    res["sites"] = [(s.name, s.direction) for s in rt.sites]
    loss, grads = grads_of(engine)
    res["loss"] = loss
    res["counts"] = (rt.stats.forward_calls, rt.stats.backward_calls, rt.stats.coalesced_layers)

    # Hugging Face gradient checkpointing (non-reentrant, flagged): gradients equal bit for bit.
    engine.module.gradient_checkpointing_enable()
    loss_ckpt, grads_ckpt = grads_of(engine)
    res["ckpt_equal"] = loss_ckpt == loss and set(grads) == set(grads_ckpt) and all(
        torch.equal(grads[k], grads_ckpt[k]) for k in grads)
    res["ckpt_recomputed"] = rt.stats.recomputed_calls
    res["ckpt_fallbacks"] = rt.stats.recompute_fallbacks
    engine.module.gradient_checkpointing_disable()

    # A training step through DeepSpeed's own loop, then the counters.
    out = engine(input_ids=tokens, labels=tokens)
    engine.backward(out.loss)
    engine.step()
    res["stepped_loss_finite"] = bool(torch.isfinite(out.loss))
    with pytest.raises(RuntimeError, match="already runs through Echo"):
        echo.enable(engine)
    res["enable_twice_refused"] = True

    # Gradient accumulation through the engine: every micro-batch is its own forward and backward pass.
    # The counters go to DeepSpeed's CSV monitor every steps_per_print steps.
    model = _llama()
    monitor = {"csv_monitor": {"enabled": True, "output_path": csv_dir, "job_name": "echo"}}
    engine, *_ = echo.initialize(model=model, model_parameters=model.parameters(),
                                 config=_ds_config({"bits": 4, "backend": "reference"}, gas=2, steps_per_print=1,
                                                   **monitor))
    rt = echo.get_runtime(engine)
    for _ in range(4):
        out = engine(input_ids=tokens, labels=tokens)
        engine.backward(out.loss)
        engine.step()
    res["gas_passes"] = (rt.stats.forward_passes, rt.stats.backward_passes, engine.global_steps)
    res["gas_calls"] = (rt.stats.forward_calls, rt.stats.backward_calls)
    engine(input_ids=tokens, labels=tokens)  # a forward at global step 2 logs step 2
    job_dir = os.path.join(csv_dir, "echo")
    res["csv"] = {}
    if rank == 0:
        for name in ("Echo_forward_calls", "Echo_bytes_ratio"):
            with open(os.path.join(job_dir, name + ".csv")) as f:
                res["csv"][name] = f.read().split()

    # The output head compressed on request: one more backward site.
    model = _llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=_ds_config({"bits": 4}))
    rt = echo.enable(engine, quantize_lm_head=True)
    res["lm_head_class"] = type(engine.module.lm_head).__name__
    grads_of(engine)
    res["lm_head_counts"] = (rt.stats.forward_calls, rt.stats.backward_calls)

    # Without an "echo" section initialize is deepspeed.initialize.
    model = _llama()
    engine, *_ = echo.initialize(model=model, model_parameters=model.parameters(), config=_ds_config())
    res["no_echo_runtime"] = echo.get_runtime(engine) is None
    res["no_echo_classes"] = sorted({type(m).__name__ for n, m in engine.module.named_modules() if n.endswith("proj")})
    loss_plain, _ = grads_of(engine)
    res["loss_plain"] = loss_plain

    # DeepCompile's AutoTP pass is refused with a message saying what to change.
    model = _llama()
    try:
        echo.initialize(model=model, model_parameters=model.parameters(),
                        config=_ds_config({"bits": 4}, compile={"deepcompile": True, "passes": ["autotp"]}))
        res["deepcompile_error"] = None
    except ValueError as e:
        res["deepcompile_error"] = str(e)
    return res


def _inference(rank, world_size, shm_port):
    import deepspeed
    import torch

    import echo_ds.deepspeed as echo

    deepspeed_env(rank, world_size, shm_port)
    from deepspeed.module_inject.layers import set_autotp_mode

    set_autotp_mode(training=False)
    res = {}
    tokens = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(4))
    base = {"tensor_parallel": {"tp_size": 2}, "dtype": "fp32", "replace_with_kernel_inject": False}

    model = _llama().eval()
    with torch.no_grad():
        ref = model(input_ids=tokens).logits
    try:  # DeepSpeed's strict inference config rejects the section that echo_ds.init_inference strips
        deepspeed.init_inference(_llama().eval(), config={**base, "echo": {"bits": 8}})
        res["deepspeed_rejects_echo_key"] = False
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError
        res["deepspeed_rejects_echo_key"] = "echo" in str(e)

    for bits in (8, 4):
        engine = echo.init_inference(_llama().eval(), config={**base, "echo": {"bits": bits, "backend": "auto"}})
        rt = echo.get_runtime(engine)
        res["classes"] = sorted({type(m).__name__ for n, m in engine.module.named_modules()
                                 if n.endswith("proj") or n == "lm_head"})
        with torch.no_grad():
            logits = engine(input_ids=tokens).logits
            logits_again = engine(input_ids=tokens).logits  # every forward pass starts from a reset state
            short = engine(input_ids=tokens[:, :3]).logits  # another message size: the state is resized
        res[f"rel_error_{bits}"] = ((logits - ref).norm() / ref.norm()).item()
        res[f"repeatable_{bits}"] = torch.equal(logits, logits_again)
        res[f"short_finite_{bits}"] = bool(torch.isfinite(short).all())
        res[f"counts_{bits}"] = (rt.stats.forward_calls, rt.stats.backward_calls, rt.stats.forward_passes)
        res["backend"] = rt.backend

    # The inference head compressed on request.
    engine = deepspeed.init_inference(_llama().eval(), config=base)
    rt = echo.enable(engine, {"bits": 8}, quantize_lm_head=True)
    with torch.no_grad():
        logits = engine(input_ids=tokens).logits
    res["head_class"] = type(engine.module.lm_head).__name__
    res["head_counts"] = (rt.stats.forward_calls, rt.stats.backward_calls)
    res["head_rel_error"] = ((logits - ref).norm() / ref.norm()).item()
    return res


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    return run_distributed(_training, 2, free_port(), str(tmp_path_factory.mktemp("csv")), timeout=300)


@pytest.fixture(scope="module")
def inference():
    return run_distributed(_inference, 2, free_port(), timeout=300)


def test_initialize_returns_and_patches(training):
    r = training[0]
    assert r["returns"] == (4, True, True)
    for name, cls in r["classes"].items():
        if name == "lm_head":
            assert cls == "LinearLayer", "the output head stays DeepSpeed's unless quantize_lm_head"
        elif name.endswith(("o_proj", "down_proj")):
            assert cls == "EchoLinearAllreduce", name
        else:
            assert cls == "EchoLinearLayer", name
    assert len(r["sites"]) == LAYERS * 7
    assert training[0]["sites"] == training[1]["sites"]


def test_training_counts_and_coalescing(training):
    r = training[0]
    # Per decoder layer: 2 forward sites, 5 column-parallel layers in 2 backward calls.
    assert r["counts"] == (2 * LAYERS, 2 * LAYERS, 3 * LAYERS)
    assert r["stepped_loss_finite"] and r["enable_twice_refused"]
    # Echo 8-bit changes the loss of the first forward only slightly.
    assert r["loss"] != r["loss_plain"] and abs(r["loss"] - r["loss_plain"]) < 1e-2 * r["loss_plain"]


def test_hf_gradient_checkpointing_bit_exact(training):
    r = training[0]
    assert r["ckpt_equal"]
    assert r["ckpt_recomputed"] > 0 and r["ckpt_fallbacks"] == 0


def test_gradient_accumulation_passes(training):
    r = training[0]
    assert r["gas_passes"] == (4, 4, 2)  # 2 steps x 2 micro-batches, each its own pass per direction
    assert r["gas_calls"] == (4 * 2 * LAYERS, 4 * 2 * LAYERS)


def test_counters_reach_deepspeed_monitor(training):
    csv = training[0]["csv"]
    # header, then one row per logged step: steps 1 and 2 (steps_per_print 1), read at the next forward.
    assert csv["Echo_forward_calls"] == ["step,forward_calls", f"1,{2 * 2 * LAYERS}", f"2,{4 * 2 * LAYERS}"]
    ratio = float(csv["Echo_bytes_ratio"][1].split(",")[1])
    assert ratio == 68 / 256  # 4-bit codes plus fp16 scale and zero per 128 elements


def test_lm_head_compressed_when_asked(training):
    r = training[0]
    assert r["lm_head_class"] == "EchoLinearLayer"
    assert r["lm_head_counts"] == (2 * LAYERS, 2 * LAYERS + 1)


def test_without_echo_section_is_plain_deepspeed(training):
    r = training[0]
    assert r["no_echo_runtime"]
    assert r["no_echo_classes"] == ["LinearAllreduce", "LinearLayer"]


def test_deepcompile_autotp_refused(training):
    msg = training[0]["deepcompile_error"]
    assert msg is not None and "autotp" in msg and "passes" in msg


def test_inference_forward_only(inference):
    r = inference[0]
    assert r["deepspeed_rejects_echo_key"]
    assert r["classes"] == ["EchoLinearAllreduce", "LinearLayer", "LmHeadLinearAllreduce"]
    assert r["backend"] == "reference"  # "auto" on CPU: p2p needs CUDA
    for bits in (8, 4):
        assert r[f"counts_{bits}"] == (3 * 2 * LAYERS, 0, 3)
        assert r[f"repeatable_{bits}"] and r[f"short_finite_{bits}"]
    # Relative logit error: 8-bit well under 4-bit, both small for a random 2-layer model.
    assert 0 < r["rel_error_8"] < 0.01 < r["rel_error_4"] < 0.2, r
    assert inference[0]["rel_error_4"] == inference[1]["rel_error_4"]


def test_inference_lm_head_compressed_when_asked(inference):
    r = inference[0]
    assert r["head_class"] == "EchoLmHeadLinearAllreduce"
    assert r["head_counts"] == (2 * LAYERS + 1, 0)
    assert 0 < r["head_rel_error"] < 0.01
