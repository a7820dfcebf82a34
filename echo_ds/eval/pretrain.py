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
tokens), so nothing is downloaded and the tokenizer needs no file. Data: every ``*.txt`` of ``--data``
except the held-out plays (``--val-plays``, default The Tempest and Macbeth: the text of
``echo_ds/eval/data/shakespeare_heldout.txt``), which are the validation set.

Examples (from the repository root)::

    # CPU, a tiny model, a minute or two: every default run (16bit, echo4, 4bit-nocomp, echo8, variants)
    python -m echo_ds.eval pretrain --layers 2 --hidden 64 --heads 4 --kv-heads 4 --intermediate 192 \\
        --seq-len 64 --batch-size 8 --steps 200 --json /tmp/pretrain_tiny.json --plot /tmp/pretrain_tiny.png

    # the 4-bit learning-rate sweep (Table 7b's shape), added to the same invocation
    python -m echo_ds.eval pretrain --runs 16bit,echo4 --lr-sweep 5e-4,1e-3,2e-3 ...

    # one H200 (docs/training.md): 25.6M parameters, the steps sized to 260 s, 7 runs in 7 processes
    python -m echo_ds.eval pretrain --device cuda --dtype bfloat16 --layers 4 --hidden 768 --heads 12 \\
        --kv-heads 4 --intermediate 2048 --seq-len 256 --batch-size 8 --lr 1e-3 --warmup 100 \\
        --val-tokens 16384 --num-evals 16 --time-budget 260 --calib-seconds 2 --deadline 370 --workers 7 \\
        --runs 16bit,16bit-seed1,echo4,4bit-nocomp,echo8,echo4-hadamard,echo4-local \\
        --json docs/results/pretrain_h200.json --plot docs/results/pretrain_h200.png

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

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import json
import math
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.nn.functional as F

HELP = "pretrain a small decoder with Echo at every forward and backward TP site, against 16-bit"
BASELINE_NAME = "16bit"
SCHEMA = "echo_ds.eval.pretrain/1"
kRepo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# --data default: the first of these that exists (a copy inside the repo first: it travels to a device).
kDataSearch = (os.path.join(kRepo, ".data", "shakespeare"),)
kDefaultValPlays = ("tempest", "macbeth")
kDefaultRuns = ("16bit", "echo4", "4bit-nocomp", "echo8", "echo4-hadamard", "echo4-local")
kTailSteps = 100                 # Table 7's tail-100
# Cost of one validation batch (forward only, no grad) relative to one training step: an estimate for
# --time-budget (forward ~ 1/3 of forward + backward + optimizer); the calibration measures it too.
kEvalCostGuess = 0.4


# ----------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------

# The paper's method (section 7: no rotation, residual "output", gain 0.75 in both directions). The
# recorded runs (docs/training.md) used it; the package defaults moved on after the accuracy study.
kPaperSettings = {"rotation": "none", "forward": {"residual": "output", "gain": 0.75},
                  "backward": {"residual": "output", "gain": 0.75}}


def _echo(**kw):
    """The paper's method with ``kw`` on top (direction dicts merged key by key)."""
    from echo_ds.config import EchoConfig
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in kPaperSettings.items()}
    for key, value in kw.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key].update(value)
        else:
            merged[key] = value
    return EchoConfig(**merged)


def _both(**direction):
    return {"forward": dict(direction), "backward": dict(direction)}


PRESETS = {
    "16bit": ("exact all-reduce (the unmodified model)", lambda: None, 0),
    "16bit-seed1": ("exact all-reduce, seed + 1 (init and data order): run-to-run noise", lambda: None, 1),
    "echo4": ("Echo 4-bit, the paper's method (zero-aware, g=128, dual compensator both directions, "
              "residual output, pow2 rescale)", lambda: _echo(bits=4), 0),
    "echo4-defaults": ("Echo 4-bit, the package defaults (hadamard, residual local, forward gain 1.0)",
                       lambda: __import__("echo_ds.config", fromlist=["EchoConfig"]).EchoConfig(bits=4), 0),
    "4bit-nocomp": ("4-bit quantized all-reduce, no compensation in either direction",
                    lambda: _echo(bits=4, **_both(compensate=False)), 0),
    "echo8": ("Echo 8-bit, the paper's method", lambda: _echo(bits=8), 0),
    "8bit-nocomp": ("8-bit, no compensation", lambda: _echo(bits=8, **_both(compensate=False)), 0),
    "echo4-hadamard": ("Echo 4-bit, rotation hadamard", lambda: _echo(bits=4, rotation="hadamard"), 0),
    "echo4-local": ("Echo 4-bit, residual local (both directions)",
                    lambda: _echo(bits=4, **_both(residual="local")), 0),
    "echo4-hadamard-local": ("Echo 4-bit, rotation hadamard + residual local",
                             lambda: _echo(bits=4, rotation="hadamard", **_both(residual="local")), 0),
}


@dataclass
class RunSpec:
    name: str
    description: str
    config: object = None           # EchoConfig or None (exact)
    lr: float = 1e-3                # peak learning rate
    seed_offset: int = 0
    source: str | None = None
    sweep: bool = False             # part of the LR sweep


def build_runs(args) -> list:
    """The RunSpecs of an invocation: --runs presets, --echo-config files, --lr-sweep (16bit first)."""
    from echo_ds.eval.perplexity import load_echo_config
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    if BASELINE_NAME not in names:
        names.insert(0, BASELINE_NAME)
    runs = []
    for name in names:
        if name not in PRESETS:
            raise SystemExit(f"--runs: unknown run {name!r}; presets: {', '.join(PRESETS)}")
        desc, make, seed_offset = PRESETS[name]
        runs.append(RunSpec(name, desc, make(), args.lr, seed_offset))
    for spec in args.echo_config:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = os.path.splitext(os.path.basename(spec))[0], spec
        config, desc = load_echo_config(path)
        runs.append(RunSpec(name, desc or path, config, args.lr, 0, path))
    if args.lr_sweep:
        base = args.lr_sweep_run
        if base not in PRESETS or PRESETS[base][1]() is None:
            raise SystemExit(f"--lr-sweep-run {base!r} must be a quantized preset")
        for lr in parse_floats(args.lr_sweep):
            if any(r.name == base for r in runs) and math.isclose(lr, args.lr, rel_tol=1e-9):
                continue  # the main run at --lr is that point of the sweep
            desc, make, seed_offset = PRESETS[base]
            runs.append(RunSpec(f"{base}@lr={lr:g}", f"{desc}, peak LR {lr:g}", make(), lr, seed_offset,
                                sweep=True))
    seen = set()
    for r in runs:
        if r.name in seen:
            raise SystemExit(f"run name {r.name!r} appears twice")
        seen.add(r.name)
    return runs


def parse_floats(text: str) -> list:
    return [float(v) for v in text.split(",") if v.strip()]


# ----------------------------------------------------------------------------------------------------
# Data: bytes of the Shakespeare corpus
# ----------------------------------------------------------------------------------------------------

