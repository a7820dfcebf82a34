"""Issue 33: the published low-bit tensor-parallel all-reduces (echo_ds/eval/peers.py) next to Echo, on
SmolLM2-135M on the CPU, three texts, through accuracy_study.py. Rows: every peer format, the paper's
Echo (ds_configs/eval/4bit_full.json), the library's default at 4 and at 8 bits; columns: bits per value,
perplexity change per text, mean KL, mean top-1 agreement (``--report``).

    python benchmarks/peer_study.py --threads 1 --tokens 512 --json docs/results/peer_study_tp4.json
    python benchmarks/peer_study.py --threads 1 --tokens 512 --tp 2 \
        --variants default_4bit,default_8bit,dong_int4_outliers,quickreduce_int8,quickreduce_int4 \
        --json docs/results/peer_study_tp2.json           (likewise --tp 8, peer_study_tp8.json)
    python benchmarks/peer_study.py --report docs/results/peer_study_tp4.json \
        --plot docs/results/peer_study_tp4.png            (the table and the plot of a finished run)
    (texts from $ECHO_SHAKESPEARE_DIR or ./.data/shakespeare)
"""
from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

import accuracy_study as AS  # benchmarks/: puts the repository on sys.path
from echo_ds.config import EchoConfig
from echo_ds.eval import perplexity as PPL
from echo_ds.eval.peers import PEERS, PeerFormat, PeerTPEmulator

kRepo = Path(__file__).resolve().parents[1]
kPaperConfig = kRepo / "ds_configs" / "eval" / "4bit_full.json"

ECHO_VARIANTS = {
    "default_4bit": "the library's default (zero_aware_int, g = 64, Hadamard, residual local, compensated)",
    "default_8bit": "the library's default at 8 bits",
    "paper_echo": "the paper's method (ds_configs/eval/4bit_full.json: zero_aware, g = 128, no rotation, "
                  "residual output, gain 0.75)",
}
# Not a peer as it runs: vLLM's int8 format with round to nearest instead of the kernel's truncation, to
# tell how much of that peer's error is its rounding.
WHAT_IF = {"vllm_int8_rne": PeerFormat(
    "vllm_int8_rne", "kraken", 8, 256, 32, True,
    "what-if, not a peer as it runs: vLLM's int8 format rounded to nearest instead of truncated (8.125 bits)",
    "vLLM pull request 39783 with torch.round in place of the kernel's float-to-int8 cast",
    {"code": "int8_rne", "inverse_scale": False})}
FORMATS = dict(PEERS, **WHAT_IF)
VARIANTS = dict(ECHO_VARIANTS, **{name: fmt.description for name, fmt in FORMATS.items()})
DEFAULT_VARIANTS = tuple(VARIANTS)


class PeerStudyEmulator(PeerTPEmulator):
    """accuracy_study's StudyEmulator on top of PeerTPEmulator (the studies here install no settings)."""

    def __init__(self, model, world_size: int, switch):
        super().__init__(model, world_size)
        self.switch = switch
        self.setting_of = {}


def make_variant(name: str, base: EchoConfig):
    if name == "default_4bit":
        return base, ECHO_VARIANTS[name], None
    if name == "default_8bit":
        return AS.config_with(base, bits=8), ECHO_VARIANTS[name], None
    if name == "paper_echo":
        return PPL.load_echo_config(str(kPaperConfig))[0], ECHO_VARIANTS[name], None
    return FORMATS[name], FORMATS[name].description, None


def annotate(r: dict) -> None:
    r.update(family="peer" if r["name"] in PEERS else "what-if" if r["name"] in WHAT_IF else "echo")


# ----------------------------------------------------------------------------------------------------
# The report: one row per variant over the texts of one or more runs
# ----------------------------------------------------------------------------------------------------

def summarize(doc: dict) -> dict:
    """variant -> {bits, family, ppl {text: change %}, kl {text: KL}, top1 {text: agreement}}."""
    out = {}
    for run in doc["runs"]:
        for r in run["results"][1:]:
            v = out.setdefault(r["name"], dict(bits=r["wire_bits_per_element"], family=r.get("family", "echo"),
                                               ppl={}, kl={}, top1={}))
            v["ppl"][run["text"]] = 100.0 * r["ppl_rel_change"]
            v["kl"][run["text"]] = r["kl"]
            v["top1"][run["text"]] = r["top1_agreement"]
    for v in out.values():
        v["mean_kl"] = sum(v["kl"].values()) / len(v["kl"])
        v["mean_top1"] = sum(v["top1"].values()) / len(v["top1"])
    return out


def report(path: str, plot: str | None) -> None:
    doc = json.loads(Path(path).read_text())
    rows = summarize(doc)
    texts = [run["text"] for run in doc["runs"]]
    print(f"P = {doc['tp']}, {doc['tokens']} tokens per text, seq-len {doc['seq_len']} ({path})\n")
    print("| variant | bits/value | " + " | ".join(texts) + " | mean KL | mean top-1 |")
    print("|---|---:|" + "---:|" * len(texts) + "---:|---:|")
    for name, v in sorted(rows.items(), key=lambda kv: (kv[1]["bits"], kv[1]["mean_kl"])):
        cells = " | ".join(f"{v['ppl'][t]:+.2f} %" if t in v["ppl"] else "-" for t in texts)
        print(f"| {name} | {v['bits']:.3f} | {cells} | {v['mean_kl']:.4f} | {100 * v['mean_top1']:.1f} % |")
    if plot:
        draw(rows, doc, plot)
        print(f"\nwrote {plot}")


def draw(rows: dict, doc: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i, (name, v) in enumerate(sorted(rows.items(), key=lambda kv: (kv[1]["bits"], kv[1]["mean_kl"]))):
        ours = v["family"] == "echo"
        color = ("tab:red" if name.startswith("default") else "tab:orange" if ours
                 else "tab:blue" if v["family"] == "peer" else "tab:gray")
        ax.scatter(v["bits"], v["mean_kl"], color=color, marker="o" if ours else "s", s=30, zorder=3)
        ax.annotate(name, (v["bits"], v["mean_kl"]), fontsize=7, xytext=(5, 3 if i % 2 else -9),
                    textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("bits on the wire per value (codes + per-group parameters)")
    ax.set_ylabel(f"mean KL(16-bit || variant), nats per token, over {len(doc['runs'])} texts")
    ax.set_title("\n".join(textwrap.wrap(f"{doc['model']}, emulated P = {doc['tp']}, {doc['tokens']} tokens of "
                                          f"each text", 100))
                 + "\nred: our default; orange: the paper's Echo; blue squares: the peers; grey: a what-if",
                 fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    AS.add_arguments(ap, VARIANTS, DEFAULT_VARIANTS)
    ap.add_argument("--report", metavar="JSON", help="print the table of a finished run (and --plot it)")
    ap.add_argument("--plot", metavar="PNG", help="with --report: mean KL against bits per value")
    args = ap.parse_args()
    if args.report:
        report(args.report, args.plot)
        return 0
    names = AS.variant_names(args, VARIANTS)
    AS.StudyEmulator = PeerStudyEmulator  # this process only: the study's emulator also runs the peers
    return AS.run(args, names, make_variant, lambda setting: None, annotate, lambda: None,
                  dict(variants={n: VARIANTS[n] for n in names},
                       peers={n: FORMATS[n].model_dump() for n in names if n in FORMATS}))


if __name__ == "__main__":
    raise SystemExit(main())
