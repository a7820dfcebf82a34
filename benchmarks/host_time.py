"""Host time to issue one Echo call, part by part (issue 31: <= 10 us at every size).

    python benchmarks/host_time.py                      # P = 2 ranks on the visible GPU, 64 KiB and 64 MiB
    python benchmarks/host_time.py --world-size 4 --sizes 65536,1073741824

Every row is the median, over ``--batches`` batches, of one batch's host seconds divided by its ``--batch``
back-to-back issues (the GPU drained and the ranks met at a barrier between batches, so the launch queue
never fills and the host never waits for it). Rows:

  call          EchoBuffer.all_reduce (one-launch path, plan cached): what a tensor-parallel layer pays;
  runtime       the extension's call alone (P2PRuntime.call: pybind, the error record's words, the
                checks against the plan, y's allocation, the stream, the launch);
  the parts     of the Python around it, each alone: the plan key and its lookup, the state's tensors;
                and, for comparison, what allocating y from Python costs (torch.empty_like);
  pybind floor  a property of the runtime (the price of crossing into C++ and back);
  empty launch  torch's smallest kernel (x.zero_() on one element) from Python.

The collective rows (call, runtime) run on every rank in the same order; the others are local.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.utils import run_distributed  # noqa: E402


def _per_issue(fn, batch, batches, dev) -> float:
    secs = []
    for _ in range(batches + 1):
        torch.cuda.synchronize(dev)
        dist.barrier()
        t = time.perf_counter()
        for _ in range(batch):
            fn()
        secs.append((time.perf_counter() - t) / batch)
    return statistics.median(secs[1:])  # the first batch warms caches


def body(rank, world_size, args):
    from echo_ds.compensator import make_compensator
    from echo_ds.config import ForwardConfig
    from echo_ds.p2p import EchoBuffer
    from echo_ds.quant import QuantSpec

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    spec = QuantSpec(4, 64, "zero_aware_int", rotation=True)
    buf = EchoBuffer(max_numel=max(args["sizes"]) // 2, stages="fused")
    assert buf.active and buf.one_launch is not None, buf.reason
    batch, batches = args["batch"], args["batches"]
    tiny = torch.zeros(1, device=dev)
    rt = buf.one_launch.runtime  # the extension object itself: its calls are pybind calls
    rows = {"pybind floor": _per_issue(lambda: rt.max_blocks, batch, batches, dev),
            "empty launch": _per_issue(tiny.zero_, batch, batches, dev)}
    for size in args["sizes"]:
        x = torch.randn(size // 2, device=dev).to(torch.bfloat16)
        for label in ("uncompensated", "compensated"):
            comp = make_compensator(ForwardConfig()) if label == "compensated" else None
            call = lambda: buf.all_reduce(x, spec, compensator=comp, pow2_rescale=False)  # noqa: E731
            call()  # the plan and the state exist from here on
            buf.synchronize()
            (key, plan), = [(k, p) for k, p in buf.one_launch.plans.items()
                            if k[1] == x.numel() and (k[5] is None) == (comp is None)]
            state = [None if n is None else getattr(comp, n) for n in plan.state_names]
            runtime = ((lambda: rt.call(plan.index, x)) if comp is None  # noqa: E731
                       else (lambda: rt.call_compensated(plan.index, x, *state)))
            r = {"call": _per_issue(call, batch, batches, dev),
                 "runtime": _per_issue(runtime, batch, batches, dev),
                 "key and lookup": _per_issue(lambda: buf.one_launch.plans.get(
                     (x.dtype, x.numel(), x.device, spec, False, None if comp is None else comp.kernel_key, None,
                      None)), batch, batches, dev),
                 "empty_like": _per_issue(lambda: torch.empty_like(x), batch, batches, dev)}
            if comp is not None:
                r["state tensors"] = _per_issue(lambda: [None if n is None else getattr(comp, n)
                                                         for n in plan.state_names], batch, batches, dev)
            buf.synchronize()
            rows[f"{size} {label}"] = r
    buf.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--sizes", default=f"{64 << 10},{64 << 20}", help="message bytes (bf16), comma-separated")
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--batches", type=int, default=20)
    args = ap.parse_args(argv)
    cfg = {"sizes": [int(s) for s in args.sizes.split(",")], "batch": args.batch, "batches": args.batches}
    res = run_distributed(body, args.world_size, cfg, timeout=600)[0]
    print(f"host time per issue, rank 0 of P = {args.world_size} ({torch.cuda.get_device_name(0)}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; median of {args.batches} batches of {args.batch})")
    print(f"pybind floor {res['pybind floor'] * 1e6:.2f} us, empty launch {res['empty launch'] * 1e6:.2f} us")
    cols = list(dict.fromkeys(c for v in res.values() if isinstance(v, dict) for c in v))  # in order, once each
    print("| message | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, r in res.items():
        if isinstance(r, dict):
            print(f"| {name} | " + " | ".join(f"{r[c] * 1e6:.2f} us" if c in r else "" for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
