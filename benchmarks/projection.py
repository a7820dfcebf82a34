"""Projection of an Echo call's time to eight separate GPUs, against NCCL's 16-bit ring all-reduce (no GPU
needed): the bytes model (benchmarks/bytes_model.py) at the HBM efficiency measured on one GPU, and the
bytes each rank sends at the link's bandwidth.

    python benchmarks/projection.py                      # 8 x H100 and 8 x H200, 1 MiB to 1 GiB
    python benchmarks/projection.py --machines H200 --factor 4 --json projection.json

The model, per GPU and call (every rank on its own GPU):

* Echo: max(HBM bytes / (copy bandwidth x efficiency), bytes sent / link bandwidth): the kernels overlap
  their HBM traffic with the peer writes (the one launch does all of it in one grid), so the slower of the
  two bounds the call. HBM bytes and bytes sent are the bytes model's (bf16 x, zero_aware_int at g = 64,
  the default configuration; 4 and 8 bits; uncompensated and compensated with residual "local" and the
  default stored state, PROJECTED["state_dtype"]; the measured calls' state was bf16). The
  efficiency is the measured one (below), interpolated in the HBM bytes one GPU moves per call (log-log),
  held at the ends of the measured range; the goal's tables raise it to TARGET_EFFICIENCY wherever a GPU
  moves at least the bytes of a 4 MiB message in the measured setup (issue 36's goal: >= 70 % of the floor
  from 4 MiB). 8-bit calls use the 4-bit efficiency (not measured).
* NCCL: latency + 2 (P - 1) / P x 2 bytes x n / bus bandwidth, the ring all-reduce of 16-bit values. A lower
  bound of NCCL's time: its smallest modelled latency (the LL protocol's) with its largest bus bandwidth
  (the Simple protocol's), so Echo's gains below are conservative, and so is the size below which Echo
  cannot win.

Not modelled: the flags' NVLink round trips (on one GPU they are local memory; the measured efficiency of
small messages includes them there), NVLS (NVLink SHARP, off by assumption), contention between the peer
writes and the HBM traffic of the receiving GPU. The multi-GPU issue checks these figures when a machine with
several GPUs is lent.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bytes_model as BM  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from echo_ds import compensator as C  # noqa: E402
from echo_ds.config import ForwardConfig  # noqa: E402

MIB = 1 << 20

# ----------------------------------------------------------------------------------------------------
# Inputs (one place)
# ----------------------------------------------------------------------------------------------------

# Per-call times measured on ONE H200 with P ranks sharing it under MPS, graph replay (10 back-to-back calls
# per CUDA graph, median of 10 replays), bf16, 4-bit, g = 128, "zero_aware" (fp16 scale and zero-point:
# 68 bytes per group of 128, the same 0.53 bytes per element as "zero_aware_int" at g = 64), Hadamard
# rotation, pow2 off; compensated = the default forward direction (residual "local"). Source:
# benchmarks/RESULTS.md, "One launch per call", the 14:44 UTC run of 2026-12-04 (raw figures:
# benchmarks/runs/2026-12-04_one_launch_1444_bench_p2p.json). Microseconds by message size in bytes.
MEASURED_CONFIG = {"dtype": "bfloat16", "bits": 4, "group_size": 128, "quantizer": "zero_aware", "pow2": False,
                   "residual_compensated": "local", "state_dtype": "bf16"}  # the state format of that day
MEASURED_US: Dict[Tuple[int, str, bool], Dict[int, float]] = {
    # (P, path, compensated): {message bytes: graph-replay us per call}
    (2, "staged", False): {64 << 10: 17.6, 256 << 10: 18.3, 1 << 20: 19.7, 4 << 20: 26.9, 16 << 20: 58.0,
                           64 << 20: 188.6, 256 << 20: 704.7},
    (2, "staged", True): {64 << 10: 20.5, 256 << 10: 21.8, 1 << 20: 23.5, 4 << 20: 36.4, 16 << 20: 89.8,
                          64 << 20: 300.7, 256 << 20: 1135.9},
    (2, "one_launch", False): {64 << 10: 15.0, 256 << 10: 15.1, 1 << 20: 17.0, 4 << 20: 58.0, 16 << 20: 128.6,
                               64 << 20: 387.0, 256 << 20: 1424.3},
    (2, "one_launch", True): {64 << 10: 17.8, 256 << 10: 18.4, 1 << 20: 37.4, 4 << 20: 69.8, 16 << 20: 171.7,
                              64 << 20: 519.8, 256 << 20: 2019.4},
    (4, "staged", False): {64 << 10: 27.6, 256 << 10: 29.8, 1 << 20: 31.2, 4 << 20: 48.6, 16 << 20: 121.3,
                           64 << 20: 391.5, 256 << 20: 1520.2},
    (4, "staged", True): {64 << 10: 30.3, 256 << 10: 31.2, 1 << 20: 40.2, 4 << 20: 74.1, 16 << 20: 198.1,
                          64 << 20: 635.0, 256 << 20: 2410.6},
    (4, "one_launch", False): {64 << 10: 35.3, 256 << 10: 34.2, 1 << 20: 52.2, 4 << 20: 108.3, 16 << 20: 314.4,
                               64 << 20: 1175.6, 256 << 20: 4595.5},
    (4, "one_launch", True): {64 << 10: 45.0, 256 << 10: 39.8, 1 << 20: 70.5, 4 << 20: 156.9, 16 << 20: 486.8,
                              64 << 20: 1843.6, 256 << 20: 7229.9},
}
# The H200's copy bandwidth (read + written bytes per second of a 1 GB device copy): benchmarks/RESULTS.md,
# "Kernels", run of 2026-12-03 21:22 UTC (the 14:44 run measured no copy alone; same machine type).
MEASURED_COPY_BYTES_PER_S = 4.260e12
MEASURED_HBM_PEAK_BYTES_PER_S = 4.8e12  # the H200's HBM3e peak

# The machines: HBM peak (NVIDIA's data sheets: H100 SXM 3.35 TB/s, H200 4.8 TB/s); the copy bandwidth is
# the peak times the fraction the H200 measured (4.260 / 4.8), assumed the same on the H100. Link: NCCL's
# effective NVLink bandwidth per direction with NVLS off, ~370 GB/s of the 450 GB/s line rate on H100
# (NVIDIA/nccl-tests issue 212, the NCCL maintainer's answer: "With the protocol overhead (~20%) NCCL can get
# an effective NVLink bandwidth of 370GB/s, ... when running with NCCL_ALGO=RING"); the H200 has the same
# NVLink 4. Echo's peer writes are assumed to reach the same bandwidth.
MACHINES = {
    "H100": {"hbm_peak_bytes_per_s": 3.35e12, "link_bytes_per_s": 370e9},
    "H200": {"hbm_peak_bytes_per_s": 4.8e12, "link_bytes_per_s": 370e9},
}
WORLD_SIZE = 8
# NCCL's ring all-reduce latency in its own tuning model (NVIDIA/nccl, src/graph/tuning.cc as stored at commit
# 01afd20: baseLat of Ring/LL 3.6 us, hwLat of NVLink Ring/LL 0.47 us per step, 2 (P - 1) steps): 10.2 us at
# P = 8. Its smallest latency (LL); with the Simple protocol's bus bandwidth it bounds NCCL's time from below.
NCCL_BASE_LATENCY_US = 3.6
NCCL_STEP_LATENCY_US = 0.47
NCCL_BUSBW_BYTES_PER_S = 370e9  # as MACHINES' link: NCCL_ALGO=RING busbw (nccl-tests issue 212)
NCCL_ELEMENT_BYTES = 2  # the 16-bit all-reduce Echo replaces

# The projected configuration (the default "echo" section: bf16 activations, zero_aware_int at g = 64, the
# compensator's default stored state format).
PROJECTED = {"dtype": "bfloat16", "group_size": 64, "quantizer": "zero_aware_int", "pow2": False,
             "state_dtype": ForwardConfig().state_dtype}
VARIANTS = ((4, False), (4, True), (8, False), (8, True))  # (bits, compensated)
TARGET_EFFICIENCY = 0.70  # issue 36's goal: >= 70 % of the floor from 4 MiB to 1 GiB
TARGET_MIN_BYTES = 4 * MIB


# ----------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------

def measured_efficiency(P: int, path: str, compensated: bool) -> List[Tuple[int, float, float]]:
    """(message bytes, HBM bytes the GPU moved per call, efficiency = floor / time) of the measured rows:
    the floor counts every rank sharing the GPU (bytes model) at MEASURED_COPY_BYTES_PER_S. path "best": the
    faster of the two paths at each size."""
    paths = ("staged", "one_launch") if path == "best" else (path,)
    out = []
    sizes = sorted(MEASURED_US[(P, paths[0], compensated)])
    cfg = MEASURED_CONFIG
    for size in sizes:
        n = size // BM.element_bytes(cfg["dtype"])
        c = BM.call_bytes(P, n, cfg["dtype"], cfg["bits"], cfg["group_size"], cfg["quantizer"],
                          cfg["residual_compensated"] if compensated else "none", cfg["pow2"],
                          state_bytes_per_element=C.state_bytes_per_element(cfg["state_dtype"], cfg["group_size"]))
        gpu_bytes = P * c.hbm_bytes
        best_us = min(MEASURED_US[(P, p, compensated)][size] for p in paths)
        out.append((size, gpu_bytes, gpu_bytes / MEASURED_COPY_BYTES_PER_S / (best_us * 1e-6)))
    return out


def goal_gpu_bytes(measured_p: int, compensated: bool) -> float:
    """The HBM bytes one GPU moves for a TARGET_MIN_BYTES message in the measured setup (measured_p ranks
    sharing it): where the goal's efficiency applies. The efficiency is a function of the bytes a GPU moves
    per call, so the goal carries over to other world sizes by those bytes, not by the message size."""
    cfg = MEASURED_CONFIG
    c = BM.call_bytes(measured_p, TARGET_MIN_BYTES // BM.element_bytes(cfg["dtype"]), cfg["dtype"], cfg["bits"],
                      cfg["group_size"], cfg["quantizer"], cfg["residual_compensated"] if compensated else "none",
                      cfg["pow2"], state_bytes_per_element=C.state_bytes_per_element(cfg["state_dtype"],
                                                                                   cfg["group_size"]))
    return measured_p * c.hbm_bytes


def interpolate(points: List[Tuple[float, float]], x: float) -> float:
    """y at x from (x, y) points sorted by x, linear in log x and log y; held at the ends."""
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
    raise AssertionError("unreachable")


def nccl_seconds(message_bytes: int, P: int = WORLD_SIZE) -> float:
    """NCCL's ring all-reduce of ``message_bytes`` (16-bit values), a lower bound (module docstring)."""
    latency = (NCCL_BASE_LATENCY_US + 2 * (P - 1) * NCCL_STEP_LATENCY_US) * 1e-6
    return latency + 2 * (P - 1) / P * message_bytes / NCCL_BUSBW_BYTES_PER_S


