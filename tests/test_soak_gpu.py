"""Long runs on the p2p backend (issue 35, item 4; the GPU test is skipped without a CUDA device; a short run
of the same loop on the CPU's host transport checks the loop itself). On one H100 (2026-12-06, ranks
sharing it): 100,000 calls per world size, results in benchmarks/RESULTS.md, "Long runs".

At P = 2 and 4 (ranks sharing the GPU as in tests/test_p2p_gpu.py): ``ECHO_SOAK_CALLS`` (default 100,000)
mixed calls, 1 element to 64 MiB, the three dtypes, 4 and 8 bits, compensated (both residuals; every
``kCompEvery``-th call) or not, eager calls with a CUDA graph replay interleaved every ``kReplayEvery``
calls. Checked:

* zero mismatches against the emulator on this device: every compensated call (the emulator's
  compensator state follows every call of its configuration, on rank i mod P for configuration i), every
  ``kCheckEvery``-th uncompensated call up to ``kEveryCallUpTo`` elements and graph replay, every
  ``kLargeEvery``-th larger call (spread over the ranks); all ranks' outputs are folded into a digest
  compared across ranks at every checkpoint. (The ranks move in lockstep, so the emulator's time adds up
  over the calls it checks: checking every call, 2,000 calls took 16 s on the H100 at P = 2 and 4.)
  Every checkpoint prints the calls made, the mismatches and comparisons so far, and rank 0's memory;
* device memory flat: ``torch.cuda.memory_allocated()`` and ``memory_reserved()`` after the warm-up
  (the first checkpoint) never grow past that level plus ``kDeviceSlackBytes``;
* host memory flat: the resident set size grows by at most ``kHostSlackBytes`` after the warm-up.

Run on a GPU node, from the repository root:
``ECHO_SOAK_CALLS=100000 python -m pytest -q -s tests/test_soak_gpu.py`` (MPS on, as benchmarks/p2p_gpu.sh
starts it); ``ECHO_SOAK_CALLS=2000`` for a smoke run.
"""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch

import p2p_suite
from echo_ds.compensator import make_compensator
from echo_ds.config import DirectionConfig
from echo_ds.emulate import emulated_echo_all_reduce
from echo_ds.quant import QuantSpec
from host_transport import HostTransport
from utils import run_distributed

