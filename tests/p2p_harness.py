"""A spawn runner for the p2p tests in which one rank is meant to die.

tests/utils.run_distributed requires every rank to exit 0 and ends with a barrier; here rank P - 1
kills itself in the middle of a call, so the survivors report and exit without touching the group
again, and the runner checks the dead rank's exit code instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import traceback

from tests.utils import free_port


def _worker(rank, world_size, port, fn, args, q):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        q.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001
        q.put((rank, "error", traceback.format_exc()))
    q.close()
    q.join_thread()
    os._exit(0)  # no barrier, no destroy: a peer is dead


def run_with_dying_rank(fn, world_size: int, *args, timeout: float = 120.0, dead_exit_code: int = 17):
    """Results of the surviving ranks 0 .. P-2; rank P - 1 must exit with ``dead_exit_code``."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, q), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size - 1):
            rank, status, payload = q.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
    except queue_mod.Empty:
        errors.append(f"timed out after {timeout:.0f}s; survivors done: {sorted(results)}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    if errors:
        raise AssertionError("\n".join(errors))
    code = procs[-1].exitcode
    if code != dead_exit_code:
        raise AssertionError(f"rank {world_size - 1} exited with {code}, expected {dead_exit_code}")
    return [results[r] for r in range(world_size - 1)]
