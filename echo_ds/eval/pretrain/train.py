"""Training one run with Echo at every TP site: the trainer, its gradient fidelity check and its timings."""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from dataclasses import dataclass

import torch

from echo_ds.eval.pretrain.corpus import Corpus, train_batch, val_batches
from echo_ds.eval.pretrain.model import build_model, loss_of, lr_at, make_optimizer
from echo_ds.eval.pretrain.runs import RunSpec, parse_floats

kTailSteps = 100                 # Table 7's tail-100


def device_defaults(args) -> None:
    """TF32 matrix products on CUDA (every process that trains)."""
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


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
        """Train ``spec`` for ``s.steps`` steps; the result dict of the run (an entry of the JSON's ``runs``).

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


def tp_info(trainer: Trainer) -> dict:
    from echo_ds.eval.tp_backward import describe_column_partitions
    from echo_ds.eval.tp_emulation import describe_partitions
    return {"world_size": trainer.args.tp,
            "num_forward_sites": trainer.tp.num_forward_sites,
            "num_backward_sites": trainer.tp.num_backward_sites,
            "forward_partitions": describe_partitions(trainer.tp.forward_sites.plans),
            "backward_partitions": describe_column_partitions(trainer.tp.backward_sites.plans)}


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
