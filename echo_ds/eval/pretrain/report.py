"""The outputs of a pretraining invocation: progress lines, the JSON document, its tables and plot, ``--replot``."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys

import torch

from echo_ds.eval.pretrain.corpus import ByteTokenizer
from echo_ds.eval.pretrain.runs import BASELINE_NAME
from echo_ds.eval.pretrain.train import kTailSteps

SCHEMA = "echo_ds.eval.pretrain/1"


def log(msg: str) -> None:
    """A progress line (stderr; the tables go to stdout)."""
    print(msg, file=sys.stderr, flush=True)


def write_json(doc: dict, path: str) -> None:
    """``doc`` as compact JSON at ``path``, replaced in one step (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=None, separators=(",", ":"))
        f.write("\n")
    os.replace(tmp, path)


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


def fmt(v, spec="{:.4f}"):
    """``v`` in ``spec``, or a dash for None."""
    return "—" if v is None else spec.format(v)


def markdown_table(rows: list) -> str:
    lines = ["| run | peak LR | wire bits/elem fwd, bwd | tail-100 train | vs 16bit | final val | vs 16bit "
             "| final val, exact fwd | vs 16bit | ms/step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = r["name"] + (f" (diverged at {r['diverged_at']})" if r["diverged_at"] is not None else "")
        lines.append(f"| {name} | {r['lr']:g} | {r['wire_bits_forward']:.2f}, {r['wire_bits_backward']:.2f} "
                     f"| {fmt(r['tail100'])} | {fmt(r['tail100_pct'], '{:+.2f}%')} | {fmt(r['final_val'])} "
                     f"| {fmt(r['final_val_pct'], '{:+.2f}%')} | {fmt(r['final_val_exact_forward'])} "
                     f"| {fmt(r['final_val_exact_forward_pct'], '{:+.2f}%')} | {r['ms_per_step']:.1f} |")
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
             "| tail-100 loss | " + " | ".join(fmt(r["tail100"]) for r in rows) + " |",
             f"| Δ to LR {main_lr:g} | " + " | ".join(fmt(r["delta_to_main_lr"], "{:+.4f}") for r in rows) + " |",
             "| final val | " + " | ".join(fmt(r["final_val"]) for r in rows) + " |"]
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


def make_doc(args, corpus, info, results, seconds) -> dict:
    """The JSON document of an invocation: its settings, ``info`` (from the scheduler) and the ``results`` so far."""
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


def markdown_report(doc: dict) -> str:
    """The printed report: the summary table, gradient fidelity, LR sweep and emulator cost."""
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


def replot(args) -> int:
    """Tables and plot of an earlier JSON (the summary, sweep and fidelity rows recomputed from its runs)."""
    with open(args.replot) as f:
        doc = json.load(f)
    if doc.get("schema") != SCHEMA:
        raise SystemExit(f"--replot {args.replot}: not a {SCHEMA} file")
    doc["summary"] = summarize(doc["runs"])
    doc["gradient_fidelity"] = [row for r in doc["runs"] for row in r.get("gradient_fidelity", [])]
    doc["lr_sweep"] = lr_sweep_rows(doc["runs"], doc.get("lr_sweep_run", "echo4"), doc["train"]["lr"])
    print(markdown_report(doc))
    if args.plot:
        plot_curves(doc, args.plot)
        log(f"wrote {args.plot}")
    return 0
