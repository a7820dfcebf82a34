"""Entry points: ``initialize`` and ``init_inference`` (DeepSpeed's own shape) and ``enable``.

A user adds an ``"echo"`` section to ds_config.json and changes one line::

    engine, optimizer, _, scheduler = echo_ds.initialize(model=model, config="ds_config.json", ...)

``enable(engine)`` does the same for an engine built elsewhere. The training loop does not change.

Two environment variables, read once per ``initialize`` / ``init_inference`` / ``enable`` (before the
engine is built) and logged once, override the config without editing it: ``ECHO_DS_DISABLE=1`` leaves every all-reduce to
DeepSpeed (``initialize`` is then ``deepspeed.initialize``), and ``ECHO_DS_BACKEND=reference`` (or
``auto``, ``p2p``) replaces the section's ``"backend"``.
"""

from __future__ import annotations

import copy
import inspect
import os
from typing import Any, Dict, Optional, Tuple

import deepspeed
import torch
from deepspeed.module_inject.layers import is_autotp_training_mode

from . import layers as echo_layers
from . import policy
from ..config import read_ds_config
from ..log import log_once
from .runtime import EchoRuntime

_RUNTIME_ATTR = "_echo_runtime"


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` with the model's tensor-parallel all-reduces through Echo.

    Same arguments and the same return value ``(engine, optimizer, training_dataloader, lr_scheduler)``.
    Echo is configured by the ``"echo"`` section of the DeepSpeed config (which ``deepspeed.initialize``
    ignores); without that section, or with ``"enabled": false``, this is ``deepspeed.initialize``.
    The runtime is reachable as ``echo_ds.deepspeed.get_runtime(engine)``.
    """
    switches = policy.environment_switches(os.environ)  # read once; a bad value fails before the engine is built
    result = deepspeed.initialize(*args, **kwargs)
    _enable(result[0], None, switches)
    return result


initialize.__signature__ = inspect.signature(deepspeed.initialize)


def init_inference(model: torch.nn.Module, config=None, **kwargs):
    """``deepspeed.init_inference`` with the row-parallel all-reduces through Echo (forward sites only).

    ``config`` is a dict or a path as for DeepSpeed (read as DeepSpeed reads it: hjson, comments allowed);
    its ``"echo"`` section (or an ``echo=`` keyword) is taken out before DeepSpeed's strict inference config
    sees it. Returns the ``InferenceEngine``.
    """
    if config is None:
        config_dict: Dict[str, Any] = {}
    elif isinstance(config, (str, os.PathLike)):
        config_dict = dict(read_ds_config(config))  # as DeepSpeed reads it: hjson, the file named in errors
    elif isinstance(config, dict):
        config_dict = dict(config)
    else:
        raise ValueError(f"echo_ds.init_inference: 'config' must be a dict or a path to a JSON file, "
                         f"got {type(config).__name__}")
    switches = policy.environment_switches(os.environ)  # read once; a bad value fails before the engine is built
    echo_section = config_dict.pop("echo", None)
    if "echo" in kwargs:
        kw_section = kwargs.pop("echo")
        if echo_section is not None and kw_section != echo_section:
            raise ValueError("echo_ds.init_inference: an 'echo' section was given both in 'config' and as a "
                             "keyword argument, with different values: keep one of them")
        echo_section = kw_section
    engine = deepspeed.init_inference(model, config=config_dict, **kwargs)
    if echo_section is not None:
        _enable(engine, {"echo": echo_section}, switches)
    else:
        log_once("info", "echo: the inference config has no \"echo\" section; DeepSpeed's all-reduces are used")
    return engine


def _engine_parts(engine) -> Tuple[torch.nn.Module, Optional[dict], object, Any, int]:
    """(root module, ds_config dict or None, monitor, step function, log interval) of an engine."""
    from deepspeed.inference.engine import InferenceEngine
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if isinstance(engine, PipelineEngine):
        raise NotImplementedError("echo: pipeline-parallel engines are not supported; use AutoTP without "
                                  "pipeline parallelism (a plain DeepSpeedEngine)")
    if isinstance(engine, DeepSpeedEngine):
        if engine.is_deepcompile_enabled() and engine.compile_autotp():
            raise ValueError(echo_layers.kDeepCompileMessage)
        param_dict = getattr(getattr(engine, "_config", None), "_param_dict", None)
        interval = engine.steps_per_print() or 0
        return engine.module, param_dict, engine.monitor, (lambda: engine.global_steps), interval
    if isinstance(engine, InferenceEngine):
        return engine.module, None, None, None, 0
    if isinstance(engine, torch.nn.Module):
        return engine, None, None, None, 0
    raise TypeError(f"echo_ds.enable expects a DeepSpeedEngine, an InferenceEngine or an nn.Module, "
                    f"got {type(engine).__name__}")


def _resolve_config(config, ds_dict: Optional[dict]):
    from echo_ds.config import EchoConfig

    if isinstance(config, EchoConfig):
        return config
    if config is None:
        if ds_dict is None or "echo" not in ds_dict:
            return None
        return EchoConfig.from_ds_config(copy.deepcopy(ds_dict))
    if isinstance(config, str):
        return EchoConfig.from_ds_config(config)
    if isinstance(config, dict):
        if "echo" in config:
            return EchoConfig.from_ds_config(copy.deepcopy(config))
        return EchoConfig(**config)
    raise TypeError(f"echo: config must be an EchoConfig, a ds_config dict or path, or an \"echo\" section "
                    f"dict, got {type(config).__name__}")


def enable(engine, config=None, *, quantize_lm_head: Optional[bool] = None, telemetry: Optional[bool] = None,
           coalesce: bool = True, site_check_interval: int = 1,
           recompute_cache: Optional[bool] = None) -> Optional[EchoRuntime]:
    """Route the tensor-parallel all-reduces of an AutoTP model through Echo.

    engine: a ``DeepSpeedEngine`` (its config's ``"echo"`` section is used when ``config`` is None), an
        ``InferenceEngine`` or a module whose AutoTP layers are already built.
    config: an ``EchoConfig``, a ds_config dict or JSON path with an ``"echo"`` section, or the section.
    quantize_lm_head: also compress the output head's all-reduce (default: the config's
        ``quantize_lm_head`` if it has one, else False).
    telemetry: record the error every compressed call reveals, per site (one extra exact
        all-reduce per call; default: the config's ``telemetry``).
    coalesce: one backward Echo call for column-parallel layers sharing an input (q, k, v; gate, up).
    site_check_interval: compare the site order across ranks every this many forward passes (0: never).
    recompute_cache: keep forward outputs for activation-checkpointing replay: True/False forces it,
        None lets the policy decide (Hugging Face gradient checkpointing and reentrant checkpoints).

    Returns the ``EchoRuntime`` (also ``get_runtime(engine)``), or None when Echo is not enabled (no
    ``"echo"`` section, ``"enabled": false``, ``ECHO_DS_DISABLE=1`` in the environment, or no
    tensor-parallel layer in the model). ``ECHO_DS_BACKEND`` overrides the config's ``"backend"``. Both
    variables are read once per call (``initialize`` and ``init_inference`` read them before they build
    the engine), and what they change is logged once.
    """
    return _enable(engine, config, policy.environment_switches(os.environ), quantize_lm_head=quantize_lm_head,
                   telemetry=telemetry, coalesce=coalesce, site_check_interval=site_check_interval,
                   recompute_cache=recompute_cache)


def _enable(engine, config, switches: "policy.EnvironmentSwitches", *, quantize_lm_head: Optional[bool] = None,
            telemetry: Optional[bool] = None, coalesce: bool = True, site_check_interval: int = 1,
            recompute_cache: Optional[bool] = None) -> Optional[EchoRuntime]:
    """``enable`` with the environment switches already read (``initialize`` reads them before it builds
    the engine, so that a bad value fails first)."""
    from echo_ds.config import check_count, check_flag

    for name, value in (("quantize_lm_head", quantize_lm_head), ("telemetry", telemetry),
                        ("recompute_cache", recompute_cache)):
        check_flag("echo_ds.enable", name, value, optional=True)
    check_flag("echo_ds.enable", "coalesce", coalesce)
    check_count("echo_ds.enable", "site_check_interval", site_check_interval)
    if switches.disabled:
        log_once(*policy.environment_message(switches, None))
        return None
    root, ds_dict, monitor, step_fn, log_interval = _engine_parts(engine)
    if get_runtime(root) is not None:
        raise RuntimeError("echo: this model already runs through Echo; call echo_ds.deepspeed.disable(engine) "
                           "before enabling it again")
    cfg = _resolve_config(config, ds_dict)
    if cfg is None or not cfg.enabled:
        log_once("info", "echo: no enabled \"echo\" section in the config; DeepSpeed's all-reduces are used")
        return None
    message = policy.environment_message(switches, cfg.backend)
    if message is not None:
        log_once(*message)
    if switches.backend is not None and switches.backend != cfg.backend:
        cfg = cfg.model_copy(update={"backend": switches.backend})  # a copy: the caller's config stays as given
    if quantize_lm_head is None:
        quantize_lm_head = bool(getattr(cfg, "quantize_lm_head", False))
    if telemetry is None:
        telemetry = cfg.telemetry
    cfg.quant_spec()  # validate bits / group size / quantizer now, with the config's own message

    training = is_autotp_training_mode()
    named = dict(root.named_modules())
    plan = []
    groups = []
    for name, module in named.items():
        if hasattr(type(module), "_echo_original_class"):
            raise RuntimeError(f"echo: {name} is already an Echo layer (patched by another runtime)")
        kind, why = echo_layers.classify(name, module, quantize_lm_head, training)
        if kind is None:
            if why.startswith("unknown forward"):
                log_once("warning", f"echo: {name} ({type(module).__name__}) has a forward Echo does not know, "
                         f"so its all-reduce stays DeepSpeed's (uncompressed)")
            continue
        plan.append((name, module, kind))
        if not any(module.mp_group is g for g in groups):
            groups.append(module.mp_group)
    if not plan:
        log_once("warning", "echo: the \"echo\" section is set but the model has no tensor-parallel layer "
                 "(set \"tensor_parallel\": {\"autotp_size\": N} with N > 1 for training, or tensor_parallel.tp_size "
                 "for inference); nothing to compress")
        return None
    if len(groups) > 1:
        raise NotImplementedError(f"echo: the model's tensor-parallel layers use {len(groups)} different process "
                                  f"groups; Echo keeps one state per group and supports a single group per model")
    device = plan[0][1].weight.device

    runtime = EchoRuntime(cfg, groups[0], device, telemetry=telemetry, coalesce=coalesce,
                          site_check_interval=site_check_interval, recompute_cache=recompute_cache,
                          monitor=monitor, log_interval=log_interval, step_fn=step_fn)
    for name, module, kind in plan:
        ancestors = [named[".".join(name.split(".")[:i])] for i in range(len(name.split(".")))]
        checkpoint_modules = tuple(m for m in ancestors if hasattr(m, "gradient_checkpointing"))
        site = runtime.add_site(name, echo_layers.direction_of(kind), checkpoint_modules=checkpoint_modules)
        echo_layers.patch_layer(module, site)
    runtime._patched = [module for _, module, _ in plan]
    runtime._hooks = [
        root.register_forward_pre_hook(lambda m, args: runtime.begin_forward_pass(m.training)),
        root.register_forward_hook(lambda m, args, out: runtime.end_forward_pass()),
    ]
    setattr(root, _RUNTIME_ATTR, runtime)
    num_fwd = sum(1 for s in runtime.sites if s.direction == "forward")
    log_once("info", f"echo: {num_fwd} forward and {len(runtime.sites) - num_fwd} backward sites through Echo "
             f"({cfg.bits}-bit, group {cfg.group_size}, backend {runtime.backend}, "
             f"tp={runtime.world_size})")
    return runtime


def _root(engine) -> torch.nn.Module:
    from deepspeed.inference.engine import InferenceEngine
    from deepspeed.runtime.engine import DeepSpeedEngine

    return engine.module if isinstance(engine, (DeepSpeedEngine, InferenceEngine)) else engine


def get_runtime(engine) -> Optional[EchoRuntime]:
    """The ``EchoRuntime`` of an engine or module, or None."""
    return _root(engine).__dict__.get(_RUNTIME_ATTR)


def disable(engine) -> None:
    """Restore DeepSpeed's layers and all-reduces (the counters stay readable on the runtime)."""
    root = _root(engine)
    runtime = root.__dict__.get(_RUNTIME_ATTR)
    if runtime is None:
        return
    for handle in runtime._hooks:
        handle.remove()
    for module in runtime._patched:
        echo_layers.unpatch_layer(module)
    for site in runtime.sites:
        site.cache.clear()
    if runtime.buffer is not None:
        runtime.buffer.close()  # collective: every rank disables together
        runtime.buffer = None
    delattr(root, _RUNTIME_ATTR)
