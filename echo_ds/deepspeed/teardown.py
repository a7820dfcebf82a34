"""An orderly end of a DeepSpeed run: every process group and its C++ threads gone before the interpreter's
own teardown.

Why (issue 35; docs/errors.md, "teardown abort"): ``torch.distributed.destroy_process_group()`` forgets the
process groups, but a gloo group's C++ object, with its worker threads (``pt_gloo_runloop``), its
transport loops (``gloo_tcp_loop``) and, through its store, the TCP store's server thread on rank 0
(``pt_tcpstore_uv``), lives on as long as anything in Python still references it, and DeepSpeed's module
globals do (``deepspeed.utils.groups._TENSOR_MODEL_PARALLEL_GROUP``, ``_DATA_PARALLEL_GROUP``, ...). Those
threads are then stopped, if at all, in the middle of the interpreter's finalization; a C++ thread that
must take the GIL there is ended by the interpreter (``pthread_exit``), and its unwinding through a
``noexcept`` frame calls ``std::terminate``: "terminate called without an active exception", exit -6,
after every result was printed.

:func:`shutdown` ends them while the interpreter still runs: Echo's runtimes are closed, every rank
passes a barrier (no collective is in flight), the name of DeepSpeed's CPU shared-memory workspace is
removed (DeepSpeed leaves it in /dev/shm), the process groups are destroyed, DeepSpeed's module-level
references to them are dropped, and the garbage collector runs, so that each group's destructor joins
its threads now. It returns the names of the C++ communication threads still alive afterwards (none
expected) and warns once naming them.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import List

import torch.distributed as dist

from echo_ds.log import log_once

# Thread names (Linux, /proc/self/task/*/comm) of the C++ threads of torch's gloo groups and TCP store.
COMM_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv", "pt_tcpstore")


def comm_threads() -> List[str]:
    """Names of this process's live C++ communication threads (torch's gloo and TCP store threads); []
    where /proc is not readable."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if name.startswith(COMM_THREADS):
            names.append(name)
    return sorted(names)


def _drop_deepspeed_group_references() -> int:
    """Set DeepSpeed's module-level process groups (and the device mesh built from them) to None and empty
    its dicts of groups; returns how many references were dropped. DeepSpeed re-creates them if it is
    initialised again."""
    from torch._C._distributed_c10d import ProcessGroup

    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # older torch
        DeviceMesh = ()
    dropped = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "deepspeed" or name.startswith("deepspeed.")):
            continue
        for key, value in list(vars(module).items()):
            if isinstance(value, ProcessGroup) or (DeviceMesh and isinstance(value, DeviceMesh)):
                setattr(module, key, None)
                dropped += 1
            elif isinstance(value, dict) and any(isinstance(v, ProcessGroup) for v in value.values()):
                value.clear()
                dropped += 1
    return dropped


def deepspeed_shm_workspace(rank, addr=None, port=None) -> str:
    """The path of the shared-memory all-reduce workspace that DeepSpeed's CPU accelerator creates for
    ``rank`` when every rank is local (its ops/csrc/cpu/comm/shm.cpp: SHM_BUFFER_NAME, the user id,
    MASTER_ADDR, MASTER_PORT and the rank; addr and port default to this process's MASTER_ADDR and
    MASTER_PORT). DeepSpeed never unlinks it: 66 MiB of RAM per rank stays in /dev/shm after the run, and
    one more set per distinct port."""
    addr = os.environ.get("MASTER_ADDR", "") if addr is None else addr
    port = os.environ.get("MASTER_PORT", "") if port is None else port
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def release_deepspeed_shm_workspace(rank: int) -> bool:
    """Remove ``rank``'s name of DeepSpeed's CPU workspace; True if there was one. Every peer mapped it when
    DeepSpeed initialised (its initialisation returns only then), so the mappings live on until the
    processes exit; call it after a barrier that follows ``deepspeed.init_distributed``."""
    try:
        os.unlink(deepspeed_shm_workspace(rank))
    except FileNotFoundError:  # not a CPU run, not all ranks local, or already removed
        return False
    return True


def shutdown(*runtimes) -> List[str]:
    """End the run's communication in order (see the module docstring); call it after the last collective,
    on every rank, once the engine is no longer referenced (e.g. after ``main()`` returned).

    runtimes: EchoRuntime objects still referenced (their p2p buffers are closed and their groups dropped).
    Returns the names of communication threads still alive afterwards ([] when all were joined).
    """
    for rt in runtimes:
        if rt is not None:
            rt.close()
    if dist.is_initialized():
        dist.barrier()  # no collective of any group is in flight on any rank past this point
        release_deepspeed_shm_workspace(dist.get_rank())
        dist.destroy_process_group()
    elif os.environ.get("RANK", "").isdigit():  # the group was destroyed already: the launcher's rank
        release_deepspeed_shm_workspace(int(os.environ["RANK"]))
    _drop_deepspeed_group_references()
    gc.collect()  # each group's destructor: its work queue drained, its threads joined, its store closed
    left = comm_threads()
    if left:
        log_once("warning",
                 f"echo_ds.deepspeed.teardown.shutdown: communication threads still alive after the teardown "
                 f"({', '.join(left)}): something outside DeepSpeed still references a process group; the "
                 f"interpreter's exit may abort in them (docs/errors.md)", rank=0)
    return left
