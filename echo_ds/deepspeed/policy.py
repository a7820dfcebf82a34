"""Decisions of the DeepSpeed integration, as pure functions of sizes, flags and capabilities.

Nothing here touches a process group or a device: every function can be tested on its own, and the
runtime (``runtime.py``) only carries out what these functions decide. When a prerequisite is missing
the decision says so in words that name the setting to change; the runtime logs that once and falls
back to the reference path instead of stopping a run that could go on (vLLM's custom all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

from echo_ds.config import BACKENDS
from echo_ds.quant import SUPPORTED_BITS


@dataclass(frozen=True)
class BackendChoice:
    """The backend a runtime uses and why.

    name: "reference" or "p2p".
    reason: one sentence for the log.
    level: "warning" when the user asked for something they do not get (logged once), "info" when
        "auto" chose (logged once), "debug" when the user got what they asked for.
    """

    name: str
    reason: str
    level: str


# The environment switches, for operators who suspect Echo and want it out of the way without editing the
# config (as other libraries offer for their custom all-reduce). Read once per engine, by ``enable``.
DISABLE_VAR = "ECHO_DS_DISABLE"  # 1: Echo off, DeepSpeed's own all-reduces
BACKEND_VAR = "ECHO_DS_BACKEND"  # one of BACKENDS: overrides "backend" of the "echo" section
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class EnvironmentSwitches:
    """What the environment asks of Echo.

    disabled: ``ECHO_DS_DISABLE`` is set to 1 (or true/yes/on): Echo stays off whatever the config says.
    backend: ``ECHO_DS_BACKEND``, one of ``BACKENDS``, or None where it is unset or empty (the config's).
    """

    disabled: bool = False
    backend: Optional[str] = None


def environment_switches(environ: Mapping[str, str]) -> EnvironmentSwitches:
    """Read ``ECHO_DS_DISABLE`` and ``ECHO_DS_BACKEND`` from ``environ`` (pure: pass ``os.environ``).

    A value that is neither on nor off, or a backend that does not exist, raises ValueError naming the
    variable, the value and what is allowed: a typo must not leave Echo running when the operator meant
    to turn it off.
    """
    raw = environ.get(DISABLE_VAR, "")
    value = raw.strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"{DISABLE_VAR}={raw!r}: must be 1 (Echo off: DeepSpeed's own all-reduces) or 0 / unset "
                         f"(Echo as configured); also accepted: {', '.join(v for v in _TRUE + _FALSE if v)}")
    raw_backend = environ.get(BACKEND_VAR, "")
    backend = raw_backend.strip().lower() or None
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"{BACKEND_VAR}={raw_backend!r}: must be one of {', '.join(BACKENDS)} (it overrides "
                         f'"backend" of the "echo" section), or unset')
    return EnvironmentSwitches(disabled=value in _TRUE, backend=backend)


def environment_message(switches: EnvironmentSwitches, configured_backend: Optional[str]) -> Optional[Tuple[str, str]]:
    """(level, message) to log once about what the environment changed, or None where it changed nothing.

    configured_backend: the config's ``"backend"`` (None when there is no enabled "echo" section).
    """
    if switches.disabled:
        return ("warning", f"echo: {DISABLE_VAR}=1 in the environment: Echo is off and DeepSpeed's own "
                           f"all-reduces are used, whatever the \"echo\" section says (unset {DISABLE_VAR} to "
                           f"turn Echo back on)")
    if switches.backend is None or configured_backend is None:
        return None
    if switches.backend == configured_backend:
        return ("info", f'echo: {BACKEND_VAR}={switches.backend} in the environment, as the config has it')
    return ("warning", f'echo: {BACKEND_VAR}={switches.backend} in the environment overrides "backend": '
                       f'"{configured_backend}" of the "echo" section (unset {BACKEND_VAR} to use the config\'s)')


def p2p_transport_status(device_type: str, world_size: int, kernels_error: Optional[str] = None,
                         *, same_host: bool = True, peer_access: bool = True,
                         state_dtypes: Optional[Mapping[str, str]] = None,
                         group_size: Optional[int] = None) -> Tuple[bool, str]:
    """Whether the CUDA peer-to-peer transport can serve a group, and if not, why.

    kernels_error: why the CUDA kernels cannot be built here (``echo_ds.ops.unavailable_reason()``), or
    None where they can. same_host / peer_access are what is known before the handshake; the transport's
    own constructor checks both again across the group (host ids, a write-and-verify probe) and falls
    back with one warning where they fail. state_dtypes: ``{direction: echo.<direction>.state_dtype}`` of
    the directions that compensate; the kernels hold only ``SUPPORTED_STATE_DTYPES``. group_size: the "echo"
    section's (None: not checked); the kernels are built for ``SUPPORTED_GROUP_SIZES``, and the calls of any other
    take the reference path.
    """
    from echo_ds.p2p.policy import p2p_transport_status as group_status
    from echo_ds.p2p.policy import group_size_decision, state_dtype_decision

    available, why_not = group_status(device_type, world_size, same_host=same_host, peer_access=peer_access,
                                      kernels_built=kernels_error is None, kernels_error=kernels_error or "")
    if available:
        d = state_dtype_decision(state_dtypes or {})
        if d and group_size is not None:
            d = group_size_decision(group_size)
        available, why_not = d.use, d.reason
    return available, why_not


def select_backend(requested: str, device_type: str, world_size: int,
                   p2p_status: Optional[Tuple[bool, str]] = None) -> BackendChoice:
    """Resolve ``echo.backend`` to the backend that will run.

    requested: the config value, one of ``BACKENDS``.
    p2p_status: ``(available, why_not)``; defaults to ``p2p_transport_status(device_type, world_size)``
        (kernels assumed buildable: the runtime passes what ``echo_ds.ops`` reports).
    """
    if requested not in BACKENDS:
        raise ValueError(f'echo.backend={requested!r} is not one of {BACKENDS}: set "backend" in the "echo" '
                         f'section of ds_config.json to "reference" (torch.distributed, gloo or NCCL), '
                         f'"p2p" (CUDA transport) or "auto"')
    available, why_not = p2p_status if p2p_status is not None else p2p_transport_status(device_type, world_size)
    if requested == "reference":
        return BackendChoice("reference", 'echo.backend="reference" as configured', "debug")
    if requested == "p2p":
        if available:
            return BackendChoice("p2p", 'echo.backend="p2p" as configured', "debug")
        return BackendChoice(
            "reference", f'echo.backend="p2p" is unavailable ({why_not}); falling back to the reference '
            f'backend. Set "backend": "reference" (or "auto") in the "echo" section of ds_config.json to '
            f'silence this warning.', "warning")
    if available:
        return BackendChoice("p2p", 'echo.backend="auto" chose "p2p": the CUDA transport is available for '
                             f'this {world_size}-rank group', "info")
    return BackendChoice("reference", f'echo.backend="auto" chose "reference": {why_not}', "info")


def use_compressed(numel: int, element_size: int, bits: int, min_message_bytes: int) -> bool:
    """Whether a message of ``numel`` elements of ``element_size`` bytes goes through Echo at ``bits``.

    Messages smaller than ``min_message_bytes`` (in their own dtype) take the uncompressed all-reduce: for
    them the latency of the extra quantization steps costs more than the bytes saved. A bit width the
    quantizer does not support is uncompressed too (the config admits none today).
    """
    if bits not in SUPPORTED_BITS:
        return False
    return numel * element_size >= min_message_bytes


def cache_for_recompute(training: bool, in_graph: bool, checkpointed: bool, override: Optional[bool]) -> bool:
    """Whether a forward site keeps a copy of its output for an activation-checkpointing recompute.

    A recomputed forward must reproduce the original values without touching the forward compensator
    state (which by then belongs to the next pass, or was reset), so a site that may be recomputed keeps
    its output and replays it. It may be recomputed when the pass is a training pass and either the site
    lies in a module flagged for checkpointing (Hugging Face ``gradient_checkpointing``) or its message
    is outside the autograd graph (``in_graph`` False: the original forward of a reentrant checkpoint,
    DeepSpeed's included, runs under ``torch.no_grad``).

    override: True or False forces the answer (``enable(..., recompute_cache=...)``); None decides.
    """
    if override is not None:
        return bool(override) and training
    return training and (checkpointed or not in_graph)


def is_lm_head_name(name: Optional[str]) -> bool:
    """Whether a layer name denotes the output head (left uncompressed unless asked otherwise)."""
    if not name:
        return False
    last = name.split(".")[-1]
    return last in ("lm_head", "embed_out", "output_layer")
