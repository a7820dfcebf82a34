"""The "p2p" backend: Echo's all-reduce over peer-to-peer writes between the GPUs of one host.

:class:`EchoBuffer` owns a tensor-parallel group's resources (workspace, IPC mappings, flags, streams) and
routes each call: :mod:`echo_ds.p2p.call` is the one-launch call (one kernel per call, plans built once in the
extension's runtime), :mod:`echo_ds.p2p.stages` the staged pipeline of section 4.2 (ranks sharing a GPU, above
16 MiB); :mod:`echo_ds.p2p.policy` decides, as pure functions, whether a group and a call can use them;
:mod:`echo_ds.p2p.protocol` is the flag protocol (values, release rule, timeout messages). The reference path (echo_ds.reference) defines the
numbers, and this backend reproduces them bit for bit. Design notes: docs/p2p.md.
"""

from echo_ds.p2p.policy import (Decision, GroupFacts, call_decision, group_decision,
                                p2p_transport_status)
from echo_ds.p2p.protocol import EchoP2PError, EchoP2PMismatch, EchoP2PTimeout

__all__ = ["EchoBuffer", "EchoP2PError", "EchoP2PMismatch", "EchoP2PTimeout", "Decision", "GroupFacts", "call_decision",
           "group_decision", "p2p_transport_status"]


def __getattr__(name):
    # The buffer pulls in torch.distributed and the driver bindings: import it on first use.
    if name == "EchoBuffer":
        from echo_ds.p2p.buffer import EchoBuffer

        return EchoBuffer
    raise AttributeError(name)
