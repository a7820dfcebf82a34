"""Issue 20, the last lever: the forward compensator's settings re-tuned for the default format
(zero_aware_int at g = 64). SmolLM2-135M at P = 4 on the CPU, three texts, through accuracy_study.py;
each variant changes the default config's forward section (gain, blend, slow_decay, fast_decay) and
nothing else, so the first variant (the default) anchors the noise.

    python benchmarks/compensator_study.py --json docs/results/compensator_study.json
    python benchmarks/compensator_study.py --variants default,fast0,fast0_blend0,fast0_blend0.15,fast0_slow0.5,fast0_slow0.85 \
        --json docs/results/compensator_study_round2.json
    (texts from $ECHO_SHAKESPEARE_DIR or ./.data/shakespeare)
    python benchmarks/compensator_study.py --variants default,blend0 --text tempest=PATH
"""
from __future__ import annotations

import argparse

import accuracy_study as AS  # benchmarks/: puts the repository on sys.path
from echo_ds.config import EchoConfig

# name -> the forward section's changes (the library's defaults: gain 1.0, blend 0.35, slow 0.7, fast 0.3)
VARIANTS = {
    "default": {},
    "blend0": {"blend": 0.0},           # the fast average alone
    "blend1": {"blend": 1.0},           # the slow average alone
    "slow0.9": {"slow_decay": 0.9},
    "slow0.5": {"slow_decay": 0.5},
    "fast0": {"fast_decay": 0.0},       # the fast average = the last error
    "fast0.6": {"fast_decay": 0.6},
    "gain0.9": {"gain": 0.9},
    "uncompensated": {"compensate": False},
    # second round, around the first round's best (fast0)
    "fast0_blend0": {"fast_decay": 0.0, "blend": 0.0},     # the last error alone
    "fast0_blend0.15": {"fast_decay": 0.0, "blend": 0.15},
    "fast0_slow0.5": {"fast_decay": 0.0, "slow_decay": 0.5},
    "fast0_slow0.85": {"fast_decay": 0.0, "slow_decay": 0.85},
}
DEFAULT_VARIANTS = ("default", "blend0", "blend1", "slow0.9", "slow0.5", "fast0", "fast0.6", "gain0.9", "uncompensated")


def make_variant(name: str, base: EchoConfig):
    changes = VARIANTS[name]
    forward = dict(base.forward.model_dump(), **changes)
    described = ", ".join(f"{k} {v}" for k, v in changes.items()) or "the default forward section"
    return AS.config_with(base, forward=forward), described, None


def annotate(r: dict) -> None:
    r.update(forward_changes=VARIANTS[r["name"]])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    AS.add_arguments(ap, VARIANTS, DEFAULT_VARIANTS)
    args = ap.parse_args()
    names = AS.variant_names(args, VARIANTS)
    return AS.run(args, names, make_variant, lambda setting: None, annotate, lambda: None,
                  dict(variants={n: VARIANTS[n] for n in names}))


if __name__ == "__main__":
    raise SystemExit(main())