def echo_seconds(message_bytes: int, machine: str, bits: int, compensated: bool, P: int = WORLD_SIZE,
                 measured_p: int = 2, path: str = "best", target: bool = False) -> Dict[str, float]:
    """Echo's projected call on ``machine``: its HBM time, wire time, efficiency and the time (their max).
    ``message_bytes``: of the 16-bit message (n = message_bytes / 2 elements)."""
    m = MACHINES[machine]
    copy_bw = m["hbm_peak_bytes_per_s"] * MEASURED_COPY_BYTES_PER_S / MEASURED_HBM_PEAK_BYTES_PER_S
    n = message_bytes // BM.element_bytes(PROJECTED["dtype"])
    c = BM.call_bytes(P, n, PROJECTED["dtype"], bits, PROJECTED["group_size"], PROJECTED["quantizer"],
                      "local" if compensated else "none", PROJECTED["pow2"],
                      state_bytes_per_element=C.state_bytes_per_element(PROJECTED["state_dtype"],
                                                                      PROJECTED["group_size"]))
    points = [(gpu_bytes, eff) for _, gpu_bytes, eff in measured_efficiency(measured_p, path, compensated)]
    eff = interpolate(points, c.hbm_bytes)
    if target and c.hbm_bytes >= goal_gpu_bytes(measured_p, compensated):
        eff = max(eff, TARGET_EFFICIENCY)
    hbm_s = c.hbm_bytes / (copy_bw * eff)
    wire_s = c.sent_bytes / m["link_bytes_per_s"]
    return {"hbm_s": hbm_s, "wire_s": wire_s, "efficiency": eff, "seconds": max(hbm_s, wire_s),
            "hbm_bytes": c.hbm_bytes, "sent_bytes": c.sent_bytes}


