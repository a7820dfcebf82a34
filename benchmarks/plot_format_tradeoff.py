"""Bits per value on the wire against accuracy, for every 4-bit format the accuracy studies measured
(docs/results/param_format_study*.json, docs/results/grid_study*.json, zero_aware_int_study.json, and the
default format with the compensator study's best forward settings; SmolLM2-135M, P = 4, three texts):
the worst text's perplexity change (the goal is +5 % on every text) and the mean KL over the texts.

    python benchmarks/plot_format_tradeoff.py --out docs/results/format_tradeoff.png
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("docs/results/param_format_study*.json", "docs/results/grid_study.json",
           "docs/results/grid_study_g64_*.json", "docs/results/zero_aware_int_study.json")
# The same format under another name (their rows reproduce each other to the digit): the second study's
# uniform grids, and the first study's 12 + 4 bit format, which the library ships as "zero_aware_int".
ALIASES = {"g128_uniform": "g128_fp16", "g64_uniform": "g64_fp16", "g64_ue5m7_uint4": "g64_zero_aware_int"}
# Rows of other studies that are formats with another setting: (file, row) -> the name plotted.
EXTRA = {("docs/results/compensator_study_round2.json", "fast0_blend0.15"): "g64_zero_aware_int_fast0_blend0.15"}
DEFAULT = "g64_zero_aware_int"  # the shipped default (red)


def collect() -> dict:
    """variant -> {"bits": b, "worst_ppl": max over texts of the change in %, "mean_kl": ...}."""
    per = {}

    def add(name: str, text: str, r: dict) -> None:
        v = per.setdefault(name, {"bits": r["wire_bits_per_element"], "ppl": {}, "kl": {}})
        v["ppl"][text] = 100 * r["ppl_rel_change"]
        v["kl"][text] = r["kl"]

    for pattern in SOURCES:
        for f in sorted(glob.glob(str(REPO / pattern))):
            for run in json.loads(Path(f).read_text())["runs"]:
                for r in run["results"][1:]:
                    if r["name"] not in ALIASES:
                        add(r["name"], run["text"], r)
    for (f, row), name in EXTRA.items():
        for run in json.loads((REPO / f).read_text())["runs"]:
            add(name, run["text"], next(r for r in run["results"] if r["name"] == row))
    return {n: dict(bits=v["bits"], worst_ppl=max(v["ppl"].values()), mean_kl=sum(v["kl"].values()) / len(v["kl"]))
            for n, v in per.items() if len(v["ppl"]) == 3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/results/format_tradeoff.png")
    args = ap.parse_args()
    points = collect()
    print("| variant | bits/value | worst text's perplexity change | mean KL |")
    print("|---|---:|---:|---:|")
    for n, p in sorted(points.items(), key=lambda kv: (kv[1]["bits"], kv[1]["mean_kl"])):
        print(f"| {n} | {p['bits']:.3f} | +{p['worst_ppl']:.2f}% | {p['mean_kl']:.4f} |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label, goal in ((axes[0], "worst_ppl", "worst text's perplexity change (%)", 5.0),
                                 (axes[1], "mean_kl", "mean KL(16-bit || Echo) over the texts", None)):
        for n, p in points.items():
            ax.scatter(p["bits"], p[key], color="C3" if n == DEFAULT else "C0", zorder=3)
            ax.annotate(n, (p["bits"], p[key]), textcoords="offset points", xytext=(4, 2), fontsize=7)
        ax.axvline(4.25, color="gray", linestyle=":", linewidth=1)
        if goal is not None:
            ax.axhline(goal, color="C2", linestyle="--", linewidth=1, label="goal: +5 % on every text")
            ax.legend(loc="upper right", fontsize=8)
        ax.set_xlabel("bits per value on the wire (codes + group parameters)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle("4-bit formats, SmolLM2-135M at P = 4, three texts (red: the default)", fontsize=10)
    fig.tight_layout()
    out = REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
