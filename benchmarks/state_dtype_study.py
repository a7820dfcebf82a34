"""What storing the compensator's state in fewer bytes costs in accuracy (the choice of the state format).

The compensator keeps two moving averages (m1, m2) per rank; under ``state_dtype`` "bf16" the library
stores them as bf16 and computes in fp32 (echo_ds/compensator.py, "Storage"). This study compares that
with the arithmetic in fp32 and what is *stored* rounded through other formats after every update (or, for
``corr_bf16``, only a precomputed correction). Every variant runs its configs with ``state_dtype`` "bf16"
in both directions (the library's default is "int4": benchmarks/state_narrow_study.py compares the
formats the library holds):

    shipped        the library's own Compensator with state_dtype "bf16" (bf16 m1, m2; non-finite stored as +0)
    fp32           no rounding at all (the format before the bf16 storage)
    bf16, fp16     m1, m2 rounded to nearest even after each update (2 bytes/element each)
    int8           m1, m2 as 8-bit symmetric codes per group through the collective's own quantizer (fp16
                   scale and zero point, as LoCo keeps its error buffers; ~1 byte/element each)
    corr_bf16      fp32 state; the correction c rounded to bf16 before it is added

Everything else is ``python -m echo_ds.eval perplexity``, plus the relative error of every emulated
all-reduce against the exact sum (sqrt of summed squared errors over summed squared sums, all sites and
sequences): a less noisy measure than perplexity of what the storage does to the collective. SmolLM2-135M,
emulated TP at P = 4, the same 4096 tokens, KL and top-1 against the 16-bit model. Run from the repository
root (CPU):

    python benchmarks/state_dtype_study.py --json docs/results/state_dtype_study.json

The variants other than "shipped" live here, not in the library.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo_ds import quant as Q  # noqa: E402
from echo_ds.compensator import Compensator  # noqa: E402
from echo_ds.eval import perplexity as PPL  # noqa: E402
from echo_ds.eval.tp_emulation import TPEmulator  # noqa: E402

STORAGES = ("shipped", "fp32", "bf16", "fp16", "int8", "corr_bf16")
DEFAULT_CONFIGS = (
    "ds_configs/eval/4bit_hadamard_local_gain1.0_g128.json",  # the shipped default (residual local)
    "ds_configs/eval/4bit_full.json",                         # the paper's method (residual output)
    "ds_configs/eval/8bit_hadamard_local_gain1.0_g128.json",
)


def round_through(t: torch.Tensor, storage: str) -> torch.Tensor:
    """``t`` (fp32, last dim = the collective's group) after a round trip through ``storage``."""
    if storage in ("fp32", "corr_bf16"):
        return t
    if storage == "bf16":
        return t.to(torch.bfloat16).float()
    if storage == "fp16":
        return t.to(torch.float16).float()
    if storage == "int8":
        codes, scale, zero = Q.quantize_groups(t, 8, "symmetric")
        return Q.dequantize_groups(codes, scale, zero, 8)
    raise ValueError(f"unknown storage {storage!r}")


class StoredStateCompensator(Compensator):
    """The compensator's arithmetic with an fp32 state rounded through ``storage`` after every update (or,
    for corr_bf16, its correction), as if kept in it. "shipped" is the library's own Compensator and needs
    no subclass."""

    def __init__(self, cfg, storage: str, telemetry: bool = False):
        super().__init__(cfg, telemetry)
        self.storage = storage

    def _ensure(self, shape, device) -> None:
        if self.m1 is None or tuple(self.m1.shape) != tuple(shape):
            self.m1 = torch.zeros(tuple(shape), dtype=torch.float32, device=device)
            self.m2 = torch.zeros(tuple(shape), dtype=torch.float32, device=device)

    def correction(self, shape, device) -> torch.Tensor:
        self._ensure(shape, device)
        c = ((self.m1 * self.blend) + (self.m2 * self.one_minus_blend)) * self.gain
        return round_through(c, "bf16") if self.storage == "corr_bf16" else c

    def update(self, u: torch.Tensor) -> None:
        self.m1 = round_through(self.m1 * self.slow_decay + u * self.one_minus_slow, self.storage)
        self.m2 = round_through(self.m2 * self.fast_decay + u * self.one_minus_fast, self.storage)
        self.num_calls += 1


class StudyEmulator(TPEmulator):
    """TPEmulator whose compensators store their state through the variant's storage."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.storage_of = {}  # id(config) -> storage
        self.error_sq = {}    # id(config) -> [sum |y - exact|^2, sum |exact|^2] over every reduce

    def reduce(self, parts: torch.Tensor, site_index: int, direction: str = "forward") -> torch.Tensor:
        y = super().reduce(parts, site_index, direction)
        if self.config is not None:
            exact = parts.double().sum(0)
            acc = self.error_sq.setdefault(id(self.config), [0.0, 0.0])
            acc[0] += float((y.double() - exact).square().sum())
            acc[1] += float(exact.square().sum())
        return y

    def _op(self, direction: str):
        fresh = direction not in self._ops
        op = super()._op(direction)
        if fresh and op.compensator is not None and self.storage_of[id(self.config)] != "shipped":
            storage = self.storage_of[id(self.config)]
            old = op.compensator
            op.compensator = StoredStateCompensator(old.cfg, storage, telemetry=old.telemetry)
        return op


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", default=[], help="echo config JSON (repeatable)")
    ap.add_argument("--storage", default=",".join(STORAGES), help=f"comma-separated subset of {STORAGES}")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    storages = args.storage.split(",")
    for s in storages:
        if s not in STORAGES:
            raise SystemExit(f"--storage: unknown {s!r} (choose from {STORAGES})")

    from echo_ds.eval.models import load_model

    loaded = load_model("smollm2", dtype=torch.float32, device="cpu")
    text = PPL.read_text(PPL.kDefaultText)
    sequences = PPL.tokenize_sequences(loaded.tokenizer, text, args.tokens, args.seq_len)
    variants = []
    with StudyEmulator(loaded.model, args.tp) as tp:
        for path in args.config or DEFAULT_CONFIGS:
            base, _ = PPL.load_echo_config(path)
            for storage in storages:
                cfg = base.model_copy(deep=True)
                # "shipped" is the library's bf16 state, and the other variants hold m1, m2, which
                # Compensator.reset clears by the names of "bf16" (state_names)
                cfg.forward.state_dtype = cfg.backward.state_dtype = "bf16"
                tp.storage_of[id(cfg)] = storage
                name = f"{Path(path).stem}[{storage}]"
                variants.append(PPL.Variant(name, cfg, path, f"state stored as {storage}"))
        results = PPL.evaluate(loaded.model, tp, sequences, variants)
    print("| config | state stored as | ppl | KL | top-1 | all-reduce rel. error |")
    print("|---|---|---:|---:|---:|---:|")
    for r, v in zip(results[1:], variants):
        r["storage"] = tp.storage_of[id(v.config)]
        err, ref = tp.error_sq[id(v.config)]
        r["allreduce_rel_error"] = (err / ref) ** 0.5
        print(f"| {Path(v.source).stem} | {r['storage']} | {r['ppl']:.3f} | {r['kl']:.4f} | "
              f"{100 * r['top1_agreement']:.1f}% | {r['allreduce_rel_error']:.5f} |")
    print(f"16-bit perplexity: {results[0]['ppl']:.3f}")
    if args.json:
        doc = dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                   command="python " + " ".join(sys.argv), model=loaded.name, tokens=args.tokens,
                   seq_len=args.seq_len, tp=args.tp, machine=platform.platform(), torch=torch.__version__,
                   results=results)
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
