"""A small demonstration of the compensated all-reduce on CPU ranks (gloo).

    python -m echo_ds.demo                 # 2 ranks, 56 sites, 4 bits
    python -m echo_ds.demo --ranks 4 --bits 8 --sites 28

Each rank holds random partials of a pre-norm residual stream: at every site the all-reduced sum is
added to the stream, so the deviation at the end is the partial sum of the errors the sites injected.
The demo runs the same sites through the reference Echo all-reduce without and with compensation and
prints, against the exact sum: the mean error of one call and the deviation accumulated over the pass.

With compensation the error of one call is expected to be larger, not smaller: each rank sends
x_i + c_i, where the correction c_i cancels the rounding errors earlier calls left in the stream, so a
call's output differs from that call's exact sum by the correction as well as by its own rounding. What
compensation buys is the second column: the accumulated deviation, which is what the model sees.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# Printed under the table when a compensated variant's one-call error exceeds the uncompensated one.
WHY_ONE_CALL_IS_LARGER = (
    "With compensation one call's error is larger by design: each rank sends its contribution plus the\n"
    "correction that cancels the errors earlier calls left in the stream, so a call's output also differs\n"
    "from that call's exact sum by the correction. The accumulated column is what the model sees.")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, args, queue):
    from echo_ds.compensator import make_compensator
    from echo_ds.config import EchoConfig
    from echo_ds.reference import echo_all_reduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    gen = torch.Generator().manual_seed(1234 + rank)
    # Activation-like partials: a per-channel offset that repeats from site to site plus fresh noise.
    offset = torch.randn(args.numel, generator=gen) * 0.5
    sites = [offset + torch.randn(args.numel, generator=gen) for _ in range(args.sites)]
    rows = []
    paper = {"rotation": "none", "forward": {"residual": "output", "gain": 0.75}}
    for name, section in (("no compensation", {"rotation": "none", "forward": {"compensate": False}}),
                          ("echo, the paper's method", paper),
                          ("echo, residual local, gain 1", {"rotation": "none"}),
                          ("echo defaults (+ hadamard)", {})):
        cfg = EchoConfig(bits=args.bits, **section)
        comp = make_compensator(cfg.forward)
        spec = cfg.quant_spec()
        call_err, deviation = 0.0, torch.zeros(args.numel)
        for x in sites:
            y = echo_all_reduce(x, spec, compensator=comp)
            exact = x.clone()
            dist.all_reduce(exact)
            call_err += (y - exact).norm().item() / exact.norm().item()
            deviation += y - exact
        stream = sum(sites)  # this rank's share of the exact stream, for scale
        dist.all_reduce(stream)
        rows.append((name, call_err / len(sites), deviation.norm().item() / stream.norm().item()))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main(argv=None):
    from echo_ds.quant import SUPPORTED_BITS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--bits", type=int, default=4, choices=SUPPORTED_BITS)
    p.add_argument("--sites", type=int, default=56, help="all-reduce calls per pass (2 x layers)")
    p.add_argument("--numel", type=int, default=1 << 16, help="elements per call")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, args.ranks, port, args, queue)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    rows = queue.get(timeout=600)
    for proc in procs:
        proc.join()
    if any(proc.exitcode for proc in procs):
        raise SystemExit("a rank failed")
    print(f"Echo all-reduce, {args.ranks} CPU ranks (gloo), {args.bits}-bit, {args.sites} sites of "
          f"{args.numel} elements")
    print(f"{'variant':32s} {'error of one call':>18s} {'accumulated over the pass':>26s}")
    for name, call_err, acc_err in rows:
        print(f"{name:32s} {call_err:18.4%} {acc_err:26.4%}")
    print("(errors are relative L2 norms against the exact fp32 sum; the accumulated column is the "
          "deviation of the residual stream)")
    if any(call_err > rows[0][1] for _, call_err, _ in rows[1:]):
        print(WHY_ONE_CALL_IS_LARGER)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
