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

Floor columns (issue 36; the bytes model is benchmarks/bytes_model.py, documented in docs/p2p.md, "Bytes and
memory"): "HBM/rank" = bytes one rank's call reads + writes in HBM by the model, pass by pass (x, the
compensator's state, the codes and parameters, y), "sent/rank" = the bytes of those it stores into its
peers' memory; "floor" = the bytes of every rank that shares the GPU (ranks per GPU x HBM/rank) divided by
the device's copy bandwidth, measured at the start of the run on the same GPU (the faster of a
``--copy-bytes`` copy_ and an elementwise copy kernel, read + write bytes per second, medians of
``--iters``); "% of floor" = floor / measured time x 100 (100 % is the memory limit; eager and graph
replay). The staged pipeline through torch is not modelled ("-").
Latency table (sizes up to 1 MiB): the call's graph-replay time beside, from the same run, one empty
kernel launch (eager: back-to-back launches; graph: launches replayed from one CUDA graph) and one flag
round trip between two ranks (``--pingpong``), so that the protocol's share is visible.
Memory table: a rank's device memory for Echo (docs/p2p.md, "Bytes and memory"): the IPC workspace
EchoBuffer allocates for the largest message (driver allocations, not in torch's count: their sizes), and
per row the result y, what the call leaves held (the staged pipeline's per-shape buffers), its peak above
that (temporaries), and the compensator's state, from torch.cuda.memory_allocated before and after the
call, beside the model's figures.
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
# The tests' checks (p2p_suite) import their fixtures by module name (host_transport), as the tests do.
sys.path.insert(0, os.path.join(REPO, "tests"))

from tests.utils import run_distributed  # noqa: E402
from p2p_suite import all_same, digest, plain_expected, same_bits  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bytes_model as BM  # noqa: E402

MIB = 1 << 20
kLatencyMaxBytes = MIB  # the latency table's largest size


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
    buf = EchoBuffer(max_numel=1 << 16, stages="kernels")
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

def _time_calls(buf, x, spec, comp, pow2, warmup, iters, call=None):
    """(seconds per call, host seconds per call) of ``iters`` eager calls; call: what to time instead of the
    Echo call (a function of no argument: the plain 16-bit call)."""
    call = call or (lambda: buf.all_reduce(x, spec, compensator=comp, pow2_rescale=pow2))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for _ in range(warmup):
        call()
    buf.synchronize()
    dist.barrier()
    host = []
    for i in range(iters):
        starts[i].record()
        h = time.perf_counter()
        call()
        host.append(time.perf_counter() - h)
        ends[i].record()
    buf.synchronize()
    return [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)], host


def _time_graph(buf, x, spec, comp, pow2, iters, reps, call=None):
    """Seconds per call of ``reps`` back-to-back calls captured in one CUDA graph (median, min, max over
    ``iters`` replays). The ranks meet at a barrier before each replay, so every replay starts together."""
    call = call or (lambda: buf.all_reduce(x, spec, compensator=comp, pow2_rescale=pow2))
    call()  # eager warm-up: schedule and state exist before the capture
    buf.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            call()
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


def measure_copy_bandwidth(num_bytes, iters):
    """The device's copy bandwidth (bytes read + written per second) from a copy of ``num_bytes`` (bf16), the
    faster of copy_ (cudaMemcpyAsync) and an elementwise kernel (torch.neg, out=), medians of ``iters``
    (benchmarks/bench_kernels.py measures its ceiling the same way)."""
    a = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)

    def median_s(fn):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        secs = []
        for _ in range(iters):
            start.record()
            fn()
            end.record()
            end.synchronize()
            secs.append(start.elapsed_time(end) * 1e-3)
        return statistics.median(secs)

    t_copy = median_s(lambda: b.copy_(a))
    t_kernel = median_s(lambda: torch.neg(a, out=b))
    moved = 2 * a.numel() * a.element_size()
    del a, b
    torch.cuda.empty_cache()
    return {"bytes": num_bytes, "copy_s": t_copy, "kernel_s": t_kernel, "copy_bytes_per_s": moved / t_copy,
            "kernel_bytes_per_s": moved / t_kernel, "bytes_per_s": moved / min(t_copy, t_kernel)}


