"""Bandwidth of the Echo kernels against the device copy and DeepSpeed's ZeRO++ quantizer kernels.

One run, every implementation in the same loop, over message sizes (bytes of the fp16 input x):

    python benchmarks/bench_kernels.py                       # 64 MB .. 1 GB, factor 2
    python benchmarks/bench_kernels.py --min-bytes 64M --max-bytes 1G --factor 2 --iters 15 --json out.json

Each time is the median (and min-max spread) over --iters CUDA-graph replays of --reps back-to-back calls
(events around the replay, divided by --reps), after a warm-up, so that Python launch overhead stays out.
"bytes" is what a stage must move through device memory at the least (every input read once, every output
written once); GB/s = bytes / time, "% copy" = that over the device-to-device copy bandwidth (bytes read +
written) of a 1 GB copy measured in the same run. P = 4 ranks (one rank's share of the work), 4-bit codes,
groups of 128, zero-aware quantizer, bf16 compensator state (m1, m2), unless a row says otherwise.

After the rows, a second table prices the compensator: per rank and call, the time its state adds to the
passes of an uncompensated call (entry + owner reduce + dequantize, same rotation), converted to bytes per
element of the message at the copy bandwidth of the same run. The state itself must move 8 (residual
"local": m1 and m2 read once, written once) or 12 ("output": read again by the dequantize).

Rows:
  copy                 an elementwise copy kernel over the message (torch.neg, out=; 2 x bytes)
  ds_quantize          DeepSpeed QuantizerBuilder quantize, 4-bit asymmetric, groups of 128, fp16 in
  ds_dequantize        DeepSpeed dequantize of those codes, fp16 out
  entry                Echo entry (push_quantize) without compensation
  entry+comp           ... with the compensator reading the state (m1, m2) (residual "output": read only)
  entry+rot            ... with the Hadamard rotation, no compensation
  entry+sym            ... with the symmetric quantizer (its parameters cost a fraction of the zero-aware ones)
  entry+naive          ... with the naive asymmetric (min/max) quantizer, the kind DeepSpeed's is
  entry+8bit           ... with 8-bit codes (zero-aware)
  entry+comp+local     ... with the compensator and residual "local" (the state updated in the same pass)
  entry+comp+rot+local ... and the rotation: the default configuration's entry
  pow2_amax            max |x| (backward rescaling)
  owner_reduce         P - 1 copies + the own segment formed from x -> reduced codes
  owner_reduce+comp    ... the own segment formed from x and the state (residual "output": read only)
  owner_reduce+rot     ... with the rotation, no compensation
  owner_reduce+comp+rot+local  ... rotation, state read and updated: the default configuration's reduce
  dequantize           all P segments -> y (fp16)
  dequantize+rot       ... with the inverse rotation
  dequantize+update    ... with the compensator update of residual "output" (reads x and the state again)
  torch_compensator    the compensator as separate PyTorch ops (echo_ds.compensator): apply + update
  .../int64            the row above it with quantizer "zero_aware_int" at g = 64 (4.25 bits per value, as
                       g = 128 with fp16 parameters): twice the groups, one packed parameter word each
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo_ds import algorithm as A  # noqa: E402
from echo_ds import quant as Q  # noqa: E402
from echo_ds.compensator import kStateDtype  # noqa: E402
from echo_ds.quant import QuantSpec  # noqa: E402

P = 4
G_SIZE = 128
# Every row the benchmark can time, in table order (the docstring says what each is).
ROWS = ("copy", "ds_quantize", "ds_dequantize", "entry", "entry+comp", "entry+rot", "entry+sym",
        "entry+naive", "entry+8bit", "entry+comp+local", "entry+comp+rot+local", "pow2_amax", "owner_reduce",
        "owner_reduce+comp", "owner_reduce+rot", "owner_reduce+comp+rot+local", "dequantize", "dequantize+rot",
        "dequantize+update", "torch_compensator", "entry+comp+rot+local/int64",
        "owner_reduce+comp+rot+local/int64", "dequantize+rot/int64")
# The compensator's price (second table): (residual, uncompensated passes, compensated passes).
COMPENSATOR_SUMS = (
    ("local (default, rotated)", ("entry+rot", "owner_reduce+rot", "dequantize+rot"),
     ("entry+comp+rot+local", "owner_reduce+comp+rot+local", "dequantize+rot")),
    ("output (paper's)", ("entry", "owner_reduce", "dequantize"),
     ("entry+comp", "owner_reduce+comp", "dequantize+update")),
)


def parse_bytes(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def time_op(fn, reps: int, iters: int, graph: bool = True):
    """(median, min, max) ms of one call of fn, from CUDA-graph replays of `reps` calls (graph=False:
    `reps` plain back-to-back launches between the events)."""
    fn()
    torch.cuda.synchronize()
    try:
        if not graph:
            raise RuntimeError("plain launches asked for")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        run = graph.replay
    except Exception as e:  # noqa: BLE001 - fall back to plain launches
        if graph:
            print(f"  (graph capture failed: {type(e).__name__}: {e}; timing plain launches)")
        torch.cuda.synchronize()

        def run():
            for _ in range(reps):
                fn()
    run()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(iters):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times), min(times), max(times)


def stage_buffers(n: int, spec, dev):
    """Inputs and outputs of every stage for an fp16 message of n elements (rank 0 of P): random x and
    compensator arrays, packet buffers of the P segments, and the tables that point into them."""
    import types

    import echo_ds.ops as E

    layout = A.Layout(n, P, spec.group_size)
    padded = layout.padded_numel
    b = types.SimpleNamespace(layout=layout, n=n)
    b.x = (torch.randn(n, device=dev) * 2.0).to(torch.float16)
    b.m1, b.m2 = ((torch.randn(padded, device=dev) * 1e-2).to(kStateDtype) for _ in range(2))
    b.send = E.alloc_packets(P, layout, spec, dev)
    b.gathered = E.alloc_packets(P, layout, spec, dev)
    b.y = torch.empty(n, dtype=torch.float16, device=dev)
    b.amax = torch.empty(1, device=dev)
    b.out_tab = E.packet_table([None, *b.send[1:]], layout, spec)  # rank 0 sends segments 1 .. P-1
    b.gat_tab = E.packet_table(list(b.gathered), layout, spec)
    return b


def load_ds_quantizer():
    try:
        from deepspeed.ops.op_builder import QuantizerBuilder

        t0 = time.perf_counter()
        mod = QuantizerBuilder().load(verbose=False)
        return mod, None, time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - recorded in the table
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-bytes", default="64M")
    ap.add_argument("--max-bytes", default="1G")
    ap.add_argument("--factor", type=int, default=2)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None, help="write all numbers here")
    ap.add_argument("--only", default=None, help="comma-separated row names to time (default: every row)")
    args = ap.parse_args()
    only = None if args.only is None else set(args.only.split(","))
    if only is not None and not only <= set(ROWS):
        ap.error(f"--only: unknown rows {sorted(only - set(ROWS))} (rows: {', '.join(ROWS)})")

    import echo_ds.ops as E
    from echo_ds.compensator import Compensator
    from echo_ds.config import DirectionConfig

    t0 = time.perf_counter()
    E.load()
    echo_load_s = time.perf_counter() - t0
    want_ds = only is None or bool(only & {"ds_quantize", "ds_dequantize"})
    # DeepSpeed's quantizer is built only where its rows are asked for (its JIT build takes over a minute).
    ds, ds_error, ds_load_s = load_ds_quantizer() if want_ds else (None, "not asked for (--only)", None)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
          f"echo load {echo_load_s:.1f}s; ds quantizer: "
          f"{'load %.1fs' % ds_load_s if ds else ('FAILED: ' if want_ds else '') + ds_error}")

    # Copy bandwidth of a 1 GB copy: the ceiling every row is compared with. Two copies: copy_ (a
    # cudaMemcpyAsync, timed with plain launches: captured into a graph it became a copy-engine memcpy
    # node at 2.7 TB/s in the first run) and an elementwise kernel (neg, out=); the faster one counts.
    big = torch.empty(1 << 29, dtype=torch.float16, device=dev).normal_()
    big_out = torch.empty_like(big)
    t_memcpy = time_op(lambda: big_out.copy_(big), args.reps, args.iters, graph=False)[0]
    t_kernel = time_op(lambda: torch.neg(big, out=big_out), args.reps, args.iters)[0]
    copy_bw = 2 * big.numel() * 2 / (min(t_memcpy, t_kernel) * 1e-3)
    print(f"copy bandwidth (1 GB, read + write): copy_ {4 * big.numel() / t_memcpy / 1e9:.3f} TB/s, "
          f"elementwise kernel {4 * big.numel() / t_kernel / 1e9:.3f} TB/s; ceiling {copy_bw / 1e12:.3f} TB/s")
    big = big_out = None  # frees the 2 GB (not del: the timed lambdas above name them)

    rows = []
    comp_rows = []
    sizes = []
    s = parse_bytes(args.min_bytes)
    while s <= parse_bytes(args.max_bytes):
        sizes.append(s)
        s *= args.factor

    spec = QuantSpec(bits=4, group_size=G_SIZE, quantizer="zero_aware")
    spec_rot = QuantSpec(bits=4, group_size=G_SIZE, quantizer="zero_aware", rotation=True)
    comp = Compensator(DirectionConfig(state_dtype="bf16"))  # the format of stage_buffers' m1, m2
    coeffs = E.CompensatorCoefficients.of(comp)

    for size in sizes:
        n = size // 2
        b = stage_buffers(n, spec, dev)
        layout = b.layout
        G, S, padded = layout.groups_per_segment, layout.segment_numel, layout.padded_numel
        x, m1, m2, send, gathered = b.x, b.m1, b.m2, b.send, b.gathered
        y, amax, out_tab, gat_tab = b.y, b.amax, b.out_tab, b.gat_tab
        del b
        cb = S // 2 + 4 * G  # one segment's codes + params
        results = {}

        def add(name, fn, nbytes, check=""):
            assert name in ROWS, f"row {name!r} missing from ROWS"
            if only is not None and name not in only:
                return
            med, lo, hi = time_op(fn, args.reps, args.iters)
            bw = nbytes / (med * 1e-3)
            results[name] = med
            rows.append(dict(size=size, op=name, ms=med, lo=lo, hi=hi, bytes=nbytes, gbps=bw / 1e9,
                             pct_copy=100 * bw / copy_bw, check=check))
            print(f"{size >> 20:6d} MB  {name:22s} {med:8.4f} ms [{lo:.4f}-{hi:.4f}]  {bw / 1e9:8.1f} GB/s  "
                  f"{100 * bw / copy_bw:5.1f}% copy  {check}")

        xc = torch.empty_like(x)
        add("copy", lambda: torch.neg(x, out=xc), 2 * 2 * n)

        if ds is not None:
            groups = n // G_SIZE
            try:
                q, params = ds.quantize(x, groups, 4, ds.Asymmetric)
                back = ds.dequantize(q, params, groups, 4, ds.Asymmetric)
                rel = float((back.float() - x.float()).norm() / x.float().norm())
                add("ds_quantize", lambda: ds.quantize(x, groups, 4, ds.Asymmetric), 2 * n + n // 2 + 8 * groups,
                    f"rel.err {rel:.3f}")
                add("ds_dequantize", lambda: ds.dequantize(q, params, groups, 4, ds.Asymmetric),
                    n // 2 + 8 * groups + 2 * n)
            except Exception as e:  # noqa: BLE001
                rows.append(dict(size=size, op="ds_quantize", ms=None, check=f"FAILED {type(e).__name__}: {e}"))
                print(f"  ds quantizer failed: {e}")
        elif want_ds:
            rows.append(dict(size=size, op="ds_quantize", ms=None, check=f"build FAILED: {ds_error}"))

        sent = (P - 1) * S  # elements of the sent segments: the entry reads their x (and state) only
        base = 2 * sent + (P - 1) * cb

        def entry(spec=spec, out=out_tab, **kw):
            return lambda: E.push_quantize(x, rank=0, world_size=P, spec=spec, out=out, **kw)

        # Correctness at this size: the entry's first sent segment vs the reference.
        E.push_quantize(x, rank=0, world_size=P, spec=spec, out=out_tab)
        segs = A.to_segments(x.reshape(1, -1), layout)[0]
        rc, rsc, rz = A.quantize_segments(segs[1], spec)
        kc, ks, kz = E.packet_views(send[1], layout, spec)
        ok = torch.equal(kc, rc) and torch.equal(ks.view(torch.int16), rsc.view(torch.int16))
        del segs, rc, rsc, rz
        add("entry", entry(), base, "bit-exact" if ok else "MISMATCH")
        add("entry+comp", entry(m1=m1, m2=m2, coeffs=coeffs), base + 4 * sent)
        add("entry+rot", entry(spec=spec_rot), base)
        add("entry+sym", entry(spec=QuantSpec(bits=4, group_size=G_SIZE, quantizer="symmetric")), base)
        add("entry+naive", entry(spec=QuantSpec(bits=4, group_size=G_SIZE, quantizer="naive")), base)
        if only is None or "entry+8bit" in only:
            spec8 = QuantSpec(bits=8, group_size=G_SIZE, quantizer="zero_aware")
            send8 = E.alloc_packets(P, layout, spec8, dev)
            tab8 = E.packet_table([None, *send8[1:]], layout, spec8)
            add("entry+8bit", entry(spec=spec8, out=tab8), 2 * sent + (P - 1) * (S + 4 * G))
            send8 = tab8 = None
        add("entry+comp+local", entry(m1=m1, m2=m2, coeffs=coeffs, update_state=True), base + 8 * sent)
        add("entry+comp+rot+local", entry(spec=spec_rot, m1=m1, m2=m2, coeffs=coeffs, update_state=True),
            base + 8 * sent)
        add("pow2_amax", lambda: E.pow2_amax(x, amax, world_size=P, spec=spec), 2 * n)
        copies = E.packet_table([None, *send[1:]], layout, spec)
        owner_out = E.packet_table([gathered[0], None, None, None], layout, spec)
        owner_bytes = 2 * S + (P - 1) * cb + cb

        def owner(spec=spec, **kw):
            return lambda: E.owner_reduce(x, rank=0, world_size=P, spec=spec, copies=copies, out=owner_out, **kw)
        add("owner_reduce", owner(), owner_bytes)
        add("owner_reduce+comp", owner(m1=m1, m2=m2, coeffs=coeffs), owner_bytes + 4 * S)
        add("owner_reduce+rot", owner(spec=spec_rot), owner_bytes)
        add("owner_reduce+comp+rot+local", owner(spec=spec_rot, m1=m1, m2=m2, coeffs=coeffs, update_state=True),
            owner_bytes + 8 * S)
        for j in range(1, P):
            gathered[j].copy_(send[j])
        E.dequantize(y, world_size=P, spec=spec, gathered=gat_tab)
        s_hat = torch.stack([A.dequantize_segments(*E.packet_views(gathered[j], layout, spec), spec) for j in range(P)])
        ok = torch.equal(y.view(torch.int16), A.from_segments(s_hat, layout, (n,), torch.float16).view(torch.int16))
        del s_hat
        add("dequantize", lambda: E.dequantize(y, world_size=P, spec=spec, gathered=gat_tab), P * cb + 2 * n,
            "bit-exact" if ok else "MISMATCH")
        add("dequantize+rot", lambda: E.dequantize(y, world_size=P, spec=spec_rot, gathered=gat_tab), P * cb + 2 * n)
        add("dequantize+update", lambda: E.dequantize(y, world_size=P, spec=spec, gathered=gat_tab, x=x, m1=m1, m2=m2,
                                                      coeffs=coeffs), P * cb + 2 * n + 2 * n + 8 * padded)

        # The unfused compensator as PyTorch ops: apply (c, x' = x + c) before the all-reduce, update after.
        tc = Compensator(DirectionConfig(state_dtype="bf16"))  # holds the stage buffers' bf16 m1, m2
        tc.m1, tc.m2 = m1.clone(), m2.clone()
        xf = x.float()
        yf = y.float()
        pad = padded - n

        def torch_comp():
            c = tc.correction(tc.m1.shape, dev)
            xp = torch.nn.functional.pad(xf, (0, pad)) + c
            tc.update(xp - torch.nn.functional.pad(yf, (0, pad)) / P)
        add("torch_compensator", torch_comp, 2 * n + 8 * padded + 2 * n)
        tc = xf = yf = None

        # The default configuration's three passes with quantizer "zero_aware_int" at g = 64: the same wire
        # bytes per segment (cb), twice the groups.
        if only is None or only & {r for r in ROWS if r.endswith("/int64")}:
            spec64 = QuantSpec(bits=4, group_size=64, quantizer="zero_aware_int", rotation=True)
            b64 = stage_buffers(n, spec64, dev)
            b64.x.copy_(x)
            E.push_quantize(b64.x, rank=0, world_size=P, spec=spec64, out=b64.out_tab)
            segs = A.rotate_if(A.to_segments(x.reshape(1, -1), b64.layout), spec64)[0]
            rc, rsc, rz = A.quantize_segments(segs[1], spec64)
            kc, ks, _ = E.packet_views(b64.send[1], b64.layout, spec64)
            words = Q.pack_params(rsc.reshape(-1), rz.reshape(-1), 4).to(torch.int16)
            ok = torch.equal(kc, rc.reshape(kc.shape)) and torch.equal(ks.view(torch.int16), words)
            del segs, rc, rsc, rz
            add("entry+comp+rot+local/int64",
                lambda: E.push_quantize(b64.x, rank=0, world_size=P, spec=spec64, out=b64.out_tab, m1=b64.m1,
                                        m2=b64.m2, coeffs=coeffs, update_state=True), base + 8 * sent,
                "bit-exact" if ok else "MISMATCH")
            copies64 = E.packet_table([None, *b64.send[1:]], b64.layout, spec64)
            out64 = E.packet_table([b64.gathered[0], None, None, None], b64.layout, spec64)
            add("owner_reduce+comp+rot+local/int64",
                lambda: E.owner_reduce(b64.x, rank=0, world_size=P, spec=spec64, copies=copies64, out=out64,
                                       m1=b64.m1, m2=b64.m2, coeffs=coeffs, update_state=True), owner_bytes + 8 * S)
            for j in range(1, P):
                b64.gathered[j].copy_(b64.send[j])
            add("dequantize+rot/int64", lambda: E.dequantize(b64.y, world_size=P, spec=spec64, gathered=b64.gat_tab),
                P * cb + 2 * n)
            b64 = copies64 = out64 = None

        for residual, uncompensated, compensated in COMPENSATOR_SUMS:
            if set(uncompensated + compensated) <= set(results):
                t_uncomp = sum(results[r] for r in uncompensated)
                t_comp = sum(results[r] for r in compensated)
                per_elem = (t_comp - t_uncomp) * 1e-3 * copy_bw / padded
                comp_rows.append(dict(size=size, residual=residual, uncompensated_ms=t_uncomp, comp_ms=t_comp,
                                      added_ms=t_comp - t_uncomp, bytes_per_element=per_elem))
                print(f"{size >> 20:6d} MB  compensator, residual {residual}: {t_uncomp:.4f} -> {t_comp:.4f} ms per "
                      f"rank (+{t_comp - t_uncomp:.4f} ms = {per_elem:.1f} bytes/element at copy bandwidth)")
        x = m1 = m2 = send = gathered = y = None  # this size's buffers go
        torch.cuda.empty_cache()

    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), device=props.name,
                torch=torch.__version__, copy_bw_tbps=copy_bw / 1e12, echo_load_s=echo_load_s,
                ds_load_s=ds_load_s, ds_error=ds_error, command=" ".join(sys.argv))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows, compensator=comp_rows), indent=1))

    print("\n| size | op | median ms | min-max ms | GB/s | % copy | check |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for r in rows:
        if r.get("ms") is None:
            print(f"| {r['size'] >> 20} MB | {r['op']} | - | - | - | - | {r['check']} |")
        else:
            print(f"| {r['size'] >> 20} MB | {r['op']} | {r['ms']:.4f} | {r['lo']:.4f}-{r['hi']:.4f} | "
                  f"{r['gbps']:.0f} | {r['pct_copy']:.1f} | {r['check']} |")
    if comp_rows:
        print("\nThe compensator per rank and call: entry + owner reduce + dequantize with the state against "
              "without it (same rotation); bytes/element = added time x copy bandwidth / padded elements.\n")
        print("| size | residual | uncompensated ms | compensated ms | added ms | bytes/element |")
        print("|---:|---|---:|---:|---:|---:|")
        for r in comp_rows:
            print(f"| {r['size'] >> 20} MB | {r['residual']} | {r['uncompensated_ms']:.4f} | {r['comp_ms']:.4f} | "
                  f"{r['added_ms']:.4f} | {r['bytes_per_element']:.1f} |")


if __name__ == "__main__":
    main()
