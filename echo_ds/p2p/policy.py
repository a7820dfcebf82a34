"""Whether the p2p fast path serves a group, and a call: pure functions, testable without a GPU.

The mechanism (echo_ds.p2p.buffer.EchoBuffer) gathers the facts (world size, hosts, peer access, the
probe, whether the kernels built) and these functions decide; when the answer is no, the reason names
the setting to change and the caller logs it once and uses the reference path (vLLM's custom
all-reduce keeps its ``should_custom_ar`` apart from the kernels in the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from echo_ds.ops.kernels import KERNEL_WORLD_SIZES, SUPPORTED_DTYPES, SUPPORTED_GROUP_SIZES, SUPPORTED_STATE_DTYPES
from echo_ds.p2p.layout import Capacity, make_tiling

_FIX_BACKEND = 'set "backend": "reference" in the "echo" section of ds_config.json to use the reference path'


@dataclass(frozen=True)
class Decision:
    """use: whether the fast path runs; reason: one sentence for the log (empty when it runs)."""

    use: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.use


YES = Decision(True)


@dataclass(frozen=True)
class GroupFacts:
    """What the constructor learnt about a tensor-parallel group.

    device_type: of this rank's tensors ("cuda" for the fast path).
    world_size: ranks in the group.
    same_host: every rank runs on this host (one boot id).
    peer_access: every pair of distinct devices in the group can access each other (the driver's answer).
    kernels_built: echo_ds.ops, which holds the transport's kernels, loaded (``kernels_error`` says why not).
    probe_ok: the write-and-verify probe saw every peer's words and flags (None: not run yet).
    """

    device_type: str
    world_size: int
    same_host: bool
    peer_access: bool
    kernels_built: bool
    kernels_error: str = ""
    probe_ok: Optional[bool] = None
    probe_error: str = ""


def group_decision(f: GroupFacts) -> Decision:
    """Whether a group can use the p2p transport at all (decided once, in the constructor)."""
    if f.device_type != "cuda":
        return Decision(False, f"the p2p transport needs CUDA tensors and this group is on {f.device_type!r}; "
                               f"{_FIX_BACKEND}")
    if f.world_size == 1:
        return Decision(False, "the group has one rank: there is nothing to reduce")
    if f.world_size not in KERNEL_WORLD_SIZES:
        return Decision(False, f"the p2p transport supports tensor-parallel sizes {KERNEL_WORLD_SIZES}, and "
                               f"this group has {f.world_size} ranks (set the tensor-parallel size, "
                               f"\"autotp_size\", to one of them, or {_FIX_BACKEND})")
    if not f.same_host:
        return Decision(False, "the group spans several hosts and the p2p transport needs every rank on one host "
                               f"(NVLink/PCIe peer access); a group across hosts uses the reference path over "
                               f"NCCL: {_FIX_BACKEND}")
    if not f.peer_access:
        return Decision(False, "the driver reports no peer access between some GPUs of the group (check "
                               "`nvidia-smi topo -m` and CUDA_VISIBLE_DEVICES); " + _FIX_BACKEND)
    if not f.kernels_built:
        return Decision(False, f"the p2p transport's kernels, in the extension echo_ds.ops, are not available "
                               f"({f.kernels_error or 'not built'}); install the CUDA toolkit's nvcc for its JIT "
                               f"build, or install echo_ds with DS_BUILD_ECHO=1, or {_FIX_BACKEND}")
    if f.probe_ok is False:
        return Decision(False, f"the write-and-verify probe of peer memory failed ({f.probe_error}), although "
                               f"the driver reports peer access; {_FIX_BACKEND}")
    return YES


def state_dtype_decision(state_dtypes: Mapping[str, str]) -> Decision:
    """Whether the kernels hold the compensator states of ``state_dtypes`` ({direction: state_dtype} of
    the compensating directions; "<direction>" where the caller does not know it)."""
    narrow = {d: s for d, s in state_dtypes.items() if s not in SUPPORTED_STATE_DTYPES}
    if not narrow:
        return YES
    shown = ", ".join(f'echo.{d}.state_dtype="{s}"' for d, s in narrow.items())
    return Decision(False, f"the p2p kernels hold the compensator state as {'/'.join(SUPPORTED_STATE_DTYPES)} only "
                           f"and this config has {shown}, which runs on the reference path (set \"state_dtype\": "
                           f"\"bf16\" in that direction's section of \"echo\" to use the p2p transport)")


def group_size_decision(group_size: int) -> Decision:
    """Whether the kernels run calls of ``group_size`` (the "echo" section's): the others take the reference path,
    every one of them, so a group configured so gains nothing from the p2p transport."""
    if group_size in SUPPORTED_GROUP_SIZES:
        return YES
    return Decision(False, f"the p2p kernels are built for group sizes {SUPPORTED_GROUP_SIZES} and this config has "
                           f"echo.group_size={group_size}, whose calls run on the reference path (set \"group_size\" "
                           f"in the \"echo\" section to one of them to use the p2p transport)")


def call_decision(*, dtype: torch.dtype, numel: int, element_size: int, world_size: int, bits: int,
                  group_size: int, capacity: Capacity, min_message_bytes: int = 0, telemetry: bool = False,
                  device_matches: bool = True, chunked: bool = False, state_dtype: str = "bf16",
                  staged_unsupported: str = "") -> Decision:
    """Whether one call goes through the p2p transport, given that its group can use it.

    min_message_bytes: the ``"min_message_bytes"`` setting; smaller messages are the caller's business
        (it sends them uncompressed), so here they only decline the fast path.
    chunked: the one-launch call serves the call; a message larger than its workspace runs chunk by chunk
        (one launch each, from one binding call), so a message of any size fits (the staged pipeline needs
        the whole message to fit).
    state_dtype: the compensator's ``state_dtype`` ("bf16" without one).
    staged_unsupported: why the staged pipeline's stages cannot run the call (echo_ds.ops.kernels.
        unsupported_reason; empty: they can). Where the one-launch call does not serve it either, the call
        takes the reference path.
    """
    if not device_matches:
        return Decision(False, "the tensor is not on this EchoBuffer's CUDA device (create one EchoBuffer per "
                               "device and pass tensors of that device)")
    if dtype not in SUPPORTED_DTYPES:
        return Decision(False, f"dtype {dtype} is not one of {SUPPORTED_DTYPES}")
    if state_dtype not in SUPPORTED_STATE_DTYPES:
        return state_dtype_decision({"<direction>": state_dtype})
    if telemetry:
        return Decision(False, 'the compensator records telemetry, which needs an exact all-reduce beside the '
                               'compressed one; set "telemetry": false in the "echo" section to use the p2p '
                               'transport')
    if numel * element_size < min_message_bytes:
        return Decision(False, f"{numel * element_size} bytes is below \"min_message_bytes\" = {min_message_bytes}")
    if numel == 0:
        return Decision(False, "an empty tensor")
    if not chunked and staged_unsupported:
        return Decision(False, f"the kernels do not run this call ({staged_unsupported}), so it takes the reference "
                               f"path (echo_ds.ops.kernels.SUPPORTED_GROUP_SIZES lists the group sizes of the p2p "
                               f"transport)")
    tiling = make_tiling(numel, world_size, bits, group_size, 0, capacity)
    if not chunked and not tiling.fits():
        return Decision(False, f"a message of {numel} elements needs {2 * tiling.code_bytes_needed} code bytes and "
                               f"{2 * tiling.param_bytes_needed} parameter bytes of workspace, and this EchoBuffer "
                               f"has {capacity.code_bytes} and {capacity.param_bytes} (raise "
                               f"EchoBuffer(max_numel=...), now {capacity.max_numel})")
    return YES


# Largest message of the one-launch call under stages="auto" where ranks share a GPU (the test rig); larger
# ones take the staged pipeline. Up to 16 MiB the one launch is faster eagerly at P = 2, 4 and 8 (the staged
# pipeline's host time); from 64 MiB the staged kernels, on the whole GPU, are faster eagerly and under graph
# replay (benchmarks/RESULTS.md, "One transport", 2026-12-07 01:22 UTC). Co-residency caps each rank's
# one-launch grid there, and a larger grid did not help (same section).
kSharedGpuOneLaunchMaxBytes = 16 << 20


def one_launch_max_bytes(ranks_per_device: int) -> int:
    """The largest message of the one-launch call under stages="auto" (larger ones: the staged pipeline).

    ranks_per_device: the most ranks of the group on one GPU (the same for every rank of the group, so that
        all take the same path). 1, the deployment (a GPU per rank): every size, chunk by chunk beyond the
        workspace. There each rank's grid is its whole GPU's, and the staged pipeline's host time per call
        alone (measured on the shared GPU, where it does not depend on the grid: RESULTS.md, "One launch per
        call") exceeds NCCL's 16-bit all-reduce of such a message on eight H100s (the issue's figure).
        Not measured on separate GPUs (none was available): a prediction, which the first multi-GPU run of
        benchmarks/bench_p2p.py (--stages fused,kernels) should check.
    """
    return kSharedGpuOneLaunchMaxBytes if ranks_per_device > 1 else 1 << 62


# The one-shot kernel (csrc/p2p_all_reduce.cuh, p2p_one_shot_kernel): 16-bit x at P = 2 and 4 (built for those
# only). Measured with ranks sharing one H100 (benchmarks/RESULTS.md, "One transport", "One-shot against
# two-shot", graph replay): at P = 2 one-shot was slightly faster than two-shot up to 256 KiB (compensated:
# equal) and slower at 1 MiB; at P = 4 slower at every size, where every rank's reduction of all P segments
# runs on the one GPU the ranks share.
ONE_SHOT_WORLD_SIZES = (2, 4)
kOneShotMaxBytes = 256 << 10


def one_shot_max_bytes(world_size: int, ranks_per_device: int = 1) -> int:
    """The largest message (bytes of 16-bit x) that the one-launch call runs one-shot: every rank receives
    every sender's codes and each owner's fp32 term and reduces every segment itself (one exchange), rather
    than two-shot (owners reduce, then gather). 0 where the one-shot kernel is not built.

    ranks_per_device: the most ranks of the group on one GPU (the same on every rank). Where ranks share a GPU
    (the measured rig): 256 KiB at P = 2, none at P = 4. Each rank on a GPU of its own: 256 KiB at P = 2 and 4,
    where the P-fold reduction runs on P GPUs and the exchange saved is a crossing of NVLink: a prediction
    (no multi-GPU machine was available), for the first multi-GPU run of bench_p2p.py --one-shot default,off.
    """
    if world_size not in ONE_SHOT_WORLD_SIZES:
        return 0
    return 0 if ranks_per_device > 1 and world_size > 2 else kOneShotMaxBytes


def p2p_transport_status(device_type: str, world_size: int, *, same_host: bool = True, peer_access: bool = True,
                         kernels_built: bool = True, kernels_error: str = "") -> tuple:
    """``(available, why_not)`` in the shape of echo_ds.deepspeed.policy.p2p_transport_status."""
    d = group_decision(GroupFacts(device_type, world_size, same_host, peer_access, kernels_built, kernels_error))
    return d.use, d.reason
