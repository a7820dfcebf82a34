"""The p2p transport's pure parts: flag values and the release rule, error messages, the workspace
layout and tiling, the device-side pow2 exponent. No GPU, no processes."""

import itertools
import math

import pytest
import torch

from echo_ds import algorithm as A
from echo_ds.p2p import layout as L
from echo_ds.p2p import protocol as proto
from torch_stages import pow2_factors


# ----------------------------------------------------------------------------------------------------
# Flags
# ----------------------------------------------------------------------------------------------------

def test_flag_values_grow_by_three_per_call_and_never_repeat_within_a_stage():
    seen = {s: set() for s in proto.PUBLISH_STAGE_NAMES}
    for call in range(1, 2000):
        values = [proto.flag_value(call, s) for s in (proto.kStagePush, proto.kStageReduce, proto.kStageGather)]
        assert values == [3 * call, 3 * call + 1, 3 * call + 2]
        for s, v in zip(seen, values):
            assert v not in seen[s]
            seen[s].add(v)
    assert all(v != 0 for vs in seen.values() for v in vs), "0 is every fresh flag's value"


def test_release_is_equality_and_stale_values_never_release():
    for call in (1, 2, 77, 10**6):
        expected = proto.flag_value(call, proto.kStageGather)
        assert proto.released(expected, expected)
        # Early arrival: the slot still holds a value of an older call, or the fresh 0.
        for older in range(max(1, call - 5), call):
            for stage in proto.PUBLISH_STAGE_NAMES:
                assert not proto.released(proto.flag_value(older, stage), expected)
        assert not proto.released(0, expected)


