"""Issue 34: the compensator's state stored narrow (echo_ds/compensator.py, "Storage": ``state_dtype``
"int8" / "int4", integers with one power-of-two exponent per group) against today's bf16 state, at the
collective's 4 and 8 bits. SmolLM2-135M at P = 4 on the CPU, three texts, through accuracy_study.py; each
variant is the library's default config with ``bits`` and the two directions' ``state_dtype`` set (the
forward one is what the evaluation exercises). "int3" and "int2" are the "int4" format at 3 and 2 bits
(the study switches the library's bit table while they run): how much margin the 4 bits leave.

    python benchmarks/state_narrow_study.py --json docs/results/state_narrow_study.json
    (texts from $ECHO_SHAKESPEARE_DIR or ./.data/shakespeare)

benchmarks/state_dtype_study.py compared fake-quantized storages (fp32, fp16, a symmetric int8 through the
collective's quantizer) on one text; this study runs the library's own formats.
"""
from __future__ import annotations

import argparse

import accuracy_study as AS  # benchmarks/: puts the repository on sys.path
from echo_ds import compensator as C
from echo_ds.config import EchoConfig

# name -> (collective bits, state_dtype, bits of the "int4" format while it runs or None)
VARIANTS = {
    "4bit_bf16": (4, "bf16", None),
    "4bit_int8": (4, "int8", None),
    "4bit_int4": (4, "int4", None),
    "4bit_int3": (4, "int4", 3),
    "4bit_int2": (4, "int4", 2),
    "4bit_uncompensated": (4, None, None),
    "8bit_bf16": (8, "bf16", None),
    "8bit_int8": (8, "int8", None),
    "8bit_int4": (8, "int4", None),
}
DEFAULT_VARIANTS = ("4bit_bf16", "4bit_int8", "4bit_int4", "4bit_int3", "8bit_bf16", "8bit_int8", "8bit_int4")
kInt4Bits = C.kStateBits["int4"]


def make_variant(name: str, base: EchoConfig):
    bits, state_dtype, int4_bits = VARIANTS[name]
    if state_dtype is None:
        return AS.config_with(base, bits=bits, forward=dict(base.forward.model_dump(), compensate=False)), \
            f"{bits}-bit collective, no compensation", None
    directions = {d: dict(getattr(base, d).model_dump(), state_dtype=state_dtype) for d in ("forward", "backward")}
    shown = state_dtype if int4_bits is None else f"int{int4_bits}"
    return AS.config_with(base, bits=bits, **directions), f"{bits}-bit collective, state {shown}", int4_bits


def switch(int4_bits) -> None:
    C.kStateBits["int4"] = kInt4Bits if int4_bits is None else int4_bits


def annotate(r: dict) -> None:
    bits, state_dtype, int4_bits = VARIANTS[r["name"]]
    r.update(state_dtype=state_dtype, state_bits=int4_bits or (C.kStateBits.get(state_dtype) if state_dtype
                                                               not in (None, "bf16") else None))
    if state_dtype is not None:
        g = r["echo"]["group_size"]
        per = (2 * (int4_bits or 4) / 8 + 1 / g) if int4_bits else C.state_bytes_per_element(state_dtype, g)
        r["state_bytes_per_element_per_call"] = 2 * per  # read once, written once


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    AS.add_arguments(ap, VARIANTS, DEFAULT_VARIANTS)
    args = ap.parse_args()
    names = AS.variant_names(args, VARIANTS)
    try:
        return AS.run(args, names, make_variant, switch, annotate, lambda: None,
                      dict(variants={n: dict(zip(("bits", "state_dtype", "int4_bits"), VARIANTS[n])) for n in names}))
    finally:
        switch(None)


if __name__ == "__main__":
    raise SystemExit(main())