MIB = 1 << 20
kCalls = int(os.environ.get("ECHO_SOAK_CALLS", 100_000))
kSizes = (1, 7, 127, 4097, 65_537, 1_000_003, 4 * MIB + 3, 32 * MIB)  # elements; 32 Mi bf16 = 64 MiB
kCompSizes = (127, 4097, 65_537, 1_000_003)  # compensated calls (the emulator follows every one of them)
kEveryCallUpTo = 1_000_003
kCompEvery = 4  # every 4th call is compensated (the four compensated configurations in turn)
kCheckEvery = 3  # uncompensated calls up to kEveryCallUpTo elements, and graph replays: every 3rd compared
kLargeEvery = 20  # larger uncompensated calls: every 20th compared
kReplayEvery = 10
kCheckpointEvery = 5000
kDeviceSlackBytes = 4 * MIB
kHostSlackBytes = 64 * MIB


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _soak(rank, world_size, num_calls, host=False):
    """The soak body; ``host``: a CPU smoke run of the same loop on the host transport (small sizes, no
    graph, no device memory), so that the body itself is exercised where no GPU is."""
    from echo_ds.p2p import EchoBuffer

    P = world_size
    sizes_all, comp_sizes = (kSizes, kCompSizes) if not host else ((1, 127, 4097), (127, 4097))
    if host:
        device = torch.device("cpu")
        buf = EchoBuffer(max_numel=1 << 16, timeout_s=30.0, transport=HostTransport)
    else:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        buf = EchoBuffer(max_numel=max(kSizes), timeout_s=30.0)
    assert buf.active, buf.reason
    same = p2p_suite.same_bits
    configs = []  # (spec, residual or None, pow2)
    for bits in (4, 8):
        for residual in (None, "local", "output"):
            configs.append((QuantSpec(bits, 64, "zero_aware_int" if bits == 4 else "zero_aware", True), residual,
                            "auto" if residual != "output" else True))
    states = {i: (make_compensator(DirectionConfig(residual=r)), make_compensator(DirectionConfig(residual=r)))
              for i, (_, r, _) in enumerate(configs) if r is not None}
    compensated = [i for i, c in enumerate(configs) if c[1] is not None]
    uncompensated = [i for i, c in enumerate(configs) if c[1] is None]
    dtypes = (torch.bfloat16, torch.float16, torch.float32)

    # One captured call (4-bit, uncompensated), replayed with new inputs between the eager calls.
    g_spec, g_n = QuantSpec(4, 64, "zero_aware_int", True), 65_537
    graph = None
    if not host:
        static_x = torch.zeros(g_n, dtype=torch.bfloat16, device=device)
        buf.all_reduce(static_x, g_spec)  # warm-up: the schedule of this shape
        buf.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = buf.all_reduce(static_x, g_spec)

    running = torch.zeros((), dtype=torch.int64, device=device)
    mismatches, compared, compared_large, replays, plain = [], 0, 0, 0, 0
    marks = []  # (call, allocated, reserved, rss) at checkpoints
    t0 = time.perf_counter()
    for call in range(num_calls):
        seed = 1_000_003 * call + 17
        if graph is not None and call % kReplayEvery == kReplayEvery - 1:
            parts = p2p_suite.parts_for(P, g_n, torch.bfloat16, seed, device)
            static_x.copy_(parts[rank])
            graph.replay()
            check = replays % kCheckEvery == 0 and (replays // kCheckEvery) % P == rank
            y, expected = static_y, (emulated_echo_all_reduce(parts, g_spec) if check else None)
            replays += 1
        else:
            # The cycles of configuration, size and dtype have coprime periods, so that every combination
            # comes round.
            if call % kCompEvery == kCompEvery - 1:
                ci = compensated[(call // kCompEvery) % len(compensated)]
            else:
                ci = uncompensated[(call // kCompEvery) % len(uncompensated)]
            spec, residual, pow2 = configs[ci]
            # A compensated configuration keeps one size, so that its state carries from call to call.
            n = comp_sizes[ci % len(comp_sizes)] if residual else sizes_all[(call // 2) % len(sizes_all)]
            dtype = dtypes[(call // 5) % len(dtypes)]
            parts = p2p_suite.parts_for(P, n, dtype, seed, device)
            comp, comp_emul = states.get(ci, (None, None))
            y = buf.all_reduce(parts[rank].clone(), spec, compensator=comp, pow2_rescale=pow2)
            if comp is not None:
                # its emulator runs at every one of its calls (its state must follow them all), on one rank
                check = rank == ci % P
            else:
                every = kCheckEvery if n <= kEveryCallUpTo else kLargeEvery
                check = plain % every == 0 and (plain // every) % P == rank
                plain += 1
            expected = emulated_echo_all_reduce(parts, spec, comp_emul, pow2) if check else None
            compared_large += int(check and n > kEveryCallUpTo)
        if expected is not None:
            compared += 1
            if not same(y, expected):
                mismatches.append(call)
        w = torch.arange(y.numel(), device=device, dtype=torch.int64) % 65521 + 1
        view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[y.dtype]
        running += (torch.nan_to_num(y).view(view).to(torch.int64) * w).sum() * (call % 1009 + 1)
        if call % kCheckpointEvery == kCheckpointEvery - 1 or call == num_calls - 1:
            buf.synchronize()
            gc.collect()
            assert p2p_suite.all_same(int(running)), f"call {call}: the ranks' digests differ"
            device_bytes = (0, 0) if host else (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
            marks.append((call,) + device_bytes + (_rss_bytes(),))
            # progress, so that a run cut short by its time limit still says how far it got
            totals = [None] * P
            torch.distributed.all_gather_object(totals, (len(mismatches), compared))
            if rank == 0:
                print(f"soak P={P}: {call + 1} calls, {time.perf_counter() - t0:.0f} s, "
                      f"{sum(t[0] for t in totals)} mismatches in {sum(t[1] for t in totals)} compared; rank 0 "
                      f"(call, allocated, reserved, rss): {marks[-1]}", flush=True)
    secs = time.perf_counter() - t0
    buf.close()
    return {"mismatches": mismatches, "compared": compared, "compared_large": compared_large, "replays": replays,
            "marks": marks, "secs": secs}


def test_soak_body_on_the_host_transport():
    """The loop itself on a CPU (host transport, 120 calls, no graph): bit-identical to the emulator."""
    results = run_distributed(_soak, 2, 120, True, timeout=120)
    assert all(r["mismatches"] == [] for r in results) and sum(r["compared"] for r in results) >= 50


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("world_size", (2, 4))
def test_soak_zero_mismatches_and_flat_memory(world_size):
    results = run_distributed(_soak, world_size, kCalls, timeout=max(600.0, kCalls * 0.05))
    for rank, r in enumerate(results):
        assert r["mismatches"] == [], f"rank {rank}: calls that differ from the emulator: {r['mismatches'][:20]}"
        marks = r["marks"]
        _, alloc0, reserved0, rss0 = marks[0]
        for call, alloc, reserved, rss in marks[1:]:
            assert alloc <= alloc0 + kDeviceSlackBytes, (rank, call, alloc, alloc0)
            assert reserved <= reserved0 + kDeviceSlackBytes, (rank, call, reserved, reserved0)
            assert rss <= rss0 + kHostSlackBytes, (rank, call, rss, rss0)
    compared = [r["compared"] for r in results]
    assert all(c > 0 for c in compared) and results[0]["replays"] > 0, compared
    assert sum(r["compared_large"] for r in results) > 0 or kCalls < 2000
    print(f"soak P={world_size}: {kCalls} calls in {results[0]['secs']:.0f} s, {sum(compared)} compared with the "
          f"emulator (per rank {compared}), {results[0]['replays']} graph replays, memory marks (call, allocated, "
          f"reserved, rss) of rank 0: {results[0]['marks']}")