def measure_empty_launch(n=1000):
    """Seconds per launch of an empty kernel (torch.cuda._sleep(0): a kernel that spins for 0 cycles), eager
    (``n`` back-to-back launches from the host) and from one CUDA graph of ``n`` launches (medians of 5)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        def launch():
            sleep(0)
    else:  # a one-element kernel
        one = torch.zeros(1, device="cuda")

        def launch():
            one.add_(0)
    launch()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def per_launch(run):
        secs = []
        for _ in range(5):
            start.record()
            run()
            end.record()
            end.synchronize()
            secs.append(start.elapsed_time(end) * 1e-3 / n)
        return statistics.median(secs)

    def eager():
        for _ in range(n):
            launch()

    out = {"eager_s": per_launch(eager), "graph_s": None}
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            for _ in range(n):
                launch()
        graph.replay()
        torch.cuda.synchronize()
        out["graph_s"] = per_launch(graph.replay)
        del graph
    except Exception as e:  # noqa: BLE001 - the eager figure still stands
        out["graph_error"] = f"{type(e).__name__}: {str(e)[:80]}"
    return out


def _make_part(size, r, n, dev):
    """Rank r's input at message size ``size``: bf16 normal values from a generator seeded by (size, r), so
    that a rank builds its own part alone and rank 0 the same parts for the emulator."""
    gen = torch.Generator(device=dev).manual_seed(size * 16 + r)
    return torch.randn(n, generator=gen, device=dev, dtype=torch.bfloat16)


def _measure_call(dev, fn):
    """(y, memory) of one call ``fn()``: torch.cuda.memory_allocated before and after it and its peak, less
    the result y (bytes)."""
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    y = fn()
    torch.cuda.synchronize(dev)
    after, peak = torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev)
    y_bytes = y.numel() * y.element_size()
    return y, {"y_bytes": y_bytes, "held_bytes": after - before - y_bytes, "peak_extra_bytes": peak - before - y_bytes}


def _model(P, n, spec, residual, pow2, comp=None):
    """The bytes model of one call (benchmarks/bytes_model.py), as a dict. comp: the call's compensator, whose
    stored format sets the state's bytes (bf16 m1 and m2 where it names none)."""
    state = BM.kStateBytesPerElement
    if comp is not None and getattr(comp, "state_dtype", "bf16") != "bf16":
        from echo_ds import compensator as C

        state = C.state_bytes_per_element(comp.state_dtype, spec.group_size)
    return BM.call_bytes(P, n, "bfloat16", spec.bits, spec.group_size, spec.quantizer, residual, pow2,
                         state).as_dict()


