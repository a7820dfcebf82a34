"""All-reduce latency table in nccl-tests' shape: every implementation in the same loop and run.

GPU node, P ranks (NCCL; keep NVLink multicast off):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      torchrun --nproc_per_node 4 benchmarks/bench_allreduce.py --min-bytes 4K --max-bytes 1G --factor 4

CPU dry run (gloo, small sizes; checks the script and the correctness column, not the speed):

    torchrun --nproc_per_node 2 benchmarks/bench_allreduce.py --device cpu --min-bytes 4K --max-bytes 1M \\
      --iters 5 --warmup 2

Rows (bf16 messages of the given size per rank):

* ``nccl-16``: ``dist.all_reduce`` of the bf16 tensor (gloo on CPU);
* ``2coll-8`` / ``2coll-4``: the two-collective quantized all-reduce (quantized ``all_to_all_single``
  then ``all_gather`` of the reduced codes, ZeRO++ style) -- this is echo_ds's reference path without
  compensation;
* ``p2p-8`` / ``p2p-4``: Echo's peer-to-peer pipeline without compensation;
* ``p2p-4+unfused``: the compensator as separate PyTorch operations around the uncompensated call;
* ``p2p-4+fused``: the compensator fused into the entry pass, its update beside the next matrix
  product; reported as the critical-path time (matmul + all-reduce + matmul minus matmul + matmul);
  both compensated rows store the state as "bf16" (the unfused one holds it as one flat tensor, not in
  the collective's groups by which the integer formats scale it);
* ``p2p-4+rot``: with the Hadamard rotation.

The p2p rows need the CUDA kernels and peer access; where the backend is unavailable they are left out
with the reason printed once. Columns: size, time (median, us), spread (p10-p90, us), algbw and busbw
(GB/s; busbw = algbw x 2(P-1)/P), and the max abs difference against the reference path's result for
the same inputs (0 means bit-identical; for nccl-16 against the fp32 sum).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from echo_ds import collective
from echo_ds.compensator import make_compensator
from echo_ds.config import DirectionConfig
from echo_ds.quant import QuantSpec
from echo_ds.reference import echo_all_reduce


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def sizes(args):
    n = args.min_bytes
    while n <= args.max_bytes:
        yield n
        n *= args.factor


class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def time(self, fn, iters, warmup):
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e6)
        samples.sort()
        q = lambda p: samples[min(len(samples) - 1, int(p * len(samples)))]  # noqa: E731
        return statistics.median(samples), q(0.1), q(0.9)


def unfused_compensated(call, cfg: DirectionConfig):
    """The compensator as separate PyTorch ops around an uncompensated call (the paper's unfused row)."""
    comp = make_compensator(cfg)
    P = dist.get_world_size()

    def run(x):
        c = comp.correction((x.numel(),), x.device)
        x_prime = x.float().reshape(-1) + c
        y = call(x_prime.to(x.dtype).view_as(x))
        comp.update(x_prime - y.float().reshape(-1) / P)
        return y

    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-bytes", type=parse_size, default=parse_size("4K"))
    p.add_argument("--max-bytes", type=parse_size, default=parse_size("1G"))
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=80)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", default="nccl-16,2coll-8,2coll-4,p2p-8,p2p-4,p2p-4+unfused,p2p-4+fused,p2p-4+rot")
    p.add_argument("--matmul", type=int, default=8192, help="square matmul size for the fused row")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, local_rank) if args.device == "cuda" else torch.device("cpu")
    timer = Timer(device)
    rows = args.rows.split(",")

    buffer = None
    if any(r.startswith("p2p") for r in rows):
        try:
            from echo_ds.p2p import EchoBuffer

            buffer = EchoBuffer(max_numel=args.max_bytes // 2)
            if not buffer.active:
                raise RuntimeError(buffer.reason)
        except Exception as e:  # noqa: BLE001 - reported, the other rows still run
            if rank == 0:
                print(f"# p2p rows left out: {type(e).__name__}: {e}", flush=True)
            rows = [r for r in rows if not r.startswith("p2p")]
            buffer = None

    def implementation(row):
        spec = QuantSpec(bits=8 if row.endswith("-8") else 4, rotation=row.endswith("+rot"))  # paper rows
        if row == "nccl-16":
            def run(x):
                y = x.clone()
                dist.all_reduce(y)
                return y
            return run, None
        if row.startswith("2coll"):  # the reference, also where an EchoBuffer is this group's backend
            def reference(x):
                with collective.reference_only():
                    return echo_all_reduce(x, spec)
            return reference, spec
        if row in ("p2p-8", "p2p-4", "p2p-4+rot"):
            return (lambda x: buffer.all_reduce(x, spec)), spec
        if row == "p2p-4+unfused":
            return unfused_compensated(lambda x: buffer.all_reduce(x, spec),
                                       DirectionConfig(residual="output", state_dtype="bf16")), None
        if row == "p2p-4+fused":
            comp = make_compensator(DirectionConfig(residual="output", state_dtype="bf16"))
            return (lambda x: buffer.all_reduce(x, spec, compensator=comp)), None
        raise ValueError(f"unknown row {row!r}")

    results = []
    if rank == 0:
        print(f"# P={P} device={args.device} iters={args.iters} warmup={args.warmup} dtype=bf16")
        print(f"{'size':>10s} {'row':>14s} {'time_us':>10s} {'p10-p90_us':>16s} {'algbw':>8s} {'busbw':>8s} "
              f"{'maxdiff':>10s}", flush=True)
    mm = None
    for nbytes in sizes(args):
        numel = nbytes // 2
        gen = torch.Generator(device="cpu").manual_seed(1000 + rank)
        x = torch.randn(numel, generator=gen).to(device=device, dtype=torch.bfloat16)
        ref = {}
        for row in rows:
            run, spec = implementation(row)
            y = run(x)
            if row == "nccl-16":
                exact = x.float()
                dist.all_reduce(exact)
                diff = (y.float() - exact).abs().max().item()
            elif spec is not None:
                key = (spec.bits, spec.rotation)
                if key not in ref:
                    ref[key] = echo_all_reduce(x, spec)
                diff = (y.float() - ref[key].float()).abs().max().item()
            else:
                diff = float("nan")  # compensated rows carry state: no stateless reference
            if row == "p2p-4+fused" and device.type == "cuda":
                if mm is None:
                    mm = torch.randn(args.matmul, args.matmul, device=device, dtype=torch.bfloat16)
                base = timer.time(lambda: (mm @ mm, mm @ mm), args.iters, args.warmup)[0]
                t, lo, hi = timer.time(lambda: (mm @ mm, run(x), mm @ mm), args.iters, args.warmup)
                t, lo, hi = t - base, lo - base, hi - base
            else:
                t, lo, hi = timer.time(lambda: run(x), args.iters, args.warmup)
            algbw = nbytes / t / 1e3
            busbw = algbw * 2 * (P - 1) / P
            results.append(dict(bytes=nbytes, row=row, time_us=t, p10=lo, p90=hi, algbw=algbw, busbw=busbw,
                                maxdiff=diff))
            if rank == 0:
                print(f"{nbytes:>10d} {row:>14s} {t:>10.1f} {f'{lo:.1f}-{hi:.1f}':>16s} {algbw:>8.2f} "
                      f"{busbw:>8.2f} {diff:>10.3g}", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": P, "device": args.device, "results": results}, f, indent=1)
    if buffer is not None:
        buffer.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