class ByteTokenizer:
    """Every UTF-8 byte is a token: vocabulary 256, no special tokens, nothing to download."""

    vocab_size = 256
    name = "bytes (UTF-8, vocabulary 256, no special tokens)"

    @staticmethod
    def encode(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()

    @staticmethod
    def decode(ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@dataclass
class Corpus:
    train: torch.Tensor             # uint8 [num_train_tokens]
    val: torch.Tensor               # uint8 [num_val_tokens]
    train_files: list
    val_files: list
    directory: str
    sha256: str


def default_data_dir() -> str | None:
    env = os.environ.get("ECHO_SHAKESPEARE_DIR")
    for path in ((env,) if env else ()) + kDataSearch:
        if path and os.path.isdir(path):
            return path
    return None


def load_corpus(directory: str, val_plays=kDefaultValPlays) -> Corpus:
    """Training bytes: every ``*.txt`` except ``val_plays`` (file stems), in name order, blank-line
    joined; validation bytes: the ``val_plays`` in the order given, joined the same way."""
    if not directory or not os.path.isdir(directory):
        raise SystemExit(f"--data {directory!r}: not a directory (the Shakespeare corpus, one .txt per play)")
    files = sorted(f for f in os.listdir(directory) if f.endswith(".txt"))
    stems = {os.path.splitext(f)[0]: f for f in files}
    missing = [p for p in val_plays if p not in stems]
    if missing:
        raise SystemExit(f"--val-plays: {missing} not in {directory}")
    val_files = [stems[p] for p in val_plays]
    train_files = [f for f in files if f not in val_files]
    if not train_files:
        raise SystemExit(f"--data {directory}: no training files left after holding out {list(val_plays)}")

    def read(names):
        parts = []
        for name in names:
            with open(os.path.join(directory, name), encoding="utf-8") as fh:
                parts.append(fh.read())
        return "\n\n".join(parts)

    train_text, val_text = read(train_files), read(val_files)
    digest = hashlib.sha256(train_text.encode("utf-8") + b"\0" + val_text.encode("utf-8")).hexdigest()
    return Corpus(ByteTokenizer.encode(train_text), ByteTokenizer.encode(val_text), train_files, val_files,
                  directory, digest)


def train_batch(tokens: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """The batch of ``step``: ``batch_size`` random windows of ``seq_len + 1`` tokens, int64 [B, L + 1].

    A pure function of (seed, step), so every run (and a re-computation for the gradient check) sees the
    same batch at the same step.
    """
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None]
    return tokens[idx].long()


def val_batches(tokens: torch.Tensor, batch_size: int, seq_len: int, num_tokens: int) -> list:
    """Consecutive non-overlapping windows of ``seq_len + 1`` from the start of the validation bytes,
    about ``num_tokens`` predicted tokens, in batches of ``batch_size`` (the last one may be smaller)."""
    num_windows = max(1, min(num_tokens // seq_len, (tokens.numel() - 1) // seq_len))
    windows = [tokens[i * seq_len: i * seq_len + seq_len + 1].long() for i in range(num_windows)]
    return [torch.stack(windows[i:i + batch_size]) for i in range(0, num_windows, batch_size)]


# ----------------------------------------------------------------------------------------------------
# Model, optimizer, schedule
# ----------------------------------------------------------------------------------------------------

def model_config(args):
    import transformers
    kw = dict(vocab_size=ByteTokenizer.vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
              num_hidden_layers=args.layers, num_attention_heads=args.heads,
              num_key_value_heads=args.kv_heads or args.heads, max_position_embeddings=args.seq_len,
              tie_word_embeddings=False)
    if args.arch == "qwen3":
        return transformers.Qwen3Config(head_dim=args.head_dim or args.hidden // args.heads, **kw)
    if args.arch == "llama":
        return transformers.LlamaConfig(**kw)
    raise SystemExit(f"--arch {args.arch!r}: qwen3 or llama")


def build_model(args, seed: int) -> torch.nn.Module:
    """A randomly initialised decoder (fp32, CPU): the same weights for the same ``seed``."""
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(model_config(args), attn_implementation="sdpa")
    return model.float()


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95), eps=1e-5):
    """AdamW; weight decay on the matrices and embeddings only (not the norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=tuple(betas), eps=eps, fused=fused)


def lr_at(step: int, num_steps: int, peak: float, warmup: int, min_lr: float) -> float:
    """Linear warm-up over ``warmup`` steps to ``peak``, then cosine decay to ``min_lr`` at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, num_steps - 1 - warmup)
    return min_lr + 0.5 * (peak - min_lr) * (1.0 + math.cos(math.pi * min(1.0, progress)))


def loss_of(model, batch: torch.Tensor, amp_dtype) -> torch.Tensor:
    """Mean next-byte cross-entropy of ``batch`` [B, L + 1] (fp32)."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    device_type = inputs.device.type
    with torch.autocast(device_type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ----------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------

@dataclass
class TrainSettings:
    steps: int
    batch_size: int
    seq_len: int
    warmup: int
    min_lr_ratio: float
    weight_decay: float
    betas: tuple
    eps: float
    grad_clip: float
    seed: int
    eval_interval: int
    grad_check_steps: tuple = ()
    deadline: float | None = None       # time.time() at which a run stops early


class Trainer:
    """One process's model, TP emulator, data and device; trains one run at a time from the same init."""

    def __init__(self, args, corpus: Corpus):
        from echo_ds.eval.tp_backward import TrainingTPEmulator
        self.args = args
        self.device = torch.device(args.device)
        self.amp_dtype = None if args.dtype == "float32" else {"bfloat16": torch.bfloat16,
                                                               "float16": torch.float16}[args.dtype]
        self.corpus = corpus
        self.model = build_model(args, args.seed).to(self.device)
        self._init_states = {args.seed: copy.deepcopy(self.model.state_dict())}
        self.tp = TrainingTPEmulator(self.model, args.tp)
        self.val = [b.to(self.device) for b in val_batches(corpus.val, args.batch_size, args.seq_len,
                                                           args.val_tokens)]
        self.final_val = [b.to(self.device) for b in val_batches(corpus.val, args.batch_size, args.seq_len,
                                                                 args.final_val_tokens or corpus.val.numel())]
        self.train_tokens = corpus.train
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self._using = None

    def reset(self, seed: int) -> None:
        """Back to the initial weights of ``seed`` (built once per seed)."""
        if seed not in self._init_states:
            self._init_states[seed] = {k: v.to(self.device) for k, v in build_model(self.args, seed).state_dict().items()}
        self.model.load_state_dict(self._init_states[seed])
        self.model.zero_grad(set_to_none=True)

    def batch(self, step: int, seed: int) -> torch.Tensor:
        return train_batch(self.train_tokens, step, self.args.batch_size, self.args.seq_len,
                           seed).to(self.device, non_blocking=True)

    def use(self, config, directions=("forward", "backward")) -> None:
        """Route the sites through ``config`` (None: exact), unless they already are."""
        key = (id(config), tuple(directions))
        if self._using != key:
            self.tp.set_config(config, directions)
            self._using = key

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- one step / one evaluation ---------------------------------------------------------------------
    def train_step(self, opt, batch, lr: float, grad_clip: float):
        for group in opt.param_groups:
            group["lr"] = lr
        self.tp.begin_pass()
        loss = loss_of(self.model, batch, self.amp_dtype)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), norm.detach()

    @torch.no_grad()
    def evaluate(self, config=None, directions=("forward", "backward"), batches=None) -> float:
        """Mean validation loss per token with ``config`` at the sites (compensators reset per batch)."""
        self.use(config, directions)
        total, count = torch.zeros((), device=self.device, dtype=torch.float64), 0
        for batch in (self.val if batches is None else batches):
            self.tp.begin_pass()
            n = batch[:, 1:].numel()
            total += loss_of(self.model, batch, self.amp_dtype).double() * n
            count += n
        return float(total) / count

    def gradient(self, batch, config, directions=("forward", "backward")) -> torch.Tensor:
        """The full gradient (fp32, flattened over every parameter) of ``batch`` under ``config``."""
        self.use(config, directions)
        self.model.zero_grad(set_to_none=True)
        self.tp.begin_pass()
        loss_of(self.model, batch, self.amp_dtype).backward()
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).float().reshape(-1)
                          for p in self.model.parameters()])
        self.model.zero_grad(set_to_none=True)
        return flat

    # -- a whole run -------------------------------------------------------------------------------------
    def run(self, spec: RunSpec, s: TrainSettings, progress=True, position=0, grad_variants=(),
            log=None) -> dict:
        """Train ``spec`` for ``s.steps`` steps; the result dict of the run (see the module docstring).

        ``grad_variants`` ((name, config, directions), ...): at ``s.grad_check_steps`` the gradient under
        each is compared with this run's own (exact) gradient on the same weights and batch. A run whose
        loss turns non-finite stops at the next evaluation (``diverged_at``); one still going at
        ``s.deadline`` (a ``time.time()``) stops there (``truncated``), its schedule unfinished.
        """
        from tqdm.auto import tqdm
        log = log or (lambda msg: None)
        seed = s.seed + spec.seed_offset
        self.reset(seed)
        opt = make_optimizer(self.model, spec.lr, s.weight_decay, s.betas, s.eps)
        min_lr = spec.lr * s.min_lr_ratio
        losses = torch.full((s.steps,), float("nan"), device=self.device)
        norms = torch.full((s.steps,), float("nan"), device=self.device)
        val, fidelity = [], []
        checks = set(s.grad_check_steps)
        diverged_at = truncated_at = None
        interactive = sys.stderr.isatty()
        bar = tqdm(total=s.steps, desc=f"{spec.name:>16}", unit="step", position=position, leave=True,
                   disable=not progress, file=sys.stderr, mininterval=0.5 if interactive else 30.0,
                   dynamic_ncols=interactive, ascii=not interactive)
        self.sync()
        wall_start = time.perf_counter()
        side_seconds = 0.0      # evaluations and gradient checks: not training time
        step = 0
        while True:
            if step in checks and grad_variants or step % s.eval_interval == 0 or step == s.steps:
                self.sync()
                t0 = time.perf_counter()
                if step in checks and grad_variants:
                    fidelity += self.gradient_fidelity(self.batch(step, seed), grad_variants, step)
                if step % s.eval_interval == 0 or step == s.steps:
                    v = self.evaluate(spec.config, batches=self.val)
                    val.append({"step": step, "loss": v})
                    if step:
                        recent = float(losses[max(0, step - 50):step].nanmean())
                        ms = 1e3 * (time.perf_counter() - wall_start - side_seconds) / step
                        log(f"[{spec.name}] step {step}/{s.steps}: train (last 50) {recent:.4f}, val {v:.4f}, "
                            f"{ms:.1f} ms/step")
                        bad = (~torch.isfinite(losses[:step])).nonzero()
                        if bad.numel():
                            diverged_at = int(bad[0])
                            log(f"[{spec.name}] non-finite loss at step {diverged_at}: stopping the run")
                            break
                self.sync()
                side_seconds += time.perf_counter() - t0
            if step == s.steps:
                break
            if s.deadline is not None and time.time() > s.deadline:
                truncated_at = step
                log(f"[{spec.name}] deadline reached at step {step}/{s.steps}: stopping the run early")
                break
            self.use(spec.config)
            loss, norm = self.train_step(opt, self.batch(step, seed), lr_at(step, s.steps, spec.lr, s.warmup, min_lr),
                                         s.grad_clip)
            losses[step] = loss
            norms[step] = norm
            step += 1
            bar.update(1)
            if progress and step % 50 == 0:
                bar.set_postfix_str(f"loss {float(loss):.3f}", refresh=False)
        self.sync()
        train_seconds = time.perf_counter() - wall_start - side_seconds
        bar.close()
        steps_done = step if diverged_at is None else diverged_at
        fwd_bits, bwd_bits = _bits(self.tp.forward_sites.stats), _bits(self.tp.backward_sites.stats)
        final_val = final_exact = None
        if diverged_at is None:
            final_val = self.evaluate(spec.config, batches=self.final_val)
            final_exact = self.evaluate(None, batches=self.final_val) if spec.config is not None else final_val
        train_losses = [None if not math.isfinite(v) else v for v in losses.tolist()][:steps_done]
        return {
            "name": spec.name,
            "description": spec.description,
            "echo": spec.config.model_dump(mode="json") if spec.config is not None else None,
            "config_file": spec.source,
            "lr": spec.lr,
            "min_lr": min_lr,
            "seed": seed,
            "sweep": spec.sweep,
            "steps": s.steps,
            "steps_done": steps_done,
            "diverged_at": diverged_at,
            "truncated_at": truncated_at,
            "train_loss": train_losses,
            "grad_norm": [None if not math.isfinite(v) else v for v in norms.tolist()][:steps_done],
            "val": val,
            "final_val_loss": final_val,
            "final_val_loss_exact_forward": final_exact,
            "final_val_tokens": sum(int(b[:, 1:].numel()) for b in self.final_val),
            "tail100": tail_mean(train_losses, kTailSteps) if diverged_at is None else None,
            "train_seconds": train_seconds,
            "wall_seconds": time.perf_counter() - wall_start,
            "ms_per_step": 1e3 * train_seconds / max(1, steps_done),
            "wire_bits_per_element": {"forward": fwd_bits, "backward": bwd_bits},
            "gradient_fidelity": fidelity,
        }

    def gradient_fidelity(self, batch, variants, step: int) -> list:
        """Cosine and relative error of each variant's full gradient against the exact one (same batch)."""
        exact = self.gradient(batch, None).double()
        exact_norm = float(exact.norm())
        rows = []
        for name, config, directions in variants:
            g = self.gradient(batch, config, directions).double()
            rows.append({"step": step, "variant": name, "directions": list(directions),
                         "cosine": float(g @ exact) / max(float(g.norm()) * exact_norm, 1e-300),
                         "rel_error": float((g - exact).norm()) / max(exact_norm, 1e-300),
                         "exact_norm": exact_norm})
        return rows

    def time_run(self, spec: RunSpec, s: TrainSettings, seconds: float, num_warmup: int = 2) -> dict:
        """Seconds per training step and per validation batch of ``spec`` (weights reset afterwards)."""
        seed = s.seed + spec.seed_offset
        self.reset(seed)
        opt = make_optimizer(self.model, spec.lr, s.weight_decay, s.betas, s.eps)
        self.use(spec.config)
        for step in range(num_warmup):
            self.train_step(opt, self.batch(step, seed), spec.lr * 0.01, s.grad_clip)
        self.sync()
        n, start = 0, time.perf_counter()
        while n < 3 or time.perf_counter() - start < seconds:
            self.train_step(opt, self.batch(num_warmup + n, seed), spec.lr * 0.01, s.grad_clip)
            n += 1
            if n % 4 == 0:
                self.sync()
        self.sync()
        step_seconds = (time.perf_counter() - start) / n
        with torch.no_grad():
            batch = self.val[0]
            self.tp.begin_pass()
            loss_of(self.model, batch, self.amp_dtype)
            self.sync()
            t0 = time.perf_counter()
            for _ in range(2):
                self.tp.begin_pass()
                loss_of(self.model, batch, self.amp_dtype)
            self.sync()
            eval_seconds = (time.perf_counter() - t0) / 2
        self.reset(seed)
        return {"step_seconds": step_seconds, "eval_batch_seconds": eval_seconds, "timed_steps": n}