def _sweep(buf, rank, P, dev, spec, args):
    from echo_ds.compensator import make_compensator
    from echo_ds.config import ForwardConfig
    from echo_ds.emulate import emulated_echo_all_reduce

    def path_of(x):  # the path EchoBuffer.all_reduce takes for x (its stages setting decides per size)
        if buf._one_launch_serves(spec, x.dtype) and (
                x.numel() * x.element_size() <= buf.one_launch_max_bytes or not buf._fits_staged(x, spec)):
            return ("one launch, one-shot" if x.element_size() == 2 and x.numel() <= buf.capacity.shot_numel
                    and x.numel() * 2 <= buf.one_shot_max_bytes else "one launch")
        return "staged kernels" if buf._ops is not None else "staged torch"

    stages = buf.stages + (", one-shot off" if buf.one_shot_max_bytes == 0 else
                           f", one-shot up to {buf.one_shot_max_bytes} B")  # the table's label
    rows = []
    size = args["min_bytes"]
    while size <= args["max_bytes"]:
        n = size // 2
        pow2 = args["pow2"]
        # The emulator's check needs every rank's part on rank 0; above --check-max-bytes only the ranks'
        # results are compared with each other (the benchmark's own memory stays one part per rank).
        check = args["check_max_bytes"] is None or size <= args["check_max_bytes"]
        x = _make_part(size, rank, n, dev)
        y, mem = _measure_call(dev, lambda: buf.all_reduce(x, spec, pow2_rescale=pow2))
        ok = True
        if rank == 0 and check:
            parts = torch.stack([x if r == rank else _make_part(size, r, n, dev) for r in range(P)])
            ok = same_bits(y, emulated_echo_all_reduce(parts, spec, None, pow2))
            del parts
        ok = all_same(digest(y)) and ok
        del y
        oks = [None] * P
        dist.all_gather_object(oks, ok)
        path = path_of(x)
        row = {"P": P, "bytes": size, "bits": spec.bits, "stages": stages, "path": path, "ok": all(oks),
               "check": "emulator" if check else "ranks agree", "copy_s": _time_copy(x, args["iters"]),
               "memory": mem}
        for label in ("uncompensated", "compensated"):
            state_dtype = args.get("state_dtype", "bf16")
            comp = make_compensator(ForwardConfig(state_dtype=state_dtype)) if label == "compensated" else None
            if comp is not None:  # its first call allocates the state: measured
                _, row["memory"]["compensated"] = _measure_call(
                    dev, lambda: buf.all_reduce(x, spec, compensator=comp, pow2_rescale=pow2))
                state = [getattr(comp, name, None) for name in comp.state_names]
                row["memory"]["state_bytes"] = sum(t.numel() * t.element_size() for t in state
                                                   if isinstance(t, torch.Tensor))
            secs, host = _time_calls(buf, x, spec, comp, pow2, args["warmup"], args["iters"])
            med, lo, hi = _median_spread(secs)
            row[label] = {"median_s": med, "min_s": lo, "max_s": hi, "host_median_s": statistics.median(host)}
            if path != "staged torch":
                row[label]["model"] = _model(P, n, spec, "none" if comp is None else comp.residual, pow2, comp)
            if args["graph_reps"]:
                g_med, g_lo, g_hi = _time_graph(buf, x, spec, comp, pow2, args["iters"], args["graph_reps"])
                row[label].update(graph_median_s=g_med, graph_min_s=g_lo, graph_max_s=g_hi)
            del comp
        if buf.one_launch is not None and spec.bits == args["bits"][0]:
            # The unquantized call of the same family: the in-run 16-bit baseline (one per size and path).
            call = lambda: buf.plain_all_reduce(x)  # noqa: E731
            y = call()
            expected = plain_expected(torch.stack([t.to(dev) for t in _all_gather_cpu(x)]))
            plain_ok = not check or same_bits(y, expected)
            plain_ok = all_same(digest(y)) and plain_ok
            del y
            secs, host = _time_calls(buf, x, spec, None, False, args["warmup"], args["iters"], call=call)
            med, lo, hi = _median_spread(secs)
            row["plain16"] = {"median_s": med, "min_s": lo, "max_s": hi, "host_median_s": statistics.median(host),
                              "ok": plain_ok, "model": BM.plain_call_bytes(P, n, "bfloat16").as_dict()}
            if args["graph_reps"]:
                g_med, g_lo, g_hi = _time_graph(buf, x, spec, None, False, args["iters"], args["graph_reps"], call=call)
                row["plain16"].update(graph_median_s=g_med, graph_min_s=g_lo, graph_max_s=g_hi)
        rows.append(row)
        del x
        size *= args["factor"]
    return rows


def _all_gather_cpu(x):
    """Every rank's x (gloo gathers CPU tensors)."""
    parts = [torch.empty_like(x, device="cpu") for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.cpu())
    return parts