def test_release_stays_sound_across_the_32_bit_wrap():
    wrap_call = (1 << 32) // 3  # 3c crosses 2^32 here
    for call in range(wrap_call - 3, wrap_call + 4):
        expected = proto.flag_value(call, proto.kStagePush)
        assert 0 <= expected <= proto.kFlagMask
        for older in range(call - 3, call):
            assert not proto.released(proto.flag_value(older, proto.kStagePush), expected)
    # A slot untouched for 2^31 calls: a serial-number ">=" would release here, equality does not.
    stale = proto.flag_value(5, proto.kStagePush)
    later = proto.flag_value(5 + (1 << 31) // 3 + 7, proto.kStagePush)
    assert ((stale - later) & proto.kFlagMask) < (1 << 31), "the case a serial-number comparison gets wrong"
    assert not proto.released(stale, later)


def test_decode_flag():
    assert proto.decode_flag(0) == (0, None)
    assert proto.decode_flag(proto.flag_value(41, proto.kStageGather)) == (41, proto.kStageGather)
    with pytest.raises(ValueError):
        proto.flag_value(1, 3)


def test_timeout_message_names_rank_peer_stage_and_call():
    f = proto.WaitFailure(proto.kErrorTimeout, rank=2, peer=3, stage=proto.kWaitTail, tile=5, call_index=17,
                          expected=proto.flag_value(17, proto.kStageGather),
                          seen=proto.flag_value(16, proto.kStageGather), waited_ns=int(5.01e9))
    msg = proto.describe_failure(f, 5.0, 4)
    for part in ("rank 2 of 4", "waiting for rank 3", "tail", "tile 5", "call 17", "gather of call 16",
                 "timeout 5 s", "ECHO_P2P_TIMEOUT_S"):
        assert part in msg, (part, msg)
    fresh = proto.describe_failure(f.__class__(**{**f.__dict__, "seen": 0, "stage": proto.kWaitAmax}), 5.0, 4)
    assert "never written" in fresh and "pow2" in fresh
    aborted = proto.describe_failure(f.__class__(**{**f.__dict__, "code": proto.kErrorAborted}), 5.0, 4)
    assert "closed" in aborted and "call 17" in aborted
    assert issubclass(proto.EchoP2PTimeout, proto.EchoP2PError)


# ----------------------------------------------------------------------------------------------------
# Layout
# ----------------------------------------------------------------------------------------------------

def test_signal_offsets_address_the_headers_arrays():
    # The arrays' origins are layout.SIGNALS_LAYOUT, checked against csrc/echo_p2p.h by
    # tests/test_kernels_compile.py; the strides are the header's array shapes.
    assert (L.kMaxWorld, L.kMaxTiles) == (8, 64)
    assert L.signal_offset("push", 0, 0) == 0
    assert L.signal_offset("gather", 1, 2) == 2048 + 4 * (64 + 2)
    assert L.signal_offset("amax", 3) == 4128 + 12
    assert L.signal_offset("probe", 2, 3) == 4160 + 4 * 11
    with pytest.raises(KeyError):
        L.signal_offset("nope")


def test_check_layout_names_what_drifted():
    class Extension:  # what check_layout reads of echo_ds.ops' module
        kP2PFlagsBytes, kP2PMaxBlocks = L.kFusedFlagsBytes, L.kFusedMaxBlocks

        def __init__(self, **changed):
            self.layout = {**L.SIGNALS_LAYOUT, "control_bytes": 128, **changed}

        def p2p_transport_layout(self):
            return self.layout

    L.check_layout(Extension())
    with pytest.raises(RuntimeError, match="signals.gather: 2048 here, 2052 compiled"):
        L.check_layout(Extension(**{"signals.gather": 2052}))
    drifted = Extension()
    drifted.kP2PMaxBlocks = 512
    with pytest.raises(RuntimeError, match="one-launch flag area"):
        L.check_layout(drifted)


@pytest.mark.parametrize("P", (2, 4, 8))
def test_tiling_covers_each_segment_once_in_aligned_tiles(P):
    cap = L.Capacity(P, 1 << 22)
    for numel, bits, g, tile_bytes in itertools.product((1, 1000, 123_457, 4_000_001), (4, 8), (16, 128, 4096),
                                                        (0, 4096, 1 << 20)):
        t = L.make_tiling(numel, P, bits, g, tile_bytes, cap)
        layout = A.Layout(numel, P, g)
        assert t.groups_per_segment == layout.groups_per_segment
        assert 1 <= t.num_tiles <= L.kMaxTiles
        ranges = [t.tile(i) for i in range(t.num_tiles)]
        assert ranges[0][0] == 0 and ranges[-1][1] == t.groups_per_segment
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        if t.num_tiles > 1:
            assert t.tile_groups % L.kTileGroupQuantum == 0
        assert t.fits(), (numel, bits, g)
        for slot in range(2 * P):
            assert t.code_offset(slot) % L.kSlotAlignBytes == 0 and t.scale_offset(slot) % 256 == 0
        with pytest.raises(IndexError):
            t.tile(t.num_tiles)


def _span(t, slots, offset_fn, size):
    return [(offset_fn(s), offset_fn(s) + size) for s in slots]


@pytest.mark.parametrize("P", (2, 4, 8))
def test_push_and_gather_halves_never_overlap_across_calls_of_different_sizes(P):
    """A rank that finished call n pushes call n + 1 while a peer may still decode the gathered codes of
    call n: the push slots of any size must miss the gather slots of any other size."""
    cap = L.Capacity(P, 1 << 20)
    tilings = [L.make_tiling(n, P, b, g, 0, cap) for n in (1, 999, 65_537, 1 << 20) for b in (4, 8)
               for g in (16, 128)]
    for a, b in itertools.product(tilings, repeat=2):
        push = _span(a, range(P), a.code_offset, a.code_stride) + [
            (a.scale_offset(s), a.scale_offset(s) + a.param_stride) for s in range(P)]
        gather = _span(b, range(P, 2 * P), b.code_offset, b.code_stride)
        gather_params = [(b.scale_offset(s), b.scale_offset(s) + b.param_stride) for s in range(P, 2 * P)]
        assert max(e for _, e in push[:P]) <= min(s for s, _ in gather) <= cap.code_bytes // 2 + 0
        assert max(e for _, e in push[P:]) <= min(s for s, _ in gather_params)
        assert max(e for _, e in gather) <= cap.code_bytes and max(e for _, e in gather_params) <= cap.param_bytes


def test_capacity_declines_what_does_not_fit():
    cap = L.Capacity(4, 1000)
    assert L.make_tiling(1000, 4, 8, 16, 0, cap).fits()
    assert L.make_tiling(1000, 4, 8, 4096, 0, cap).fits()  # padding to a whole 4096-group still fits
    assert not L.make_tiling(100_000, 4, 8, 16, 0, cap).fits()


def test_choose_tile_groups_targets_the_tile_bytes():
    assert L.choose_tile_groups(1000, 64, 0) == 1000
    assert L.choose_tile_groups(5000, 64, 68 * 80) == 80
    assert L.choose_tile_groups(5000, 64, 68 * 200) == 200
    assert L.choose_tile_groups(10_000, 64, 1) == L.kTileGroupQuantum * math.ceil(10_000 / 64 / 8)  # <= 64 tiles
    assert L.choose_tile_groups(5, 64, 1 << 20) == 5


def test_wire_bytes_per_rank():
    # 4 ranks, 1024 elements, g = 128, 4 bits: segments of 2 groups of 64 + 4 bytes.
    assert L.wire_bytes_per_rank(1024, 4, 4, 128) == 2 * 3 * 2 * 68


# ----------------------------------------------------------------------------------------------------
# The device-side pow2 exponent equals the reference's host-side one
# ----------------------------------------------------------------------------------------------------

def test_pow2_factors_match_the_reference_exponent():
    values = [0.0, 1.0, 1e-7, 3.5e-39, 1.4e-45, 65504.0, 3.4e38, 2.0**14, 2.0**15 - 1, 2.0**15, 0.75,
              float("inf"), float("nan"), -2.5]
    gen = torch.Generator().manual_seed(0)
    values += (torch.rand(200, generator=gen) * 10 ** torch.randint(-40, 38, (200,), generator=gen).float()).tolist()
    for v in values:
        a = torch.tensor(v, dtype=torch.float32)
        k = A.pow2_exponent(a.abs() if not math.isnan(v) else a)
        up, down = pow2_factors(a.abs() if not math.isnan(v) else a)
        assert up.item() == 2.0**k and down.item() == 2.0**-k, (v, k, up.item())


# ----------------------------------------------------------------------------------------------------
# The one-launch call's flag area and error records
# ----------------------------------------------------------------------------------------------------

def _header_constant(name: str) -> int:
    import re

    from echo_ds.ops.builder import CSRC_DIR

    text = (CSRC_DIR / "echo_api.cuh").read_text()
    m = re.search(rf"constexpr int {name} = (\d+);", text)
    assert m, f"{name} not found in echo_api.cuh"
    return int(m[1])


def test_one_launch_flag_area_matches_the_kernels_header():
    """echo_api.cuh's P2PFlags (pinned there by a static_assert) and the Python side's room for it."""
    blocks, world = _header_constant("kP2PMaxBlocks"), _header_constant("kMaxWorldSize")
    assert (blocks, world) == (L.kFusedMaxBlocks, L.kMaxWorld)
    # push and gather [world][blocks] uint64, amax_flag [world] uint64, amax [world] float, 8 reserved words
    assert L.kFusedFlagsBytes == 2 * 8 * world * blocks + 8 * world + 4 * world + 32
    assert L.signal_bytes() == L.kFusedFlagsOffset + L.kFusedFlagsBytes
    assert L.kFusedFlagsOffset >= L.SIGNALS_LAYOUT["signals_bytes"] and L.kFusedFlagsOffset % 256 == 0


def test_one_launch_failure_names_block_and_call():
    f = proto.WaitFailure(proto.kErrorTimeout, 1, 3, proto.kWaitReduce, 17, 42, 42, 41, int(2.5e9), one_launch=True)
    msg = proto.describe_failure(f, 2.0, 4)
    assert "rank 1 of 4" in msg and "rank 3" in msg and "block 17 of call 42" in msg, msg
    assert "the flag holds call 41" in msg and "reduce (waiting for push)" in msg, msg
    fresh = proto.describe_failure(proto.WaitFailure(proto.kErrorAborted, 0, 1, proto.kWaitTail, 0, 1, 1, 0, 5,
                                                     one_launch=True), 2.0, 2)
    assert "abandoned" in fresh and "never written" in fresh, fresh


@pytest.mark.parametrize("bad", (-1, 1.5, True, "16M"))
def test_one_launch_max_bytes_is_checked(bad):
    from echo_ds.p2p import EchoBuffer

    with pytest.raises(ValueError, match="one_launch_max_bytes"):
        EchoBuffer(one_launch_max_bytes=bad)


@pytest.mark.parametrize("bad", (-1, 1.5, True, "256K"))
def test_one_shot_max_bytes_is_checked(bad):
    from echo_ds.p2p import EchoBuffer

    with pytest.raises(ValueError, match="one_shot_max_bytes"):
        EchoBuffer(one_shot_max_bytes=bad)


@pytest.mark.parametrize("bad", ("host", "nvlink", None))
def test_transport_is_cuda_or_a_class(bad):
    """The CPU's host transport left the package (tests/host_transport.py): its old name is refused before any
    collective, with the fixture's place."""
    from echo_ds.p2p import EchoBuffer

    with pytest.raises(ValueError, match="must be 'cuda' or a transport class .*tests/host_transport.py"):
        EchoBuffer(transport=bad)


def test_the_torch_stages_are_no_stages_setting():
    """The torch stages left the package too (tests/torch_stages.py, the host transport's stages): stages="torch"
    is refused before any collective, saying where calls the kernels do not run go; an unknown value is named."""
    from echo_ds.p2p import EchoBuffer

    with pytest.raises(ValueError, match="stages='torch'.*reference path.*tests/torch_stages.py"):
        EchoBuffer(stages="torch")
    with pytest.raises(ValueError, match="must be 'auto', 'fused' or 'kernels'"):
        EchoBuffer(stages="staged")


def test_call_descriptor_round_trip_and_mismatch_message():
    base = dict(numel=1000, dtype="bfloat16", bits=4, group_size=128, quantizer="zero_aware", rotation=True,
                pow2=False, residual="local")
    d = proto.call_descriptor(**base)
    assert 0 <= d < 1 << 32
    fields = proto.decode_descriptor(d)
    assert fields["dtype"] == "bfloat16" and fields["bits"] == 4 and fields["group_size"] == 128
    assert fields["quantizer"] == "zero_aware" and fields["rotation"] and not fields["pow2_rescale"]
    assert fields["compensator"] == "local" and fields[proto.kHashField] == proto.numel_hash(1000)
    assert fields["state_dtype"] == "bf16"  # the default, and what a call without a compensator sends
    for state_dtype in proto.DESCRIPTOR_STATE_DTYPES:
        narrow = proto.decode_descriptor(proto.call_descriptor(**dict(base, state_dtype=state_dtype)))
        assert narrow == dict(fields, state_dtype=state_dtype), state_dtype
    site3 = proto.call_descriptor(**dict(base, site=3, direction="forward"))
    assert site3 != proto.call_descriptor(**dict(base, site=4, direction="forward"))
    assert site3 != proto.call_descriptor(**dict(base, site=3, direction="backward"))
    assert site3 != proto.call_descriptor(**dict(base, site=3, direction="eval"))  # eval while a peer trains
    assert proto.decode_descriptor(proto.call_descriptor(**dict(base, pow2="auto")))["pow2_rescale"] == "auto"
    # every field, changed alone, changes the descriptor
    for k, v in dict(numel=1020, dtype="float16", bits=8, group_size=64, quantizer="naive", rotation=False,
                     pow2="auto", residual="output", site=3, direction="forward", state_dtype="int4").items():
        assert proto.call_descriptor(**dict(base, **{k: v})) != d, k
    other = proto.call_descriptor(**dict(base, bits=8))
    f = proto.WaitFailure(proto.kErrorMismatch, 0, 1, proto.kWaitReduce, 0, 3, d, other, 10, one_launch=True)
    msg = proto.describe_failure(f, 5.0, 2)
    assert "bits: rank 0 4, rank 1 8" in msg and "call 3" in msg and "different arguments" in msg, msg
    # A compensator of another stored format on one rank (the state the correction reads differs).
    int8, int4 = (proto.call_descriptor(**dict(base, state_dtype=s)) for s in ("int8", "int4"))
    f = proto.WaitFailure(proto.kErrorMismatch, 0, 1, proto.kWaitReduce, 0, 3, int8, int4, 10, one_launch=True)
    msg = proto.describe_failure(f, 5.0, 2)
    assert "(state_dtype: rank 0 'int8', rank 1 'int4')" in msg, msg


def test_plain_descriptor_differs_from_every_quantized_call():
    """A 16-bit call on one rank and a quantized call of the same size on another must not pair up."""
    plain = proto.plain_call_descriptor(numel=4097, dtype="bfloat16", site=3, direction="forward")
    assert proto.decode_descriptor(plain)["compensator"] == proto.kPlainResidualName
    assert proto.decode_descriptor(plain)["dtype"] == "bfloat16"
    for bits, g, q, rot, pow2, res, state in itertools.product(
            (4, 8), proto.SUPPORTED_GROUP_SIZES + (16,), proto.DESCRIPTOR_QUANTIZERS, (False, True), proto.DESCRIPTOR_POW2,
            proto.DESCRIPTOR_RESIDUALS, proto.DESCRIPTOR_STATE_DTYPES):
        quantized = proto.call_descriptor(numel=4097, dtype="bfloat16", bits=bits, group_size=g, quantizer=q,
                                          rotation=rot, pow2=pow2, residual=res, site=3, direction="forward",
                                          state_dtype=state)
        assert quantized != plain
    assert proto.plain_call_descriptor(numel=4097, dtype="float16", site=3, direction="forward") != plain


def test_group_sizes_the_kernels_do_not_take_are_described_through_the_hash():
    """A transport's own stages (the tests' torch stages) take every group size, their descriptor gate describing
    the call: a size without a code of its own reads as "another" and is mixed into the hash, so 16 and 32 still
    differ; the kernels' sizes keep their codes and their hash."""
    def d(g, numel=4097):
        return proto.call_descriptor(numel=numel, dtype="float32", bits=4, group_size=g, quantizer="zero_aware",
                                     rotation=False, pow2="auto", residual="none", site=1, direction="forward")

    assert proto.decode_descriptor(d(16))["group_size"] == proto.kOtherGroupSize
    assert d(16) != d(32) and d(16) != d(16, numel=4096)
    for g in proto.SUPPORTED_GROUP_SIZES:
        assert proto.decode_descriptor(d(g))["group_size"] == g
        assert proto.decode_descriptor(d(g))[proto.kHashField] == proto.numel_hash(4097, 1, "forward")


def test_every_call_the_staged_pipeline_may_serve_has_a_descriptor():
    """The staged calls' descriptor gate describes any spec the quantizer takes (found on the H100: group size
    16, which the torch stages then served in production, had no code and the gate raised ValueError)."""
    from echo_ds.quant import MAX_GROUP_SIZE, MIN_GROUP_SIZE, is_group_size

    sizes = [g for g in range(MIN_GROUP_SIZE, MAX_GROUP_SIZE + 1) if is_group_size(g)]
    seen = set()
    for g, bits, q, state in itertools.product(sizes, (4, 8), proto.DESCRIPTOR_QUANTIZERS,
                                               proto.DESCRIPTOR_STATE_DTYPES):
        seen.add(proto.call_descriptor(numel=12_345, dtype="float16", bits=bits, group_size=g, quantizer=q,
                                       rotation=True, pow2="auto", residual="local", state_dtype=state))
    assert len(seen) == len(sizes) * 2 * len(proto.DESCRIPTOR_QUANTIZERS) * len(proto.DESCRIPTOR_STATE_DTYPES)
