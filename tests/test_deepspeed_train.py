"""examples/train.py through the ``deepspeed`` launcher: 2 CPU ranks, tensor parallelism 2 (gloo).

The same run three times, 16-bit (no Echo), Echo 8-bit and Echo 4-bit: same seed, same batches, so the
runs differ only by the all-reduces. About 30 s each on 2 cores, most of it imports and start-up.

Tolerances. Over 80 steps at this learning rate the training is chaotic enough that any perturbation
moves the final loss by a few hundredths: across seeds 1337, 1 and 2 the 8-bit runs ended within 0.019
of the 16-bit ones and the 4-bit runs within 0.037, while the 16-bit runs of those seeds spread over
0.15. "Nearly equal" is |8-bit - 16-bit| <= 0.05 (2%), "close" is |4-bit - 16-bit| <= 0.1 (4%). The
counters test checks that Echo ran at every site with the expected bytes; the loss bounds check that its
error did not derail the training.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from echo_ds.quant import wire_bytes
from utils import deepspeed_shm_segments, free_port

pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, EVAL_BATCHES, LAYERS, MICRO_BATCH, SEQ, HIDDEN = 80, 8, 2, 8, 64, 128
MODEL_ARGS = ["--steps", str(STEPS), "--eval_batches", str(EVAL_BATCHES), "--n_layer", str(LAYERS),
              "--n_embd", str(HIDDEN), "--n_head", "4", "--n_kv_head", "2", "--intermediate", "352",
              "--seq_len", str(SEQ)]


def _launcher():
    exe = shutil.which("deepspeed", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "deepspeed.launcher.runner"]


def _train(config_path: str) -> dict:
    port = free_port()
    cmd = _launcher() + ["--num_gpus", "2", "--master_port", str(port), os.path.join("examples", "train.py"),
                         "--deepspeed_config", config_path] + MODEL_ARGS
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}"
    # The run's shutdown() released DeepSpeed's CPU all-reduce workspaces (DeepSpeed leaves them in /dev/shm).
    assert deepspeed_shm_segments(port) == []
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"final_loss"')]
    assert len(lines) == 1, f"expected one JSON line from rank 0:\n{tail}"
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with open(os.path.join(REPO, "ds_configs", "tp2_cpu_echo4.json")) as f:
        cfg8 = json.load(f)
    cfg8["echo"]["bits"] = 8
    path8 = str(tmp_path_factory.mktemp("configs") / "tp2_cpu_echo8.json")
    with open(path8, "w") as f:
        json.dump(cfg8, f)
    return {
        16: _train(os.path.join("ds_configs", "tp2_cpu_16bit.json")),
        8: _train(path8),
        4: _train(os.path.join("ds_configs", "tp2_cpu_echo4.json")),
    }


@pytest.mark.slow
def test_json_line_and_counters(runs):
    numel = MICRO_BATCH * SEQ * HIDDEN
    for bits, r in runs.items():
        assert set(r) == {"final_loss", "steps", "tp", "echo"}
        assert (r["steps"], r["tp"]) == (STEPS, 2)
        assert set(r["echo"]) == {"forward_calls", "backward_calls", "bytes_sent", "bytes_16bit"}
    assert runs[16]["echo"] == {"forward_calls": 0, "backward_calls": 0, "bytes_sent": 0, "bytes_16bit": 0}
    for bits in (8, 4):
        e = runs[bits]["echo"]
        # 2 forward sites per layer in every training and eval forward; 2 coalesced backward sites.
        assert e["forward_calls"] == (STEPS + EVAL_BATCHES) * 2 * LAYERS
        assert e["backward_calls"] == STEPS * 2 * LAYERS
        calls = e["forward_calls"] + e["backward_calls"]
        assert e["bytes_16bit"] == calls * 2 * numel
        assert e["bytes_sent"] == calls * wire_bytes(numel, bits, 128)


@pytest.mark.slow
def test_final_losses_16bit_vs_echo8_vs_echo4(runs):
    loss = {bits: r["final_loss"] for bits, r in runs.items()}
    assert all(v < 3.0 for v in loss.values()), loss  # trained: from ln(128) = 4.85 at initialisation
    assert loss[8] != loss[16] and loss[4] != loss[16], loss  # Echo really ran
    assert abs(loss[8] - loss[16]) <= 0.05, loss
    assert abs(loss[4] - loss[16]) <= 0.1, loss