def _workspace(buf):
    """What EchoBuffer allocated for its workspace, read from its public attributes (None where one is not
    exposed): the code and parameter buffers (its capacity), the signal words, the transport's control
    block."""
    from echo_ds.p2p import layout as L

    cap = getattr(buf, "capacity", None)
    layout = getattr(getattr(buf, "transport", None), "layout", None)
    out = {"code_bytes": getattr(cap, "code_bytes", None), "shot_bytes": getattr(cap, "shot_bytes", 0),
           "param_bytes": getattr(cap, "param_bytes", None),
           "signal_bytes": L.signal_bytes() if hasattr(L, "signal_bytes") else None,
           "control_bytes": layout.get("control_bytes") if isinstance(layout, dict) else None}
    known = [v for v in out.values() if v is not None]
    out["total_bytes"] = sum(known) if len(known) == len(out) else None
    return out


def sweep_body(rank, world_size, args):
    from echo_ds.p2p import EchoBuffer
    from echo_ds.quant import QuantSpec

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    P = world_size
    max_numel = max(args["max_bytes"], args.get("workspace_bytes") or 0) // 2
    specs = [QuantSpec(bits, args["group_size"], args["quantizer"], rotation=args["rotation"] == "hadamard")
             for bits in args["bits"]]
    spec = specs[0]
    rows = []
    buffers = []
    variants = [(stages, shot) for stages in args["stages"] for shot in args.get("one_shot", ["default"])]
    for stages, shot in variants:  # side by side in one run: one buffer per variant, one after the other
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        buf = EchoBuffer(max_numel=max_numel, tile_bytes=args["tile_bytes"], stages=stages,
                         one_shot_max_bytes={"off": 0, "default": None}.get(shot, None if shot == "default" else
                                                                            int(shot) if shot.isdigit() else None))
        assert buf.active, buf.reason
        torch.cuda.synchronize(dev)
        buffers.append({"stages": f"{stages}, one-shot {shot}", "max_numel": max_numel,
                        "workspace": _workspace(buf),
                        "model": BM.workspace_bytes(max_numel, P, one_shot_max_bytes=2 * buf.capacity.shot_numel),
                        "torch_bytes": torch.cuda.memory_allocated(dev) - before})
        for s in specs:
            rows += _sweep(buf, rank, P, dev, s, args)
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
    return {"rows": rows, "tiles": tiles, "buffers": buffers}


def _fmt_bytes(b):
    return f"{b / MIB:g} MiB" if b >= MIB else f"{b / 1024:g} KiB"


def _us(s):
    return "-" if s is None else f"{s * 1e6:.1f} us"


def _pct(floor_s, s):
    return "-" if floor_s is None or not s else f"{100 * floor_s / s:.0f} %"


def _gib(b):
    """Bytes in GiB, MiB or KiB."""
    if b is None:
        return "-"
    if abs(b) >= (1 << 30):
        return f"{b / (1 << 30):.3f} GiB"
    return f"{b / MIB:.2f} MiB" if abs(b) >= MIB else f"{b / 1024:.1f} KiB"


