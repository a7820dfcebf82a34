"""Run each Echo stage (and DeepSpeed's quantizer kernels) once inside an NVTX range, for Nsight Compute.

    ncu --clock-control none --nvtx --nvtx-include "echo_profile/" --set full -o prof \
        python3 benchmarks/profile_kernels.py --bytes 256M

Every op is run once outside the range first (warm-up, lazy loads), then once inside the range "echo_profile";
ncu profiles only the launches inside, in the order printed at the end. Same setup as bench_kernels.py: fp16 x, P = 4, 4-bit, g = 128,
zero-aware. benchmarks/gpu_profile.sh runs it under ncu and prints the reports.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels import G_SIZE, P, load_ds_quantizer, parse_bytes, stage_buffers  # noqa: E402

from echo_ds.quant import QuantSpec  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes", default="256M", help="bytes of the fp16 input")
    ap.add_argument("--ops", default="all", help="comma-separated op names, or all")
    args = ap.parse_args()

    import echo_ds.ops as E
    from echo_ds.compensator import Compensator
    from echo_ds.config import DirectionConfig

    E.load()
    ds, ds_error, _ = load_ds_quantizer()
    if ds is None:
        print("DeepSpeed quantizer unavailable:", ds_error)
    dev = torch.device("cuda")
    n = parse_bytes(args.bytes) // 2
    spec = QuantSpec(bits=4, group_size=G_SIZE, quantizer="zero_aware")
    spec_rot = QuantSpec(bits=4, group_size=G_SIZE, quantizer="zero_aware", rotation=True)
    coeffs = E.CompensatorCoefficients.of(Compensator(DirectionConfig(state_dtype="bf16")))  # stage_buffers' m1, m2
    b = stage_buffers(n, spec, dev)
    layout, x, m1, m2, send, gathered = b.layout, b.x, b.m1, b.m2, b.send, b.gathered
    y, out_tab, gat_tab = b.y, b.out_tab, b.gat_tab
    E.push_quantize(x, rank=0, world_size=P, spec=spec, out=out_tab)
    for j in range(1, P):
        gathered[j].copy_(send[j])

    def entry(s=spec, **kw):
        return lambda: E.push_quantize(x, rank=0, world_size=P, spec=s, out=out_tab, **kw)

    ops = {
        "entry": entry(),
        "entry_comp": entry(m1=m1, m2=m2, coeffs=coeffs),
        "entry_rot": entry(spec_rot),
        "owner_reduce": lambda: E.owner_reduce(x, rank=0, world_size=P, spec=spec,
                                               copies=E.packet_table([None, *send[1:]], layout, spec),
                                               out=E.packet_table([gathered[0], None, None, None], layout, spec)),
        "dequantize": lambda: E.dequantize(y, world_size=P, spec=spec, gathered=gat_tab),
        "dequantize_rot": lambda: E.dequantize(y, world_size=P, spec=spec_rot, gathered=gat_tab),
    }
    if ds is not None:
        groups = n // G_SIZE
        q, params = ds.quantize(x, groups, 4, ds.Asymmetric)
        ops["ds_quantize"] = lambda: ds.quantize(x, groups, 4, ds.Asymmetric)
        ops["ds_dequantize"] = lambda: ds.dequantize(q, params, groups, 4, ds.Asymmetric)
    names = list(ops) if args.ops == "all" else args.ops.split(",")
    unknown = [name for name in names if name not in ops]
    if unknown:
        raise SystemExit(f"--ops: unknown {unknown} (ops here: {', '.join(ops)})")
    for name in names:
        ops[name]()
    torch.cuda.synchronize()
    for name in names:
        torch.cuda.nvtx.range_push("echo_profile")
        ops[name]()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
    print("profiled, in launch order:", ", ".join(names), f"at {n * 2 >> 20} MB")


if __name__ == "__main__":
    main()
