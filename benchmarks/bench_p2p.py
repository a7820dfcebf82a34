"""Benchmark of the p2p transport: flag latency (in-kernel waits against cuStreamWaitValue32), the Echo
all-reduce over a size sweep (nccl-tests' columns), and the tile size.

    python benchmarks/bench_p2p.py                       # P = 2 and 4 ranks on the visible GPU(s)
    python benchmarks/bench_p2p.py --world-sizes 2 --min-bytes 65536 --max-bytes 268435456 --factor 4
    python benchmarks/bench_p2p.py --json out.json

Ranks bootstrap over gloo and may share one GPU (then start MPS first, as benchmarks/p2p_gpu.sh does):
on one GPU a peer write is a local HBM write, so these numbers measure the protocol's overheads and the
stages' kernels, not NVLink; the multi-GPU numbers are issue 8's. Times are medians over ``--iters``
calls after ``--warmup`` (per-call CUDA events on the caller's stream), with the spread (min..max); the
graph columns replay ``--graph-reps`` back-to-back calls captured in one CUDA graph (time per call), the
host out of the loop, and "graph ratio" is compensated over uncompensated.
busbw = algbw * 2 (P - 1) / P, algbw = message bytes / time, as nccl-tests defines them for all-reduce.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.utils import run_distributed  # noqa: E402

MIB = 1 << 20


def _median_spread(xs):
    return statistics.median(xs), min(xs), max(xs)


# ----------------------------------------------------------------------------------------------------
# Flag latency: kernel signal + kernel wait against cuStreamWriteValue32 + cuStreamWaitValue32
# ----------------------------------------------------------------------------------------------------

def _pingpong(buf, rank, n, mode, graph):
    """Round trips between ranks 0 and 1 through one flag each way; returns microseconds per round trip
    on rank 0 (None elsewhere), or a string when the mode cannot run."""
    from echo_ds.p2p import driver as D
    from echo_ds.p2p import layout as L

    t = buf.transport
    peer = 1 - rank
    # Reserved words of EchoP2PSignals (after `progress`), written only by this benchmark.
    off = L.signal_offset("reserved") + 4 * (4 if mode == "memop" else 0) + 4 * (2 if graph else 0)
    mine, theirs = t.local_ptr["signals"] + off, t.peer_ptr[peer]["signals"] + off
    base = 0x20000000 + (0x01000000 if mode == "memop" else 0) + (0x00800000 if graph else 0)
    stream = torch.cuda.Stream()
    sig = [t.prepare_signal([(peer, off)], 0, base + i) for i in range(n + 1)]
    waits = [t.prepare_wait([(peer, off)], 0, 3, 0, value=base + i) for i in range(n + 1)]

    def one(i, s):
        if mode == "kernel":
            if rank == 0:
                t.signal(sig[i], s)
                t.wait(waits[i], s)
            else:
                t.wait(waits[i], s)
                t.signal(sig[i], s)
        else:
            if rank == 0:
                D.stream_write_value32(s.cuda_stream, theirs, base + i)
                D.stream_wait_value32(s.cuda_stream, mine, base + i, geq=True)
            else:
                D.stream_wait_value32(s.cuda_stream, mine, base + i, geq=True)
                D.stream_write_value32(s.cuda_stream, theirs, base + i)

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g = None
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                for i in range(1, n + 1):
                    one(i, torch.cuda.current_stream())
        except Exception as e:  # noqa: BLE001
            ok = False
            msg = f"not capturable: {type(e).__name__}: {str(e)[:80]}"
        else:
            ok, msg = True, ""
        oks = [None] * dist.get_world_size()
        dist.all_gather_object(oks, (ok, msg))
        if not all(o for o, _ in oks):
            return next(m for o, m in oks if not o)
    dist.barrier()
    with torch.cuda.stream(stream):
        one(0, stream)  # handshake: both ranks are here, so the timing starts together
        start.record(stream)
        if graph:
            g.replay()
        else:
            for i in range(1, n + 1):
                one(i, stream)
        end.record(stream)
    # A stream memop wait has no timeout: if the peer never writes, release this rank's own waits from
    # the host side (GEQ waits, one large value) rather than hang the benchmark.
    deadline = time.monotonic() + 30.0
    while not end.query():
        if time.monotonic() > deadline:
            release = torch.cuda.Stream()
            D.memset_u32_async(mine, base + n + 1000, 1, release.cuda_stream)
            end.synchronize()
            return f"{mode}: no answer from rank {peer} within 30 s (released)"
        time.sleep(1e-3)
    buf.check()
    return start.elapsed_time(end) * 1e3 / n if rank == 0 else None


def flag_latency_body(rank, world_size, n):
    from echo_ds.p2p import EchoBuffer

    torch.cuda.set_device(rank % torch.cuda.device_count())
    buf = EchoBuffer(max_numel=1 << 16, stages="torch")
    assert buf.active, buf.reason
    out = {}
    for graph in (False, True):
        for mode in ("kernel", "memop"):
            out[f"{mode}{'-graph' if graph else ''}"] = _pingpong(buf, rank, n, mode, graph)
    buf.close()
    return out


# ----------------------------------------------------------------------------------------------------
# The all-reduce
# ----------------------------------------------------------------------------------------------------

def _time_calls(buf, x, spec, comp, pow2, warmup, iters):
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for _ in range(warmup):
        buf.all_reduce(x, spec, compensator=comp, pow2_rescale=pow2)
    buf.synchronize()
    dist.barrier()
    host = []
    for i in range(iters):
        starts[i].record()
        h = time.perf_counter()
        buf.all_reduce(x, spec, compensator=comp, pow2_rescale=pow2)
        host.append(time.perf_counter() - h)
        ends[i].record()
    buf.synchronize()
    return [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)], host


def _time_graph(buf, x, spec, comp, pow2, iters, reps):
    """Seconds per call of ``reps`` back-to-back calls captured in one CUDA graph (median, min, max over
    ``iters`` replays). The ranks meet at a barrier before each replay, so every replay starts together."""
    buf.all_reduce(x, spec, compensator=comp, pow2_rescale=pow2)  # eager warm-up: schedule and state exist before the capture
    buf.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            buf.all_reduce(x, spec, compensator=comp, pow2_rescale=pow2)
    buf.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    secs = []
    for _ in range(iters + 1):
        dist.barrier()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        secs.append(start.elapsed_time(end) * 1e-3 / reps)
    buf.check()
    del graph
    return _median_spread(secs[1:])  # the first replay uploads the graph


def _time_copy(x, iters):
    """Seconds of a device copy of x's bytes (median over ``iters``): the floor of anything that reads x and
    writes a result of its size."""
    y = torch.empty_like(x)
    y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    secs = []
    for _ in range(iters):
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        secs.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(secs)


def _sweep(buf, rank, P, dev, spec, args):
    from echo_ds.compensator import make_compensator
    from echo_ds.config import DirectionConfig
    from echo_ds.emulate import emulated_echo_all_reduce
    from tests.p2p_suite import all_same, digest, same_bits

    if buf._runtime is not None:
        stages = "one launch"
    else:
        stages = "staged kernels" if buf._ops is not None else "staged torch"
    rows = []
    size = args["min_bytes"]
    while size <= args["max_bytes"]:
        n = size // 2
        gen = torch.Generator(device=dev).manual_seed(size)
        parts = torch.randn(P, n, generator=gen, device=dev).to(torch.bfloat16)
        x = parts[rank].contiguous()
        pow2 = args["pow2"]
        y = buf.all_reduce(x, spec, pow2_rescale=pow2)
        ok = True
        if rank == 0:
            ok = same_bits(y, emulated_echo_all_reduce(parts, spec, None, pow2))
        ok = all_same(digest(y)) and ok
        oks = [None] * P
        dist.all_gather_object(oks, ok)
        del parts
        row = {"P": P, "bytes": size, "stages": stages, "ok": all(oks), "copy_s": _time_copy(x, args["iters"])}
        for label, comp in (("uncompensated", None), ("compensated", make_compensator(DirectionConfig()))):
            secs, host = _time_calls(buf, x, spec, comp, pow2, args["warmup"], args["iters"])
            med, lo, hi = _median_spread(secs)
            row[label] = {"median_s": med, "min_s": lo, "max_s": hi, "host_median_s": statistics.median(host)}
            if args["graph_reps"]:
                g_med, g_lo, g_hi = _time_graph(buf, x, spec, comp, pow2, args["iters"], args["graph_reps"])
                row[label].update(graph_median_s=g_med, graph_min_s=g_lo, graph_max_s=g_hi)
        rows.append(row)
        size *= args["factor"]
    return rows


def sweep_body(rank, world_size, args):
    from echo_ds.p2p import EchoBuffer
    from echo_ds.quant import QuantSpec

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    P = world_size
    max_numel = args["max_bytes"] // 2
    spec = QuantSpec(4, args["group_size"], args["quantizer"], rotation=args["rotation"] == "hadamard")
    rows = []
    for stages in args["stages"]:  # side by side in one run: one buffer per pipeline, one after the other
        buf = EchoBuffer(max_numel=max_numel, tile_bytes=args["tile_bytes"], stages=stages)
        assert buf.active, buf.reason
        rows += _sweep(buf, rank, P, dev, spec, args)
        buf.close()
    # Tile sweep at one size.
    tiles = []
    if args["tile_sweep_bytes"]:  # the staged pipeline's tile size
        buf = EchoBuffer(max_numel=max_numel, tile_bytes=args["tile_bytes"], stages="kernels")
        n = args["tile_sweep_bytes"] // 2
        x = torch.randn(n, device=dev).to(torch.bfloat16)
        for tb in args["tile_sweep"]:
            buf.synchronize()
            buf._schedules.clear()
            buf.tile_bytes = tb
            secs, host = _time_calls(buf, x, spec, None, False, args["warmup"], args["iters"])
            med, lo, hi = _median_spread(secs)
            sched = next(iter(buf._schedules.values()))
            tiles.append({"tile_bytes": tb, "num_tiles": sched.tiling.num_tiles, "median_s": med, "min_s": lo,
                          "max_s": hi, "host_median_s": statistics.median(host)})
        buf.close()
    return {"rows": rows, "tiles": tiles}


def _fmt_bytes(b):
    return f"{b / MIB:g} MiB" if b >= MIB else f"{b / 1024:g} KiB"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--min-bytes", type=int, default=64 * 1024)
    ap.add_argument("--max-bytes", type=int, default=256 * MIB)
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--stages", default="kernels,fused",
                    help="EchoBuffer stages to compare, one buffer each (fused: the one-launch call at every size; "
                         "kernels: the staged kernels; auto: the default choice between them)")
    ap.add_argument("--tile-bytes", type=int, default=None, help="default: EchoBuffer's")
    ap.add_argument("--tile-sweep-bytes", type=int, default=64 * MIB, help="message size of the tile sweep (0: none)")
    ap.add_argument("--tile-sweep", default=f"{256 * 1024},{MIB},{4 * MIB},{16 * MIB},0")
    ap.add_argument("--pingpong", type=int, default=2000, help="round trips of the flag latency test (0: none)")
    ap.add_argument("--rotation", choices=("hadamard", "none"), default="hadamard",
                    help="the quantizer's rotation (default: the default configuration's)")
    ap.add_argument("--quantizer", default="zero_aware", help="the quantizer (echo_ds.quant.QUANTIZERS)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--graph-reps", type=int, default=10,
                    help="calls per CUDA graph for the graph-replay columns (0: no graph timing)")
    ap.add_argument("--pow2", choices=("false", "true", "auto"), default="false",
                    help="the calls' pow2_rescale (default false; 'auto' is what forward sites use, 'true' backward)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from echo_ds.p2p.buffer import kDefaultTileBytes

    cfg = {"min_bytes": args.min_bytes, "max_bytes": args.max_bytes, "factor": args.factor, "warmup": args.warmup,
           "iters": args.iters, "stages": args.stages.split(","), "graph_reps": args.graph_reps, "rotation": args.rotation,
           "quantizer": args.quantizer, "group_size": args.group_size,
           "pow2": {"false": False, "true": True, "auto": "auto"}[args.pow2],
           "tile_bytes": kDefaultTileBytes if args.tile_bytes is None else args.tile_bytes,
           "tile_sweep_bytes": args.tile_sweep_bytes, "tile_sweep": [int(v) for v in args.tile_sweep.split(",")]}
    report = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "date": time.strftime(
        "%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv), "flags": None, "sweeps": {}}

    if args.pingpong:
        lat = run_distributed(flag_latency_body, 2, args.pingpong, timeout=300)[0]
        report["flags"] = lat
        print(f"\nFlag round trip between two ranks ({args.pingpong} round trips, one flag each way), rank 0:")
        print("| mechanism | eager (host-launched) | CUDA graph |")
        print("|---|---|---|")
        for mode, name in (("kernel", "in-kernel: echo_p2p_signal_kernel + echo_p2p_wait_kernel"),
                           ("memop", "cuStreamWriteValue32 + cuStreamWaitValue32")):
            cells = []
            for key in (mode, mode + "-graph"):
                v = lat[key]
                cells.append(f"{v:.2f} us" if isinstance(v, float) else str(v))
            print(f"| {name} | {cells[0]} | {cells[1]} |")

    world_sizes = [int(v) for v in args.world_sizes.split(",")]
    for P in world_sizes:
        # The tile sweep at the largest world size only (device time is short).
        res = run_distributed(sweep_body, P, dict(cfg, tile_sweep_bytes=cfg["tile_sweep_bytes"] if P == world_sizes[-1]
                                                  else 0), timeout=600)[0]
        report["sweeps"][P] = res
        by_stages = {}
        for r in res["rows"]:
            by_stages.setdefault(r["stages"], []).append(r)
        for stages, rows in by_stages.items():
            print(f"\nEcho all-reduce, P = {P} ranks, bf16, 4-bit, g = {args.group_size}, {args.quantizer}, "
                  f"rotation {args.rotation}, "
                  f"compensated: the default forward direction (residual local); pow2_rescale={cfg['pow2']}; {stages}; "
                  f"median of {args.iters} (min..max); host = host time to issue one call; graph = per call of "
                  f"{args.graph_reps} back-to-back calls replayed from one CUDA graph; copy = a device copy of "
                  f"the message")
            print("| size | uncompensated eager | algbw | busbw | uncompensated host | compensated eager | "
                  "compensated host | uncompensated graph | compensated graph | graph ratio | copy | correct |")
            print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
            for r in rows:
                u, c = r["uncompensated"], r["compensated"]
                algbw = r["bytes"] / u["median_s"] / 1e9
                busbw = algbw * 2 * (P - 1) / P
                graph = ("| - | - | - " if "graph_median_s" not in u else
                         f"| {u['graph_median_s'] * 1e6:.1f} us | {c['graph_median_s'] * 1e6:.1f} us "
                         f"| {c['graph_median_s'] / u['graph_median_s']:.2f}x ")
                print(f"| {_fmt_bytes(r['bytes'])} | {u['median_s'] * 1e6:.1f} us ({u['min_s'] * 1e6:.0f}.."
                      f"{u['max_s'] * 1e6:.0f}) | {algbw:.1f} GB/s | {busbw:.1f} GB/s | {u['host_median_s'] * 1e6:.0f} us "
                      f"| {c['median_s'] * 1e6:.1f} us | {c['host_median_s'] * 1e6:.0f} us {graph}"
                      f"| {r['copy_s'] * 1e6:.1f} us | {'yes' if r['ok'] else 'NO'} |")
        if len(by_stages) > 1 and args.graph_reps:
            names = list(by_stages)
            print(f"\nGraph replay per call, P = {P}: {names[0]} against {names[-1]} (same run)")
            print(f"| size | uncompensated {names[0]} | uncompensated {names[-1]} | ratio | compensated {names[0]} "
                  f"| compensated {names[-1]} | ratio |")
            print("|---:|---:|---:|---:|---:|---:|---:|")
            for a, b in zip(by_stages[names[0]], by_stages[names[-1]]):
                cells = []
                for label in ("uncompensated", "compensated"):
                    ta, tb = a[label]["graph_median_s"], b[label]["graph_median_s"]
                    cells.append(f"{ta * 1e6:.1f} us | {tb * 1e6:.1f} us | {tb / ta:.2f}x")
                print(f"| {_fmt_bytes(a['bytes'])} | " + " | ".join(cells) + " |")
        if res["tiles"]:
            print(f"\nTile size at {_fmt_bytes(cfg['tile_sweep_bytes'])} (P = {P}):")
            print("| tile bytes | tiles | time | host |")
            print("|---:|---:|---:|---:|")
            for t in res["tiles"]:
                tb = "one per segment" if t["tile_bytes"] == 0 else _fmt_bytes(t["tile_bytes"])
                print(f"| {tb} | {t['num_tiles']} | {t['median_s'] * 1e6:.1f} us ({t['min_s'] * 1e6:.0f}.."
                      f"{t['max_s'] * 1e6:.0f}) | {t['host_median_s'] * 1e6:.0f} us |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
