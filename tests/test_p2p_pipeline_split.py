"""The staged pipeline's executor apart from its owner (issue 31): EchoBuffer routes a staged call to
echo_ds.p2p.stages.StagedPipeline, which keeps the schedule cache. On the host transport (two CPU ranks):
the cache stays bounded and evicts the least recently used schedule that no CUDA graph pinned, a schedule
built again after its eviction gives the same bits as the first, the buffer counts one call per call, and
close() empties the cache."""

import torch

from host_transport import HostTransport
import p2p_suite
from echo_ds.quant import QuantSpec
from utils import run_distributed


def _cache_body(rank, world_size, cfg):
    from echo_ds.p2p import EchoBuffer
    from echo_ds.p2p.stages import StagedPipeline, kScheduleCacheSize

    P = world_size
    buf = EchoBuffer(max_numel=1 << 16, tile_bytes=0, timeout_s=30.0, transport=HostTransport)
    assert buf.active, buf.reason
    pipeline = buf._pipeline
    assert isinstance(pipeline, StagedPipeline) and pipeline.streams == {}, "the host transport has no streams"
    assert buf._schedules is pipeline.schedules, "benchmarks/bench_p2p.py reads the cache through the buffer"
    spec = QuantSpec(4, 128)
    # One schedule per segment size: a message of k * P * g elements has segments of k * g.
    sizes = [(k + 1) * P * spec.group_size for k in range(kScheduleCacheSize + 2)]

    def call(i):
        before = buf.num_calls
        x = p2p_suite.parts_for(P, sizes[i], torch.float32, 700 + i, "cpu")[rank]
        y = buf.all_reduce(x, spec)
        assert buf.num_calls == before + 1, f"call of {sizes[i]} elements counted {buf.num_calls - before} times"
        return x, y

    def cached():
        return [key.segment_numel * P for key in pipeline.schedules]

    first = [call(i)[1] for i in range(len(sizes))]
    assert cached() == sizes[2:], "the cache keeps the most recent schedules, in the order of their use"
    _, y0 = call(0)  # built again: the oldest, sizes[2], goes
    assert p2p_suite.same_bits(y0, first[0]), "a schedule built again gives other bits"
    assert cached() == sizes[3:] + sizes[:1]
    call(3)  # cached: used last now
    assert cached() == sizes[4:] + sizes[:1] + [sizes[3]]
    pipeline.schedules[next(iter(pipeline.schedules))].pinned = True  # as a capture pins it
    x1, y1 = call(1)
    assert cached() == [sizes[4]] + sizes[6:] + sizes[:1] + [sizes[3], sizes[1]], "a pinned schedule was evicted"
    assert p2p_suite.same_bits(y1, first[1])
    p2p_suite.CpuReference("assert").check(y1, x1, spec, what=f"{sizes[1]} elements after an eviction")
    assert buf.num_calls == len(sizes) + 3
    buf.close()
    assert len(pipeline.schedules) == 0, "close() left schedules behind"
    return len(sizes)


def test_schedule_cache_is_bounded_and_evicts_the_least_recent_unpinned():
    results = run_distributed(_cache_body, 2, {}, timeout=180)
    assert results == [results[0]] * 2 and results[0] > 32, results


def test_the_pipeline_runs_what_its_stages_run():
    """On the CUDA transport the staged pipeline runs the staged kernels only: it names why it cannot run a group
    size they are not built for (the call policy then sends the call to the reference path) and does not count
    range events (the staged kernels do not check them). A transport that brings its own stages (the tests' host
    transport: the torch stages) runs every group size and counts them; without the kernels loaded and without
    stages of its own, nothing runs."""
    from echo_ds import ops
    from echo_ds.p2p import layout as L
    from echo_ds.p2p.stages import StagedPipeline

    class Bare:
        kind = "host"  # no streams; no stages of its own

    class Own(Bare):
        schedule = object

    cap, cpu = L.Capacity(2, 1 << 12), torch.device("cpu")
    g16, g64 = QuantSpec(4, 16), QuantSpec(4, 64)
    kernels = StagedPipeline(Bare(), 0, 2, cap, cpu, ops)
    assert "group_size=16" in kernels.unsupported_reason(g16, torch.bfloat16)
    assert kernels.unsupported_reason(g64, torch.bfloat16) is None and not kernels.counts_range
    own = StagedPipeline(Own(), 0, 2, cap, cpu, None)
    assert own.unsupported_reason(g16, torch.bfloat16) is None and own.counts_range
    assert "not loaded" in StagedPipeline(Bare(), 0, 2, cap, cpu, None).unsupported_reason(g64, torch.bfloat16)
