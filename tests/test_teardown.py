"""The orderly end of a run (issue 35, item 2; docs/errors.md "teardown abort"): after
``echo_ds.deepspeed.teardown.shutdown()`` no C++ thread of torch's gloo groups or TCP store is left for the
interpreter's own teardown to stop.

Two plain processes initialised as the ``deepspeed`` launcher does (``env://``: MASTER_ADDR, RANK, ...; not
the spawn harness, whose ``tcp://`` rendezvous keeps the default group referenced), each holding a
tensor-parallel group in DeepSpeed's module globals as AutoTP does, and an Echo model on it. The test
shows the cause (``destroy_process_group()`` leaves the group's threads running while DeepSpeed references
it) and the cure (none left after ``shutdown()``), and that both processes exit 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from utils import deepspeed_shm_segments, free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RANK_SCRIPT = r"""
import gc, json, os
import torch
import torch.distributed as dist
import deepspeed
import deepspeed.utils.groups as ds_groups
from deepspeed.module_inject.layers import LinearAllreduce, set_autotp_mode

import echo_ds.deepspeed as echo
from echo_ds.config import EchoConfig
from echo_ds.deepspeed.teardown import comm_threads, deepspeed_shm_workspace, shutdown

torch.set_num_threads(1)
deepspeed.init_distributed("gloo")
set_autotp_mode(training=True)
tp = dist.new_group([0, 1])
ds_groups._TENSOR_MODEL_PARALLEL_GROUP = tp  # where DeepSpeed's AutoTP keeps its group
torch.manual_seed(0)
net = torch.nn.Sequential(LinearAllreduce(torch.nn.Linear(32, 16, bias=False), mp_group=tp, name="o"))
echo.enable(net, EchoConfig(bits=4, backend="reference"))
with torch.no_grad():
    y = net(torch.randn(4, 16))
del net, tp
result = {"before": comm_threads(), "shm_before": os.path.exists(deepspeed_shm_workspace(dist.get_rank()))}
dist.barrier()
dist.destroy_process_group()
gc.collect()
result["after_destroy"] = comm_threads()
result["after_shutdown"] = shutdown()
print("RESULT " + json.dumps(result), flush=True)
"""


def test_shutdown_ends_every_group_thread_while_python_runs():
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_SIZE="2", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], env=env, cwd=REPO, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out[-3000:]}"
        line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert line, out[-3000:]
        r = json.loads(line[-1][len("RESULT "):])
        assert r["before"].count("pt_gloo_runloop") >= 4, r  # the default group and the TP group
        # the cause: the TP group, referenced by DeepSpeed's module globals, outlives destroy_process_group
        assert "pt_gloo_runloop" in r["after_destroy"], r
        assert r["after_shutdown"] == [], r  # the cure: nothing left for the interpreter's teardown
        assert r["shm_before"], r  # DeepSpeed's CPU all-reduce workspace, named as shutdown() expects
    assert deepspeed_shm_segments(port) == []  # and shutdown() removed every rank's name of it