def ranks_per_gpu(P, gpus):
    """Ranks that share one GPU (rank r runs on device r % gpus): all their HBM bytes count in one floor."""
    return -(-P // max(1, min(P, gpus)))


def print_flags(lat, n):
    print(f"\nFlag round trip between two ranks ({n} round trips, one flag each way), rank 0:")
    print("| mechanism | eager (host-launched) | CUDA graph |")
    print("|---|---|---|")
    for mode, name in (("kernel", "in-kernel: echo_p2p_signal_kernel + echo_p2p_wait_kernel"),
                       ("memop", "cuStreamWriteValue32 + cuStreamWaitValue32")):
        cells = []
        for key in (mode, mode + "-graph"):
            v = lat[key]
            cells.append(f"{v:.2f} us" if isinstance(v, float) else str(v))
        print(f"| {name} | {cells[0]} | {cells[1]} |")


def print_sweep(P, res, report, cfg):
    """The tables of one world size: time, floor, latency, memory, graph comparison and tile sweep."""
    copy_bw = report["copy"]["bytes_per_s"]
    share = ranks_per_gpu(P, report["gpus"])
    groups = {}
    for r in res["rows"]:
        groups.setdefault((r["stages"], r.get("bits", 4)), []).append(r)
    for (stages, bits), rows in groups.items():
        print(f"\nEcho all-reduce, P = {P} ranks, bf16, {bits}-bit, g = {cfg['group_size']}, {cfg['quantizer']}, "
              f"rotation {cfg['rotation']}, "
              f"compensated: the default forward direction (residual local, state {cfg.get('state_dtype', 'bf16')}); "
              f"pow2_rescale={cfg['pow2']}; "
              f"EchoBuffer(stages={stages!r}), path = the one the call took; "
              f"median of {cfg['iters']} (min..max); host = host time to issue one call; graph = per call of "
              f"{cfg['graph_reps']} back-to-back calls replayed from one CUDA graph; copy = a device copy of "
              f"the message")
        print("| size | path | uncompensated eager | algbw | busbw | uncompensated host | compensated eager | "
              "compensated host | uncompensated graph | compensated graph | graph ratio | copy | correct |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
        for r in rows:
            u, c = r["uncompensated"], r["compensated"]
            algbw = r["bytes"] / u["median_s"] / 1e9
            busbw = algbw * 2 * (P - 1) / P
            graph = ("| - | - | - " if "graph_median_s" not in u else
                     f"| {u['graph_median_s'] * 1e6:.1f} us | {c['graph_median_s'] * 1e6:.1f} us "
                     f"| {c['graph_median_s'] / u['graph_median_s']:.2f}x ")
            correct = ("yes" if r.get("check", "emulator") == "emulator" else "ranks agree") if r["ok"] else "NO"
            print(f"| {_fmt_bytes(r['bytes'])} | {r['path']} | {u['median_s'] * 1e6:.1f} us ({u['min_s'] * 1e6:.0f}.."
                  f"{u['max_s'] * 1e6:.0f}) | {algbw:.1f} GB/s | {busbw:.1f} GB/s | {u['host_median_s'] * 1e6:.0f} us "
                  f"| {c['median_s'] * 1e6:.1f} us | {c['host_median_s'] * 1e6:.0f} us {graph}"
                  f"| {r['copy_s'] * 1e6:.1f} us | {correct} |")

        def floor_of(model) -> float:
            """The floor: every rank on this GPU, its model bytes at the copy bandwidth of this run."""
            return share * (model["read_bytes"] + model["write_bytes"]) / copy_bw

        print(f"\nFloor, P = {P}, {bits}-bit, {stages}: HBM/rank = bytes one rank's call reads + writes "
              f"(benchmarks/bytes_model.py), sent/rank = of those, stored into peers' memory; floor = {share} "
              f"rank(s) per GPU x HBM/rank / {copy_bw / 1e12:.3f} TB/s (copy, this run); % of floor = floor / time")
        print("| size | uncompensated HBM/rank | sent/rank | floor | % of floor eager | % of floor graph | "
              "compensated HBM/rank | floor | % of floor eager | % of floor graph |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            cells = []
            for label in ("uncompensated", "compensated"):
                d = r[label]
                m = d.get("model")
                if m is None:
                    cells.append("- |" + (" - |" if label == "uncompensated" else "") + " - | - | -")
                    continue
                hbm = m["read_bytes"] + m["write_bytes"]
                floor = d["floor_s"] = floor_of(m)
                sent = f" {_gib(m['sent_bytes'])} |" if label == "uncompensated" else ""
                cells.append(f"{_gib(hbm)} |{sent} {_us(floor)} | {_pct(floor, d['median_s'])} | "
                             f"{_pct(floor, d.get('graph_median_s'))}")
            print(f"| {_fmt_bytes(r['bytes'])} | " + " | ".join(cells) + " |")

        plain = [r for r in rows if "plain16" in r]
        if plain:
            print(f"\n16-bit baseline, P = {P}, {stages}: the unquantized call of the same kernel family "
                  f"(EchoBuffer.plain_all_reduce: the same flags, epochs and chunks; fp32 sum in rank order, one "
                  f"rounding), its floor from the same copy bandwidth; Echo / 16-bit = the Echo call's time over it")
            print("| size | 16-bit eager | 16-bit host | 16-bit graph | HBM/rank | sent/rank | % of floor graph | "
                  "Echo / 16-bit graph | compensated Echo / 16-bit graph | correct |")
            print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
            for r in plain:
                d, m = r["plain16"], r["plain16"]["model"]
                hbm = m["read_bytes"] + m["write_bytes"]
                d["floor_s"] = floor_of(m)
                g = d.get("graph_median_s")
                ratio = (lambda label: "-" if not g or "graph_median_s" not in r[label]
                         else f"{r[label]['graph_median_s'] / g:.2f}x")
                print(f"| {_fmt_bytes(r['bytes'])} | {_us(d['median_s'])} | {d['host_median_s'] * 1e6:.0f} us | "
                      f"{_us(g) if g else '-'} | {_gib(hbm)} | {_gib(m['sent_bytes'])} | {_pct(d['floor_s'], g)} | "
                      f"{ratio('uncompensated')} | {ratio('compensated')} | {'yes' if d['ok'] else 'NO'} |")

        small = [r for r in rows if r["bytes"] <= kLatencyMaxBytes]
        if small:
            launch = report.get("launch") or {}
            flags = report.get("flags") or {}
            rt = flags.get("kernel-graph")
            rt_s = f"{rt:.2f} us" if isinstance(rt, float) else "-"
            print(f"\nLatency, P = {P}, {bits}-bit, {stages} (same run): empty launch = one empty kernel "
                  f"(graph: {_us(launch.get('graph_s'))}, eager: {_us(launch.get('eager_s'))}); flag round trip "
                  f"= two ranks, in-kernel signal + wait, CUDA graph ({rt_s}); above floor = graph - floor")
            print("| size | uncompensated graph | floor | above floor | compensated graph | floor | above floor | "
                  "empty launch (graph) | flag round trip |")
            print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for r in small:
                cells = []
                for label in ("uncompensated", "compensated"):
                    d = r[label]
                    g, f = d.get("graph_median_s"), d.get("floor_s")
                    cells.append(f"{_us(g)} | {_us(f)} | {_us(g - f) if g is not None and f is not None else '-'}")
                print(f"| {_fmt_bytes(r['bytes'])} | " + " | ".join(cells) + f" | {_us(launch.get('graph_s'))} | "
                      f"{rt_s} |")

    for b in res.get("buffers", []):
        ws, model = b["workspace"], b["model"]
        print(f"\nMemory per rank, P = {P}, {b['stages']}: IPC workspace for messages up to "
              f"{_fmt_bytes(2 * b['max_numel'])} of bf16 ({b['max_numel']} elements; driver allocations, outside "
              f"torch's count): codes {_gib(ws['code_bytes'])} + one-shot regions {_gib(ws.get('shot_bytes', 0))} + "
              f"parameters {_gib(ws['param_bytes'])} + signals "
              f"{_gib(ws['signal_bytes'])} + control {ws['control_bytes'] if ws['control_bytes'] is not None else '?'} B"
              f" = {_gib(ws['total_bytes'])} (model: {_gib(model['total_bytes'])}, 2.5 bytes per element of the "
              f"largest message); EchoBuffer's own torch allocations: {b['torch_bytes']} B")
    rows_mem = [r for r in res["rows"] if "memory" in r]
    if rows_mem:
        from echo_ds import compensator as C

        state_dtype = cfg.get("state_dtype", "bf16")  # reports from before --state-dtype ran bf16
        state_per_element = C.state_bytes_per_element(state_dtype, cfg["group_size"])
        print(f"\nMemory per call, P = {P} (torch.cuda.memory_allocated around the first call at each size; "
              f"y = the result, held = what the call leaves allocated besides y, peak = its high-water mark above "
              f"y; state = the compensator's stored state, {state_dtype})")
        print("| size | stages | bits | y | held | peak above y | compensated: held | compensated: peak above y | "
              "state | model: state | model: staged buffers |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows_mem:
            m = r["memory"]
            c = m.get("compensated", {})
            n = r["bytes"] // 2
            bits = r.get("bits", 4)
            staged = {"staged kernels": BM.staged_schedule_bytes(n, P, bits, cfg["group_size"]),
                      "one launch": 0}.get(r["path"])  # the staged pipeline through torch: not modelled
            print(f"| {_fmt_bytes(r['bytes'])} | {r['path']} | {bits} | {_gib(m['y_bytes'])} | "
                  f"{_gib(m['held_bytes'])} | {_gib(m['peak_extra_bytes'])} | {_gib(c.get('held_bytes'))} | "
                  f"{_gib(c.get('peak_extra_bytes'))} | {_gib(m.get('state_bytes'))} | "
                  f"{_gib(BM.state_bytes(n, P, cfg['group_size'], state_per_element))} | {_gib(staged)} |")

    names = list(dict.fromkeys(s for s, _ in groups))
    if len(names) > 1 and cfg["graph_reps"]:
        for bits in dict.fromkeys(b for _, b in groups):
            a_rows, b_rows = groups.get((names[0], bits), []), groups.get((names[-1], bits), [])
            print(f"\nGraph replay per call, P = {P}, {bits}-bit: {names[0]} against {names[-1]} (same run)")
            print(f"| size | uncompensated {names[0]} | uncompensated {names[-1]} | ratio | compensated {names[0]} "
                  f"| compensated {names[-1]} | ratio |")
            print("|---:|---:|---:|---:|---:|---:|---:|")
            for a, b in zip(a_rows, b_rows):
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--min-bytes", type=int, default=64 * 1024)
    ap.add_argument("--max-bytes", type=int, default=256 * MIB)
    ap.add_argument("--max-bytes-at", default="",
                    help="a smaller --max-bytes for some world sizes, e.g. 8:268435456 (P = 8 up to the size that fits "
                         "when its ranks share one GPU); comma-separated P:bytes")
    ap.add_argument("--workspace-bytes", type=int, default=0,
                    help="size the workspace for messages of this many bf16 bytes when larger than --max-bytes (the "
                         "16-bit call moves 2 bytes an element, twice the 8-bit codes the workspace is sized for: "
                         "at the workspace's own size it takes two launches)")
    ap.add_argument("--one-shot", default="default",
                    help="the one-launch call's one-shot variant, comma-separated: 'default' (EchoBuffer's threshold), "
                         "'off' (every call two-shot) or a threshold in bytes; one buffer each, side by side")
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--stages", default="kernels,fused",
                    help="EchoBuffer stages to compare, one buffer each (fused: the one-launch call at every size; "
                         "kernels: the staged kernels; auto: the default choice between them)")
    ap.add_argument("--bits", default="4", help="code widths to sweep, comma-separated (4, 8), one table each")
    ap.add_argument("--tile-bytes", type=int, default=None, help="default: EchoBuffer's")
    ap.add_argument("--tile-sweep-bytes", type=int, default=64 * MIB, help="message size of the tile sweep (0: none)")
    ap.add_argument("--tile-sweep", default=f"{256 * 1024},{MIB},{4 * MIB},{16 * MIB},0")
    ap.add_argument("--pingpong", type=int, default=2000,
                    help="round trips of the flag latency test (0: none); the latency table's flag round trip")
    ap.add_argument("--copy-bytes", type=int, default=1 << 30,
                    help="bytes of the device copy that measures the copy bandwidth of the floor columns (the copy "
                         "reads and writes them: twice as much device memory is needed)")
    ap.add_argument("--check-max-bytes", type=int, default=None,
                    help="largest size checked bit for bit against the emulator on rank 0 (default: every size); "
                         "above it the ranks' results are only compared with each other ('ranks agree'), which "
                         "keeps the benchmark's own memory at one input per rank")
    ap.add_argument("--rotation", choices=("hadamard", "none"), default="hadamard",
                    help="the quantizer's rotation (default: the default configuration's)")
    from echo_ds.config import EchoConfig, ForwardConfig

    defaults = EchoConfig.model_fields  # the "echo" section's defaults (docs/training.md chose them)
    ap.add_argument("--quantizer", default=defaults["quantizer"].default,
                    help="the quantizer (echo_ds.quant.QUANTIZERS; default %(default)s, the default configuration's)")
    ap.add_argument("--group-size", type=int, default=defaults["group_size"].default,
                    help="the group size g (default %(default)s, the default configuration's)")
    ap.add_argument("--graph-reps", type=int, default=10,
                    help="calls per CUDA graph for the graph-replay columns (0: no graph timing)")
    ap.add_argument("--pow2", choices=("false", "true", "auto"), default="false",
                    help="the calls' pow2_rescale (default false; 'auto' is what forward sites use, 'true' backward)")
    ap.add_argument("--state-dtype", choices=("bf16", "int8", "int4"), default=ForwardConfig().state_dtype,
                    help="the compensated calls' stored state format (echo.forward.state_dtype; default %(default)s)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from echo_ds.p2p.buffer import kDefaultTileBytes

    cfg = {"min_bytes": args.min_bytes, "max_bytes": args.max_bytes, "factor": args.factor, "warmup": args.warmup,
           "iters": args.iters, "workspace_bytes": args.workspace_bytes, "one_shot": args.one_shot.split(","), "stages": args.stages.split(","), "graph_reps": args.graph_reps, "rotation": args.rotation,
           "quantizer": args.quantizer, "group_size": args.group_size, "bits": [int(b) for b in args.bits.split(",")],
           "pow2": {"false": False, "true": True, "auto": "auto"}[args.pow2], "check_max_bytes": args.check_max_bytes,
           "state_dtype": args.state_dtype,
           "tile_bytes": kDefaultTileBytes if args.tile_bytes is None else args.tile_bytes,
           "tile_sweep_bytes": args.tile_sweep_bytes, "tile_sweep": [int(v) for v in args.tile_sweep.split(",")]}
    report = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "date": time.strftime(
        "%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv), "flags": None, "sweeps": {}}

    # The floor's denominator and the latency table's empty launch: this process, alone on GPU 0, before
    # any rank starts.
    report["copy"] = measure_copy_bandwidth(args.copy_bytes, max(args.iters, 10))
    report["launch"] = measure_empty_launch()
    c = report["copy"]
    print(f"copy bandwidth ({_fmt_bytes(args.copy_bytes)} bf16 on GPU 0, read + write): copy_ "
          f"{c['copy_bytes_per_s'] / 1e12:.3f} TB/s, elementwise kernel {c['kernel_bytes_per_s'] / 1e12:.3f} TB/s; "
          f"floor at {c['bytes_per_s'] / 1e12:.3f} TB/s. Empty kernel launch: eager {_us(report['launch']['eager_s'])}, "
          f"graph {_us(report['launch']['graph_s'])}")

    if args.pingpong:
        lat = run_distributed(flag_latency_body, 2, args.pingpong, timeout=300)[0]
        report["flags"] = lat
        print_flags(lat, args.pingpong)

    world_sizes = [int(v) for v in args.world_sizes.split(",")]
    max_at = {int(p): int(b) for p, b in (item.split(":") for item in args.max_bytes_at.split(",") if item)}
    for P in world_sizes:
        # The tile sweep at the largest world size only (device time is short).
        cfg_p = dict(cfg, tile_sweep_bytes=cfg["tile_sweep_bytes"] if P == world_sizes[-1] else 0,
                     max_bytes=min(cfg["max_bytes"], max_at.get(P, cfg["max_bytes"])))
        res = run_distributed(sweep_body, P, cfg_p, timeout=600)[0]
        report["sweeps"][P] = res
        print_sweep(P, res, report, cfg_p)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
