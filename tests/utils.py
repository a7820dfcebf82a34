"""The one spawn harness of the test suite: P gloo ranks on free ports.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes with the "spawn" context,
initialises a gloo process group in each and calls ``fn(rank, world_size, *args)``. What each rank
returns is collected (it must pickle). A rank that raises fails the test with its traceback; a rank that
hangs past ``timeout`` seconds fails it too, instead of hanging the suite. Every rank must exit 0.

``run_with_dying_rank(fn, world_size, *args)`` is the same for tests in which rank P - 1 kills itself
mid-call: the survivors report and exit without touching the group again, and the dead rank's exit code
is checked instead.

Test modules import their helpers by bare name (``from utils import ...``, ``import p2p_suite``): tests/
has no ``__init__.py``, so pytest's default import mode (prepend) puts tests/ first on ``sys.path``,
whether it runs as ``python -m pytest`` or ``pytest`` and from whichever directory. Spawned ranks inherit
that ``sys.path``, so they unpickle functions of these modules by the same names.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import traceback

kDefaultTimeout = 120.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, clean_exit):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
        result = fn(rank, world_size, *args)
        if clean_exit:
            dist.barrier()
            dist.destroy_process_group()
        # Plain pickle, not torch's shared-memory reducers: a rank may exit before the parent reads.
        queue.put((rank, "ok", pickle.dumps(result)))
        status = 0
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
        status = 1
    queue.close()
    queue.join_thread()  # flush the report before the hard exit
    if status or not clean_exit:
        os._exit(status)  # without clean_exit a peer is dead: no barrier, no destroy


def _run(fn, world_size, args, timeout, num_reports, clean_exit):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, clean_exit), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(num_reports):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    except queue_mod.Empty:
        errors.append(f"timed out after {timeout:.0f}s waiting for ranks; done: {sorted(results)}")
    except (EOFError, OSError) as e:
        errors.append(f"lost contact with the ranks ({type(e).__name__}: {e}); done: {sorted(results)}")
    finally:
        for p in procs:
            p.join(timeout=30 if not errors else 0.5)  # DeepSpeed + transformers ranks tear down slowly under load
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    if errors:
        raise AssertionError("\n".join(errors))
    return procs, results


def deepspeed_env(rank: int, world_size: int, shm_port: int) -> bool:
    """DeepSpeed's comm layer on top of the harness's gloo group, as its launcher would set it up, AutoTP
    in training mode. Returns whether DeepSpeed's CPU shared-memory workspace was there to release.

    With every rank local (LOCAL_SIZE == WORLD_SIZE) DeepSpeed's CPU accelerator maps a 66 MiB all-reduce
    workspace per rank under /dev/shm, named after the port, and never unlinks it. Each test run has a port
    of its own, so without the release a suite leaves gigabytes of RAM behind in /dev/shm: once, a day of
    runs filled 21 of 24 GiB and the next suite stalled in the kernel's reclaim. After a barrier every
    rank has mapped every peer's workspace, and each removes its own name
    (echo_ds.deepspeed.teardown.release_deepspeed_shm_workspace, which the end of a run also calls).
    """
    import deepspeed
    import torch.distributed as dist
    from deepspeed.module_inject.layers import set_autotp_mode

    from echo_ds.deepspeed.teardown import release_deepspeed_shm_workspace

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(shm_port))
    deepspeed.init_distributed("gloo")
    set_autotp_mode(training=True)
    dist.barrier()
    return release_deepspeed_shm_workspace(rank)


def deepspeed_shm_segments(port: int) -> list:
    """DeepSpeed's CPU all-reduce workspaces under /dev/shm for a run on ``port`` that exist now (any rank,
    any address)."""
    from echo_ds.deepspeed.teardown import deepspeed_shm_workspace

    return sorted(glob.glob(deepspeed_shm_workspace("*", addr="*", port=port)))


def run_distributed(fn, world_size: int, *args, timeout: float = kDefaultTimeout):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results by rank."""
    procs, results = _run(fn, world_size, args, timeout, world_size, clean_exit=True)
    bad = [p.exitcode for p in procs if p.exitcode not in (0, None)]
    if bad:
        raise AssertionError(f"ranks exited with codes {bad}")
    return [results[r] for r in range(world_size)]


def run_with_dying_rank(fn, world_size: int, *args, timeout: float = kDefaultTimeout, dead_exit_code: int = 17):
    """Results of the surviving ranks 0 .. P-2; rank P - 1 must exit with ``dead_exit_code``."""
    procs, results = _run(fn, world_size, args, timeout, world_size - 1, clean_exit=False)
    code = procs[-1].exitcode
    if code != dead_exit_code:
        raise AssertionError(f"rank {world_size - 1} exited with {code}, expected {dead_exit_code}")
    return [results[r] for r in range(world_size - 1)]


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ is no package); registered in sys.modules, where
    dataclasses look their module up."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class RecordingLog:
    """Stands in for the echo_ds logger (echo_ds.log.logger): records (level, message)."""

    def __init__(self):
        self.records = []

    def __getattr__(self, level):
        return lambda msg: self.records.append((level, msg))


def state_tensors(comp) -> dict:
    """A copy of every tensor of ``comp``'s stored state, by name (Compensator.state_names: whichever
    format the config chose), None where it holds none yet."""
    return {name: None if getattr(comp, name) is None else getattr(comp, name).clone() for name in comp.state_names}


def same_states(a, b) -> bool:
    """``a`` and ``b`` (Compensators, or :func:`state_tensors` of them) hold the same stored state: the same
    tensor names, each equal bit for bit."""
    import torch

    a, b = (s if isinstance(s, dict) else state_tensors(s) for s in (a, b))
    same = (lambda x, y: x is None and y is None or x is not None and y is not None and torch.equal(x, y))
    return a.keys() == b.keys() and all(same(a[name], b[name]) for name in a)


def state_moved(comp) -> bool:
    """Some decoded value of ``comp``'s state (m1 or m2) is not zero: a comparison of states is not of zeros."""
    return any(bool(v.abs().sum() > 0) for v in comp.values())