def _bits(stats) -> float:
    return stats.bits_per_element if stats.num_elements else 16.0


def tail_mean(values: list, n: int) -> float | None:
    tail = [v for v in values[-n:] if v is not None]
    return sum(tail) / len(tail) if tail and len(tail) == len(values[-n:]) else None


# ----------------------------------------------------------------------------------------------------
# Budget
# ----------------------------------------------------------------------------------------------------

@dataclass
class RunCost:
    """Measured cost of one run: seconds per training step and per validation batch, plus the fixed
    seconds of its final evaluations and (the baseline's) gradient checks."""

    step_seconds: float
    eval_batch_seconds: float
    fixed_seconds: float = 0.0


def plan_steps(budget: float, worker_costs: list, num_val_batches: int, num_evals: int | None = None,
               eval_interval: int | None = None, round_to: int = 10) -> int:
    """The largest step count (a multiple of ``round_to``, at least ``round_to``) whose estimated time
    fits ``budget`` seconds on every worker (``worker_costs``: per worker, the RunCosts of its runs, run
    one after the other). Evaluations: ``num_evals + 1`` per run, or one every ``eval_interval`` steps.
    """
    best = None
    for costs in worker_costs:
        per_step = fixed = 0.0
        for c in costs:
            per_step += c.step_seconds
            fixed += c.fixed_seconds + c.eval_batch_seconds * num_val_batches
            if eval_interval:
                per_step += c.eval_batch_seconds * num_val_batches / eval_interval
            else:
                fixed += c.eval_batch_seconds * num_val_batches * num_evals
        if per_step > 0:
            n = (budget - fixed) / per_step
            best = n if best is None else min(best, n)
    if best is None:
        raise ValueError("no runs to plan")
    return max(round_to, int(best // round_to) * round_to)


# ----------------------------------------------------------------------------------------------------
# Orchestration: in this process, or in worker processes
# ----------------------------------------------------------------------------------------------------

def grad_check_variants(runs: list) -> list:
    """(name, config, directions) of the gradient check: every quantized run's config, plus the
    forward-only and backward-only halves of the 4-bit compensated and uncompensated configs."""
    out, seen = [], set()
    for r in runs:
        if r.config is None or r.sweep:
            continue
        key = json.dumps(r.config.model_dump(mode="json"), sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        out.append((r.name, r.config, ("forward", "backward")))
    for name in ("echo4", "4bit-nocomp"):
        r = next((r for r in runs if r.name == name), None)
        if r is not None:
            out.append((f"{name} fwd-only", r.config, ("forward",)))
            out.append((f"{name} bwd-only", r.config, ("backward",)))
    return out


def check_steps(fractions: list, steps: int) -> tuple:
    return tuple(sorted({min(steps, max(0, int(round(f * steps)))) for f in fractions}))


def make_settings(args, steps: int, deadline: float | None = None) -> TrainSettings:
    eval_interval = args.eval_interval or max(1, steps // args.num_evals)
    return TrainSettings(steps=steps, batch_size=args.batch_size, seq_len=args.seq_len, warmup=args.warmup,
                         min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay,
                         betas=(args.beta1, args.beta2), eps=args.adam_eps, grad_clip=args.grad_clip,
                         seed=args.seed, eval_interval=eval_interval,
                         grad_check_steps=check_steps(parse_floats(args.grad_check), steps), deadline=deadline)


def _val_plays(args) -> tuple:
    return tuple(p.strip() for p in args.val_plays.split(",") if p.strip())


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_costs(timings: dict, runs: list, num_final_batches: int, num_checks: int) -> dict:
    """{run name: RunCost} from the calibration ``timings`` ({name: time_run's dict})."""
    variants = grad_check_variants(runs)
    quantized = [timings[r.name]["step_seconds"] for r in runs if r.config is not None and r.name in timings]
    base = timings.get(BASELINE_NAME, {}).get("step_seconds", 0.0)
    check = base + len(variants) * (max(quantized) if quantized else base)
    out = {}
    for r in runs:
        if r.name not in timings:
            continue
        t = timings[r.name]
        fixed = t["eval_batch_seconds"] * num_final_batches * (2 if r.config is not None else 1)
        if r.name == BASELINE_NAME:
            fixed += num_checks * check
        out[r.name] = RunCost(t["step_seconds"], t["eval_batch_seconds"], fixed)
    return out


def _plan(args, runs, assignment, solo: dict, contended: dict | None, num_val: int, num_final: int) -> dict:
    """Steps and schedule: ``parallel`` (every worker at once, timed together) or ``sequential`` (the
    workers one after the other, timed alone), whichever fits more steps into the budget."""
    num_checks = len(parse_floats(args.grad_check))
    kw = dict(num_val_batches=num_val, num_evals=args.num_evals, eval_interval=args.eval_interval)
    solo_costs = run_costs(solo, runs, num_final, num_checks)
    options = {"sequential": plan_steps(args.time_budget, [[solo_costs[r.name] for r in runs]], **kw)}
    if contended is not None:
        par_costs = run_costs(contended, runs, num_final, num_checks)
        options["parallel"] = plan_steps(args.time_budget, [[par_costs[r.name] for r in a] for a in assignment], **kw)
    if args.schedule in options:
        schedule = args.schedule
    else:
        schedule = max(options, key=lambda k: (options[k], k == "parallel"))
    return {"schedule": schedule, "steps": options[schedule], "steps_by_schedule": options}


def run_in_process(args, runs: list, corpus: Corpus, on_result, deadline=None) -> dict:
    """Every run in this process, one after the other; returns the invocation's info."""
    trainer = Trainer(args, corpus)
    variants = grad_check_variants(runs)
    info = {"workers": 1, "schedule": "sequential", "num_params": trainer.num_params, "tp": tp_info(trainer)}
    steps = args.steps
    if args.time_budget:
        s0 = make_settings(args, 100)
        timings = {}
        for r in runs:
            timings[r.name] = trainer.time_run(r, s0, args.calib_seconds / len(runs))
            _log(f"calibration [{r.name}]: {1e3 * timings[r.name]['step_seconds']:.1f} ms/step, "
                 f"{1e3 * timings[r.name]['eval_batch_seconds']:.1f} ms/val batch")
        plan = _plan(args, runs, [runs], timings, None, len(trainer.val), len(trainer.final_val))
        steps = plan["steps"]
        info["calibration"] = {"solo": timings, "budget_seconds": args.time_budget, **plan}
        _log(f"time budget {args.time_budget:.0f} s: {steps} steps per run")
    settings = make_settings(args, steps, deadline)
    info.update(steps=steps, settings=settings)
    on_result(("info", info))
    for r in runs:
        result = trainer.run(r, settings, progress=not args.no_progress, position=0,
                             grad_variants=variants if r.name == BASELINE_NAME else (), log=_log)
        on_result(("result", result))
    trainer.tp.close()
    return info


def tp_info(trainer: Trainer) -> dict:
    from echo_ds.eval.tp_backward import describe_column_partitions
    from echo_ds.eval.tp_emulation import describe_partitions
    return {"world_size": trainer.args.tp,
            "num_forward_sites": trainer.tp.num_forward_sites,
            "num_backward_sites": trainer.tp.num_backward_sites,
            "forward_partitions": describe_partitions(trainer.tp.forward_sites.plans),
            "backward_partitions": describe_column_partitions(trainer.tp.backward_sites.plans)}


def _worker_main(worker_id, num_workers, args, run_specs, all_runs, queue, barrier, shared, turns, deadline):
    """A worker process: set up, calibrate (alone, then with all the others), train its runs.

    Everything goes to the parent through ``queue``; ``barrier`` (the workers and the parent) orders the
    calibration phases; ``shared`` holds the planned steps and schedule (1: sequential), ``turns[w]`` is
    set when worker w may train in the sequential schedule.
    """
    try:
        torch.set_num_threads(max(1, args.threads))
        _device_defaults(args)
        corpus = load_corpus(args.data, _val_plays(args))
        trainer = Trainer(args, corpus)
        variants = grad_check_variants(all_runs)
        queue.put(("ready", worker_id, {"num_params": trainer.num_params, "tp": tp_info(trainer),
                                        "num_val_batches": len(trainer.val),
                                        "num_final_batches": len(trainer.final_val)}))
        steps, sequential = args.steps, args.schedule == "sequential"
        if args.time_budget:
            s0 = make_settings(args, 100)
            barrier.wait(timeout=args.setup_timeout)
            solo = {}
            for w in range(num_workers):             # alone: one worker at a time
                if w == worker_id:
                    solo = {r.name: trainer.time_run(r, s0, args.calib_seconds / len(run_specs)) for r in run_specs}
                barrier.wait(timeout=args.setup_timeout)
            contended = {}
            if args.schedule != "sequential":         # all at once
                contended = {r.name: trainer.time_run(r, s0, args.calib_seconds / len(run_specs)) for r in run_specs}
            queue.put(("calib", worker_id, {"solo": solo, "contended": contended}))
            barrier.wait(timeout=args.setup_timeout)
            steps, sequential = shared[0], bool(shared[1])
        if sequential:
            while not turns[worker_id].wait(timeout=5.0):
                pass
        settings = make_settings(args, steps, deadline)
        for r in run_specs:
            result = trainer.run(r, settings, progress=not args.no_progress, position=worker_id,
                                 grad_variants=variants if r.name == BASELINE_NAME else (), log=_log)
            queue.put(("result", worker_id, result))
        trainer.tp.close()
        queue.put(("done", worker_id, None))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put(("error", worker_id, traceback.format_exc()))
        try:
            barrier.abort()
        except Exception:  # noqa: BLE001
            pass


def run_in_workers(args, runs: list, corpus: Corpus, on_result, deadline=None) -> dict:
    """The runs in ``args.workers`` spawned processes (round robin: the baseline in worker 0)."""
    import multiprocessing as mp
    import queue as queue_mod
    ctx = mp.get_context("spawn")
    num_workers = min(args.workers, len(runs))
    assignment = [runs[w::num_workers] for w in range(num_workers)]
    queue = ctx.Queue()
    barrier = ctx.Barrier(num_workers + 1)
    shared = ctx.Array("i", [args.steps, int(args.schedule == "sequential")])
    turns = [ctx.Event() for _ in range(num_workers)]
    procs = [ctx.Process(target=_worker_main, args=(w, num_workers, args, assignment[w], runs, queue, barrier,
                                                    shared, turns, deadline), daemon=True)
             for w in range(num_workers)]
    for p in procs:
        p.start()
    _log(f"{num_workers} workers: " + "; ".join(f"{w}: {', '.join(r.name for r in a)}"
                                                 for w, a in enumerate(assignment)))
    info = {"steps": args.steps, "workers": num_workers, "schedule": "parallel",
            "assignment": [[r.name for r in a] for a in assignment]}
    failed, ready, done = set(), {}, set()

    def get(timeout):
        end = time.time() + timeout
        while True:
            try:
                return queue.get(timeout=5)
            except queue_mod.Empty:
                if time.time() > end or not any(p.is_alive() for p in procs):
                    raise RuntimeError("the workers stopped answering") from None

    def handle(msg):
        kind, wid, payload = msg
        if kind == "error":
            _log(f"worker {wid} failed:\n{payload}")
            failed.add(wid)
            turns[min(wid + 1, num_workers - 1)].set()
            if len(ready) < num_workers or args.time_budget and "calibration" not in info:
                raise RuntimeError(f"worker {wid} failed during set-up")
        elif kind == "ready":
            ready[wid] = payload
        elif kind == "result":
            on_result(("result", payload))
        elif kind == "done":
            done.add(wid)
            if wid + 1 < num_workers:
                turns[wid + 1].set()
        return kind

    try:
        while len(ready) < num_workers:
            handle(get(args.setup_timeout))
        info.update({k: ready[0][k] for k in ("num_params", "tp")})
        if args.time_budget:
            barrier.wait(timeout=args.setup_timeout)
            for _ in range(num_workers):
                barrier.wait(timeout=args.setup_timeout)
            calib = {}
            while len(calib) < num_workers:
                msg = get(args.setup_timeout)
                if msg[0] == "calib":
                    calib[msg[1]] = msg[2]
                else:
                    handle(msg)
            solo = {n: t for c in calib.values() for n, t in c["solo"].items()}
            contended = {n: t for c in calib.values() for n, t in c["contended"].items()} or None
            plan = _plan(args, runs, assignment, solo, contended, ready[0]["num_val_batches"],
                         ready[0]["num_final_batches"])
            shared[0], shared[1] = plan["steps"], int(plan["schedule"] == "sequential")
            for name in solo:
                par = f", {1e3 * contended[name]['step_seconds']:.1f} with all {num_workers} at once" if contended else ""
                _log(f"calibration [{name}]: {1e3 * solo[name]['step_seconds']:.1f} ms/step alone{par}")
            _log(f"time budget {args.time_budget:.0f} s: {plan['steps_by_schedule']} steps by schedule; "
                 f"{plan['schedule']}, {plan['steps']} steps per run")
            info.update(steps=plan["steps"], schedule=plan["schedule"],
                        calibration={"solo": solo, "contended": contended, "budget_seconds": args.time_budget,
                                     **plan})
            barrier.wait(timeout=args.setup_timeout)
        elif args.schedule == "sequential":
            info["schedule"] = "sequential"
        turns[0].set()
        if info["schedule"] == "parallel":
            for t in turns:
                t.set()
        info["settings"] = make_settings(args, info["steps"], deadline)
        on_result(("info", info))
        while len(done | failed) < num_workers:
            handle(get(args.run_timeout))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    if failed:
        info["failed_workers"] = sorted(failed)
    return info


# ----------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------

def _pct(value, ref):
    if value is None or ref is None:
        return None
    return 100.0 * (value / ref - 1.0)


def summarize(results: list) -> list:
    """One row per run: tail-100, final val (and with the exact forward), each with its % to 16bit."""
    base = next((r for r in results if r["name"] == BASELINE_NAME), None)
    rows = []
    for r in results:
        rows.append({
            "name": r["name"], "lr": r["lr"], "steps_done": r["steps_done"], "diverged_at": r["diverged_at"],
            "wire_bits_forward": r["wire_bits_per_element"]["forward"],
            "wire_bits_backward": r["wire_bits_per_element"]["backward"],
            "tail100": r["tail100"], "tail100_pct": _pct(r["tail100"], base and base["tail100"]),
            "final_val": r["final_val_loss"], "final_val_pct": _pct(r["final_val_loss"], base and base["final_val_loss"]),
            "final_val_exact_forward": r["final_val_loss_exact_forward"],
            "final_val_exact_forward_pct": _pct(r["final_val_loss_exact_forward"],
                                                base and base["final_val_loss_exact_forward"]),
            "ms_per_step": r["ms_per_step"],
        })
    return rows


def _f(v, fmt="{:.4f}"):
    return "—" if v is None else fmt.format(v)


def markdown_table(rows: list) -> str:
    lines = ["| run | peak LR | wire bits/elem fwd, bwd | tail-100 train | vs 16bit | final val | vs 16bit "
             "| final val, exact fwd | vs 16bit | ms/step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = r["name"] + (f" (diverged at {r['diverged_at']})" if r["diverged_at"] is not None else "")
        lines.append(f"| {name} | {r['lr']:g} | {r['wire_bits_forward']:.2f}, {r['wire_bits_backward']:.2f} "
                     f"| {_f(r['tail100'])} | {_f(r['tail100_pct'], '{:+.2f}%')} | {_f(r['final_val'])} "
                     f"| {_f(r['final_val_pct'], '{:+.2f}%')} | {_f(r['final_val_exact_forward'])} "
                     f"| {_f(r['final_val_exact_forward_pct'], '{:+.2f}%')} | {r['ms_per_step']:.1f} |")
    return "\n".join(lines)


def fidelity_table(rows: list) -> str:
    if not rows:
        return ""
    lines = ["| step | variant | cosine to exact gradient | relative error |", "|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['step']} | {r['variant']} | {r['cosine']:.6f} | {r['rel_error']:.4f} |")
    return "\n".join(lines)


def lr_sweep_rows(results: list, sweep_run: str, main_lr: float) -> list:
    """Table 7b: tail-100 per peak LR of the sweep runs (the main run at --lr included), Δ to --lr."""
    points = [r for r in results if r["sweep"] or r["name"] == sweep_run]
    if not any(r["sweep"] for r in results):
        return []
    ref = next((r["tail100"] for r in points if math.isclose(r["lr"], main_lr, rel_tol=1e-9)), None)
    rows = []
    for r in sorted(points, key=lambda r: r["lr"]):
        delta = None if r["tail100"] is None or ref is None else r["tail100"] - ref
        rows.append({"name": r["name"], "lr": r["lr"], "tail100": r["tail100"], "delta_to_main_lr": delta,
                     "final_val": r["final_val_loss"]})
    return rows


def lr_sweep_table(rows: list, main_lr: float) -> str:
    if not rows:
        return ""
    lines = ["| peak LR | " + " | ".join(f"{r['lr']:g}" for r in rows) + " |",
             "|---|" + "---:|" * len(rows),
             "| tail-100 loss | " + " | ".join(_f(r["tail100"]) for r in rows) + " |",
             f"| Δ to LR {main_lr:g} | " + " | ".join(_f(r["delta_to_main_lr"], "{:+.4f}") for r in rows) + " |",
             "| final val | " + " | ".join(_f(r["final_val"]) for r in rows) + " |"]
    return "\n".join(lines)


def moving_average(values: list, window: int):
    """(steps, mean, std) of a trailing window over ``values`` (None ends the series)."""
    import numpy as np
    v = []
    for x in values:
        if x is None:
            break
        v.append(x)
    v = np.asarray(v, dtype=np.float64)
    if v.size == 0:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    window = max(1, min(window, v.size))
    c1 = np.concatenate([[0.0], np.cumsum(v)])
    c2 = np.concatenate([[0.0], np.cumsum(v * v)])
    idx = np.arange(window, v.size + 1)
    mean = (c1[idx] - c1[idx - window]) / window
    var = np.maximum((c2[idx] - c2[idx - window]) / window - mean * mean, 0.0)
    return idx - 1, mean, np.sqrt(var)


def plot_curves(doc: dict, path: str) -> None:
    """Figure 3's shape: the full run (50-step average, tail band in gray), the tail (100-step average,
    ±1 s.d.), the validation loss; and the LR sweep when there is one."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in doc["runs"] if not r["sweep"]]
    sweep = doc.get("lr_sweep") or []
    steps = doc["train"]["steps"]
    tail = max(kTailSteps, steps // 4)
    ncols = 4 if sweep else 3
    fig, axes = plt.subplots(1, ncols, figsize=(4.2 * ncols, 3.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lo_full, hi_full = [], []
    for i, r in enumerate(results):
        color = colors[i % len(colors)]
        x, m, _ = moving_average(r["train_loss"], 50)
        axes[0].plot(x, m, color=color, lw=1.0, label=r["name"])
        if m.size:
            lo_full.append(m.min())
            hi_full.append(m[min(len(m) - 1, len(m) // 10)])
        x, m, sd = moving_average(r["train_loss"], 100)
        keep = x >= steps - tail
        axes[1].plot(x[keep], m[keep], color=color, lw=1.0, label=r["name"])
        axes[1].fill_between(x[keep], (m - sd)[keep], (m + sd)[keep], color=color, alpha=0.12, lw=0)
        vs = [(v["step"], v["loss"]) for v in r["val"]]
        axes[2].plot([s for s, _ in vs], [v for _, v in vs], color=color, lw=1.0, marker=".", ms=3, label=r["name"])
    if lo_full:
        axes[0].set_ylim(min(lo_full) - 0.05, max(hi_full))
    axes[0].axvspan(steps - tail, steps, color="gray", alpha=0.15, lw=0)
    axes[0].set_title("training loss (50-step average)", fontsize=9)
    axes[1].set_title(f"last {tail} steps (100-step average, ±1 s.d.)", fontsize=9)
    axes[2].set_title("validation loss (held-out plays)", fontsize=9)
    vals = [v["loss"] for r in results for v in r["val"] if v["step"] >= steps // 4]
    if vals:
        axes[2].set_ylim(min(vals) - 0.02, max(vals) + 0.02)
    for ax in axes[:3]:
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    if sweep:
        xs = [r["lr"] for r in sweep]
        axes[3].plot(xs, [r["tail100"] for r in sweep], marker="o", label=f"{doc['lr_sweep_run']} tail-100")
        base = next((r for r in doc["runs"] if r["name"] == BASELINE_NAME), None)
        if base is not None and base["tail100"] is not None:
            axes[3].axhline(base["tail100"], color="gray", ls="--", lw=0.8, label=f"16bit at LR {base['lr']:g}")
        axes[3].set_xscale("log")
        axes[3].set_xlabel("peak LR")
        axes[3].set_title("4-bit LR sweep (Table 7b)", fontsize=9)
        axes[3].grid(True, alpha=0.3)
        axes[3].legend(fontsize=7)
    fig.suptitle(doc["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def bench_sites(args, runs: list, repeats: int = 5) -> list:
    """Milliseconds per emulator call at the training message size, per quantized config and direction."""
    from echo_ds.emulate import CompensatedAllReduce
    device = torch.device(args.device)
    shape = (args.tp, args.batch_size * args.seq_len, args.hidden)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(shape, generator=gen).to(device)
    rows = []
    for r in runs:
        if r.config is None or r.sweep:
            continue
        for direction in ("forward", "backward"):
            op = CompensatedAllReduce(args.tp, r.config, direction)
            scale = 1e-4 if direction == "backward" else 1.0
            for _ in range(2):
                op(x * scale)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(repeats):
                op(x * scale)
            if device.type == "cuda":
                torch.cuda.synchronize()
            rows.append({"run": r.name, "direction": direction, "shape": list(shape),
                         "ms_per_call": 1e3 * (time.perf_counter() - t0) / repeats})
    return rows


# ----------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    g = parser.add_argument_group("model (random init)")
    g.add_argument("--arch", default="qwen3", choices=("qwen3", "llama"), help="default qwen3 (QK norm)")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=4, help="key/value heads (GQA); default 4")
    g.add_argument("--head-dim", type=int, default=None, help="qwen3 only; default hidden / heads")
    g.add_argument("--intermediate", type=int, default=768, help="SwiGLU intermediate size")
    g = parser.add_argument_group("training")
    g.add_argument("--steps", type=int, default=1000, help="steps per run (ignored with --time-budget)")
    g.add_argument("--batch-size", type=int, default=16, help="sequences per step (one micro-batch)")
    g.add_argument("--seq-len", type=int, default=256)
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of every run (default 1e-3)")
    g.add_argument("--warmup", type=int, default=100, help="linear warm-up steps (paper: 100)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to peak x this (paper: 0.1)")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-5, help="paper: 1e-5")
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0, help="init and data order (the same for every run)")
    g.add_argument("--data", default=default_data_dir(),
                   help="directory of the Shakespeare plays, one .txt each (default: ./.data/shakespeare, "
                        "or $ECHO_SHAKESPEARE_DIR)")
    g.add_argument("--val-plays", default=",".join(kDefaultValPlays), help="held-out file stems (default "
                   "tempest,macbeth)")
    g.add_argument("--val-tokens", type=int, default=32768, help="validation tokens per periodic evaluation")
    g.add_argument("--final-val-tokens", type=int, default=None,
                   help="validation tokens of the final evaluation (default: all of the held-out plays)")
    g.add_argument("--eval-interval", type=int, default=None, help="default: steps / --num-evals")
    g.add_argument("--num-evals", type=int, default=20)
    g = parser.add_argument_group("emulated tensor parallelism and runs")
    g.add_argument("--tp", type=int, default=4, help="emulated TP degree P (default 4)")
    g.add_argument("--runs", default=",".join(kDefaultRuns),
                   help=f"comma-separated presets (default {','.join(kDefaultRuns)}); presets: {', '.join(PRESETS)}")
    g.add_argument("--echo-config", action="append", default=[], metavar="NAME=PATH",
                   help="one more run with this Echo config (repeatable)")
    g.add_argument("--lr-sweep", default="", metavar="LR,LR,...",
                   help="add --lr-sweep-run at each of these peak LRs (Table 7b)")
    g.add_argument("--lr-sweep-run", default="echo4", help="the preset of the LR sweep (default echo4)")
    g.add_argument("--grad-check", default="0.1,0.5,1.0", metavar="F,F,...",
                   help="gradient fidelity at these fractions of the run (of the 16bit run's weights); '' none")
    g = parser.add_argument_group("device and time")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    g.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="autocast dtype of the matrix products (default bfloat16 on cuda, float32 on cpu)")
    g.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="size --steps so that all runs fit (after a calibration)")
    g.add_argument("--calib-seconds", type=float, default=6.0, help="timing per worker (default 6)")
    g.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="runs still going this long after the start stop early (marked truncated), so that "
                        "the outputs are written before an outer time limit")
    g.add_argument("--workers", type=int, default=1, help="processes to spread the runs over (default 1)")
    g.add_argument("--schedule", default="auto", choices=("auto", "parallel", "sequential"),
                   help="with --workers: all workers at once, or one after the other; auto (with "
                        "--time-budget): whichever the calibration says fits more steps")
    g.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads per process (default 1: the emulator's many small operations gain "
                        "nothing from more, and oversubscribed cores slow them down many times)")
    g.add_argument("--setup-timeout", type=float, default=600.0)
    g.add_argument("--run-timeout", type=float, default=7200.0)
    g.add_argument("--no-bench", action="store_true", help="skip the per-call emulator timing at the end")
    g = parser.add_argument_group("outputs")
    g.add_argument("--json", metavar="OUT", help="write everything as JSON (rewritten after every run)")
    g.add_argument("--plot", metavar="OUT.png", help="plot the curves")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("--replot", metavar="JSON", help="only print the tables of (and, with --plot, plot) an "
                   "earlier --json output; trains nothing")
    parser.set_defaults(run=run)


def _device_defaults(args) -> None:
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def replot(args: argparse.Namespace) -> int:
    """Tables and plot of an earlier JSON (the summary, sweep and fidelity rows recomputed from its runs)."""
    with open(args.replot) as f:
        doc = json.load(f)
    if doc.get("schema") != SCHEMA:
        raise SystemExit(f"--replot {args.replot}: not a {SCHEMA} file")
    doc["summary"] = summarize(doc["runs"])
    doc["gradient_fidelity"] = [row for r in doc["runs"] for row in r.get("gradient_fidelity", [])]
    doc["lr_sweep"] = lr_sweep_rows(doc["runs"], doc.get("lr_sweep_run", "echo4"), doc["train"]["lr"])
    print(report(doc))
    if args.plot:
        plot_curves(doc, args.plot)
        _log(f"wrote {args.plot}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.replot:
        return replot(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    _device_defaults(args)
    started = time.time()
    deadline = started + args.deadline if args.deadline else None
    torch.set_num_threads(max(1, args.threads))
    runs = build_runs(args)
    corpus = load_corpus(args.data, _val_plays(args))
    _log(f"data: {len(corpus.train_files)} plays, {corpus.train.numel()} training bytes; validation "
         f"{', '.join(corpus.val_files)}: {corpus.val.numel()} bytes")
    _log("runs: " + ", ".join(r.name for r in runs))
    results = []
    state = {"info": None}

    def write_outputs(final: bool):
        info = state["info"]
        if info is None:
            return
        doc = make_doc(args, runs, corpus, info, results, time.time() - started)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(doc, f, indent=None, separators=(",", ":"))
                f.write("\n")
            os.replace(tmp, args.json)
        if final:
            print(report(doc))
            if args.plot and results:
                os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
                plot_curves(doc, args.plot)
                _log(f"wrote {args.plot}")
            if args.json:
                _log(f"wrote {args.json}")

    def on_result(msg):
        kind, payload = msg
        if kind == "info":
            state["info"] = payload
        else:
            results.append(payload)
            r = payload
            _log(f"[{r['name']}] done: tail-100 {_f(r['tail100'])}, final val {_f(r['final_val_loss'])}, "
                 f"{r['ms_per_step']:.1f} ms/step")
            write_outputs(final=False)

    if args.workers > 1:
        info = run_in_workers(args, runs, corpus, on_result, deadline)
    else:
        info = run_in_process(args, runs, corpus, on_result, deadline)
    state["info"] = info
    order = {r.name: i for i, r in enumerate(runs)}
    results.sort(key=lambda r: order[r["name"]])
    if not args.no_bench:
        state["info"]["site_bench"] = bench_sites(args, runs)
    write_outputs(final=True)
    return 0 if len(results) == len(runs) else 1


def make_doc(args, runs, corpus, info, results, seconds) -> dict:
    s = info.get("settings")
    steps = info["steps"]
    fidelity = [row for r in results for row in r.get("gradient_fidelity", [])]
    sweep = lr_sweep_rows(results, args.lr_sweep_run, args.lr)
    num_params = info.get("num_params")
    title = (f"{args.arch} {args.layers}x{args.hidden} ({num_params / 1e6:.1f}M params) on Shakespeare bytes, "
             f"P={args.tp}, {steps} steps x {args.batch_size}x{args.seq_len} tokens, peak LR {args.lr:g}, "
             f"{args.device} {args.dtype}") if num_params else "pretrain"
    machine = {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
               "python": platform.python_version()}
    if args.device == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers
        machine["transformers"] = transformers.__version__
    except ImportError:
        pass
    return {
        "schema": SCHEMA,
        "title": title,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": getattr(args, "command_line", None),
        "machine": machine,
        "device": args.device,
        "dtype": args.dtype,
        "seconds": seconds,
        "model": {"arch": args.arch, "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                  "kv_heads": args.kv_heads, "head_dim": args.head_dim, "intermediate": args.intermediate,
                  "vocab_size": ByteTokenizer.vocab_size, "num_params": num_params, "init": "transformers "
                  "default (normal, std 0.02), seed --seed"},
        "tokenizer": ByteTokenizer.name,
        "data": {"directory": corpus.directory, "train_files": corpus.train_files, "val_files": corpus.val_files,
                 "train_tokens": int(corpus.train.numel()), "val_tokens_per_eval": args.val_tokens,
                 "sha256": corpus.sha256},
        "train": {"steps": steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                  "tokens_per_step": args.batch_size * args.seq_len, "lr": args.lr, "warmup": args.warmup,
                  "min_lr_ratio": args.min_lr_ratio, "schedule": "linear warm-up, cosine decay",
                  "optimizer": {"name": "AdamW", "betas": [args.beta1, args.beta2], "eps": args.adam_eps,
                                "weight_decay": args.weight_decay, "grad_clip": args.grad_clip},
                  "seed": args.seed, "eval_interval": s.eval_interval if s else None,
                  "grad_check_steps": list(s.grad_check_steps) if s else None,
                  "passes": "one micro-batch per step; compensators reset at the start of every pass"},
        "tp": info.get("tp"),
        "workers": info.get("workers", 1),
        "schedule": info.get("schedule"),
        "assignment": info.get("assignment"),
        "failed_workers": info.get("failed_workers"),
        "calibration": info.get("calibration"),
        "site_bench": info.get("site_bench"),
        "runs": results,
        "summary": summarize(results),
        "gradient_fidelity": fidelity,
        "lr_sweep": sweep,
        "lr_sweep_run": args.lr_sweep_run,
    }


def report(doc: dict) -> str:
    out = [f"## {doc['title']}", ""]
    tp = doc.get("tp") or {}
    if tp:
        out.append(f"- {tp['num_forward_sites']} forward sites (o_proj, down_proj outputs) and "
                   f"{tp['num_backward_sites']} backward sites (q/k/v and gate/up input gradients) per pass; "
                   "compensators reset at the start of every pass")
    out += ["", markdown_table(doc["summary"])]
    if doc["gradient_fidelity"]:
        out += ["", "Gradient fidelity (the 16bit run's weights, the batch of that step):", "",
                fidelity_table(doc["gradient_fidelity"])]
    if doc["lr_sweep"]:
        out += ["", f"LR sweep of {doc['lr_sweep_run']} (tail-100 training loss):", "",
                lr_sweep_table(doc["lr_sweep"], doc["train"]["lr"])]
    if doc.get("site_bench"):
        out += ["", "Emulator cost per call at the training message size:", "",
                "| run | direction | shape | ms/call |", "|---|---|---|---:|"]
        out += [f"| {r['run']} | {r['direction']} | {r['shape']} | {r['ms_per_call']:.2f} |" for r in doc["site_bench"]]
    return "\n".join(out)


def main(argv: list | None = None) -> int:
    """``python -m echo_ds.eval.pretrain ...``: the same as ``python -m echo_ds.eval pretrain ...``."""
    import shlex
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m echo_ds.eval pretrain", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = "python -m echo_ds.eval pretrain " + shlex.join(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