def crossover(sizes: List[int], echo: List[float], nccl: List[float]) -> Optional[int]:
    """The smallest size from which Echo is faster at that size and every larger one (None: at none)."""
    first = None
    for size, e, n in reversed(list(zip(sizes, echo, nccl))):
        if e < n:
            first = size
        else:
            break
    return first


def _fmt_bytes(b: int) -> str:
    if b >= 1 << 30:
        return f"{b / (1 << 30):g} GiB"
    return f"{b / MIB:g} MiB" if b >= MIB else f"{b / 1024:g} KiB"


def _us(s: float) -> str:
    return f"{s * 1e6:.1f}"


def project(machines, sizes, measured_p=2, path="best") -> dict:
    """Every machine's rows: NCCL and each Echo variant, measured and target efficiency."""
    out = {}
    for machine in machines:
        rows = []
        for size in sizes:
            row = {"bytes": size, "nccl_s": nccl_seconds(size)}
            for bits, comp in VARIANTS:
                for target in (False, True):
                    key = f"{bits}bit_{'comp' if comp else 'plain'}{'_target' if target else ''}"
                    row[key] = echo_seconds(size, machine, bits, comp, measured_p=measured_p, path=path,
                                            target=target)
            rows.append(row)
        wins = {}
        for key in rows[0]:
            if key in ("bytes", "nccl_s"):
                continue
            first = crossover(sizes, [r[key]["seconds"] for r in rows], [r["nccl_s"] for r in rows])
            wins[key] = first
        out[machine] = {"rows": rows, "echo_wins_from": wins}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machines", default="H100,H200", help=f"of {sorted(MACHINES)}")
    ap.add_argument("--min-bytes", type=int, default=MIB)
    ap.add_argument("--max-bytes", type=int, default=1 << 30)
    ap.add_argument("--factor", type=int, default=2)
    ap.add_argument("--measured-p", type=int, choices=(2, 4), default=2,
                    help="which measured world size's efficiency to use (ranks sharing one GPU)")
    ap.add_argument("--path", choices=("best", "staged", "one_launch"), default="best",
                    help="which measured path's efficiency (best: the faster at each size)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    machines = args.machines.split(",")
    for m in machines:
        if m not in MACHINES:
            ap.error(f"--machines: {m!r} is not one of {sorted(MACHINES)}")
    sizes = []
    size = args.min_bytes
    while size <= args.max_bytes:
        sizes.append(size)
        size *= args.factor

    print(f"Measured HBM efficiency (floor / time) on one H200, P = {args.measured_p} ranks sharing it, graph "
          f"replay, path {args.path}: benchmarks/RESULTS.md, 'One launch per call', 2026-12-04 14:44 UTC; copy "
          f"{MEASURED_COPY_BYTES_PER_S / 1e12:.3f} TB/s ('Kernels', 2026-12-03 21:22 UTC)")
    print("| size | GPU bytes uncompensated | efficiency | GPU bytes compensated | efficiency |")
    print("|---:|---:|---:|---:|---:|")
    plain = measured_efficiency(args.measured_p, args.path, False)
    comp = measured_efficiency(args.measured_p, args.path, True)
    for (size, b0, e0), (_, b1, e1) in zip(plain, comp):
        print(f"| {_fmt_bytes(size)} | {b0 / MIB:.1f} MiB | {100 * e0:.0f} % | {b1 / MIB:.1f} MiB | {100 * e1:.0f} % |")

    result = project(machines, sizes, args.measured_p, args.path)
    for machine in machines:
        m = MACHINES[machine]
        copy_bw = m["hbm_peak_bytes_per_s"] * MEASURED_COPY_BYTES_PER_S / MEASURED_HBM_PEAK_BYTES_PER_S
        print(f"\n{WORLD_SIZE} x {machine} (HBM {m['hbm_peak_bytes_per_s'] / 1e12:.2f} TB/s peak, copy "
              f"{copy_bw / 1e12:.2f} TB/s; link {m['link_bytes_per_s'] / 1e9:.0f} GB/s per direction, NVLS off): "
              f"time per call in us; Echo bf16 {PROJECTED['quantizer']} g = {PROJECTED['group_size']}, "
              f"compensated = residual local, state {PROJECTED['state_dtype']}; h / w = bound by HBM / by the wire; "
              f"x = NCCL's time over Echo's")
        for target in (False, True):
            label = "measured efficiency" if not target else (
                f"the goal's efficiency: raised to {100 * TARGET_EFFICIENCY:.0f} % wherever a GPU moves at least "
                f"the bytes of a {_fmt_bytes(TARGET_MIN_BYTES)} message in the measured setup")
            print(f"\n{machine}, {label}:")
            print("| size | NCCL ring 16-bit | Echo 4-bit | Echo 4-bit compensated | Echo 8-bit | "
                  "Echo 8-bit compensated |")
            print("|---:|---:|---:|---:|---:|---:|")
            for r in result[machine]["rows"]:
                cells = []
                for bits, cp in VARIANTS:
                    e = r[f"{bits}bit_{'comp' if cp else 'plain'}{'_target' if target else ''}"]
                    bound = "h" if e["hbm_s"] >= e["wire_s"] else "w"
                    cells.append(f"{_us(e['seconds'])} {bound} ({r['nccl_s'] / e['seconds']:.2f}x)")
                print(f"| {_fmt_bytes(r['bytes'])} | {_us(r['nccl_s'])} | " + " | ".join(cells) + " |")
            wins = result[machine]["echo_wins_from"]
            parts = []
            for bits, cp in VARIANTS:
                key = f"{bits}bit_{'comp' if cp else 'plain'}{'_target' if target else ''}"
                first = wins[key]
                name = f"{bits}-bit{' compensated' if cp else ''}"
                if first is None:
                    parts.append(f"{name}: never in this range")
                elif first == sizes[0]:
                    parts.append(f"{name}: at every size from {_fmt_bytes(first)}")
                else:
                    below = sizes[sizes.index(first) - 1]
                    parts.append(f"{name}: cannot win at {_fmt_bytes(below)} and below, wins from {_fmt_bytes(first)}")
            print("Echo against NCCL: " + "; ".join(parts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"inputs": {"measured_config": MEASURED_CONFIG, "measured_copy_bytes_per_s":
                                  MEASURED_COPY_BYTES_PER_S, "machines": MACHINES, "projected": PROJECTED,
                                  "world_size": WORLD_SIZE, "measured_p": args.measured_p, "path": args.path},
                       "machines": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
