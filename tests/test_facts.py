"""One fact, one place: what the kernels are built for is declared once in Python (echo_ds.ops.kernels,
echo_ds.quant, echo_ds.algorithm; the call descriptor's fields in echo_ds.p2p.protocol) and everything
else derives from it. csrc/ cannot import it, so its copies are read here from the source text (the
dispatch macros, enums and binding checks) and held to the Python declaration: a change on one side
alone fails here, naming both. The loaded extension's exported bounds are checked before the p2p
transport allocates (kernels.extension_mismatches, in CudaTransport)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import get_args

import pytest

from echo_ds import algorithm as A
from echo_ds import quant as Q
from echo_ds.config import DirectionConfig
from echo_ds.ops import kernels as K
from echo_ds.ops.builder import CSRC_DIR, SOURCES
from echo_ds.p2p import layout as L
from echo_ds.p2p import protocol as proto


def source(name: str) -> str:
    return (CSRC_DIR / name).read_text()


def macro(text: str, name: str) -> str:
    """The body of ``#define name(...)``: its lines up to the first that does not end with a backslash."""
    m = re.search(rf"#define {name}\(.*?(?<!\\)\n", text, re.S)
    assert m, f"no #define {name} in csrc/"
    return m[0]


def cases(text: str) -> list:
    return [int(v) for v in re.findall(r"\bcase (\d+):", text)]


def numbers(text: str) -> list:
    return [int(v) for v in re.findall(r"\d+", text)]


def enum(text: str, name: str) -> dict:
    """{code: enumerator} of ``enum class name``."""
    m = re.search(rf"enum class {name}\b[^{{]*\{{([^}}]*)\}}", text)
    assert m, f"no enum class {name} in csrc/echo_api.cuh"
    return {int(v): k for k, v in re.findall(r"(\w+)\s*=\s*(\d+)", m[1])}


def built_for(text: str) -> list:
    """The sizes an error message says the kernels are built for ("... built for 2, 4, 8)")."""
    m = re.search(r"built for ([\d, ]+)", text)
    assert m, "no 'built for ...' in the dispatch's error message"
    return numbers(m[1])


def coded_names(text: str, what: str) -> dict:
    """{code: name} of a binding check's message "<what> must be 0 (a), 1 (b) or 2 (c)"."""
    m = re.search(rf'"{what} must be ([^"]*)"', text)
    assert m, f"no message '{what} must be ...' in csrc/echo_binding.cpp"
    return {int(code): name for code, name in re.findall(r"(\d+) \((\w+)\)", m[1])}


def constant(text: str, name: str) -> int:
    m = re.search(rf"constexpr int {name} = (\d+);", text)
    assert m, f"no constexpr int {name} in csrc/echo_api.cuh"
    return int(m[1])


def upper_bound(text: str, what: str) -> int:
    m = re.search(rf"{what} >= 0 && {what} <= (\d+)", text)
    assert m, f"no range check of {what} in csrc/echo_binding.cpp"
    return int(m[1])


def snake(enumerator: str) -> str:
    """kZeroAwareInt -> zero_aware_int."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", enumerator.removeprefix("k")).lower()


# ----------------------------------------------------------------------------------------------------
# World sizes
# ----------------------------------------------------------------------------------------------------

def test_world_sizes_are_the_staged_dispatch():
    dispatch = macro(source("echo_device.cuh"), "ECHO_DISPATCH_WORLD_SIZE")
    assert tuple(cases(dispatch)) == K.KERNEL_WORLD_SIZES, "ECHO_DISPATCH_WORLD_SIZE (csrc/echo_device.cuh)"
    assert tuple(built_for(dispatch)) == K.KERNEL_WORLD_SIZES, "ECHO_DISPATCH_WORLD_SIZE's error message"


def test_world_sizes_are_the_one_launch_instantiations():
    extern = macro(source("p2p_all_reduce.cuh"), "ECHO_P2P_EXTERN_KERNELS")
    sizes = [int(p) for p in re.findall(r"ECHO_P2P_KERNELS\(extern, T, (\d+)\)", extern)]
    assert tuple(sizes) == K.KERNEL_WORLD_SIZES, "the one-launch kernels' extern declarations (p2p_all_reduce.cuh)"
    units = {s for s in SOURCES if s.startswith("p2p_all_reduce_")}
    assert units == {f"p2p_all_reduce_{d}_p{p}.cu" for d in ("f32", "f16", "bf16") for p in K.KERNEL_WORLD_SIZES}, \
        "the one-launch kernels' translation units (echo_ds/ops/builder.py SOURCES)"
    for unit in units:
        world = int(re.search(r"_p(\d+)\.cu$", unit).group(1))
        assert re.search(rf"ECHO_P2P_KERNELS\(, \w+, {world}\)", source(unit)), f"{unit} instantiates P = {world}"
    runtime = re.findall(r"world_size == (\d+)", source("echo_binding.cpp"))
    assert tuple(int(p) for p in runtime) == K.KERNEL_WORLD_SIZES, "P2PRuntime's check (csrc/echo_binding.cpp)"
    check = re.search(r"ECHO_HOST_ASSERT\(([^;]*)\"the one-launch transport is built for", source("p2p_all_reduce.cu"))
    assert check, "no world-size check in csrc/p2p_all_reduce.cu check_launch"
    host = re.findall(r"\bP == (\d+)", check[1])
    assert tuple(int(p) for p in host) == K.KERNEL_WORLD_SIZES, "the launcher's check (csrc/p2p_all_reduce.cu)"


def test_one_shot_world_sizes_are_its_instantiations():
    from echo_ds.p2p import policy

    extern = macro(source("p2p_all_reduce.cuh"), "ECHO_P2P_EXTERN_ONE_SHOT_KERNELS")
    sizes = [int(p) for p in re.findall(r"ECHO_P2P_ONE_SHOT_KERNELS\(extern, T, (\d+)\)", extern)]
    assert tuple(sizes) == policy.ONE_SHOT_WORLD_SIZES, "the one-shot kernels' extern declarations"
    units = {s for s in SOURCES if s.startswith("p2p_one_shot_")}
    assert units == {f"p2p_one_shot_{d}_p{p}.cu" for d in ("f16", "bf16") for p in policy.ONE_SHOT_WORLD_SIZES}
    check = re.search(r"ECHO_HOST_ASSERT\(([^;]*)\"the one-shot kernel is built for", source("p2p_all_reduce.cu"))
    assert check and tuple(int(p) for p in re.findall(r"\bP == (\d+)", check[1])) == policy.ONE_SHOT_WORLD_SIZES
    runtime = re.search(r"TORCH_CHECK\(shot_sender_bytes_ > 0 && \(([^)]*)\)", source("echo_binding.cpp"))
    assert runtime and tuple(int(p) for p in re.findall(r"world_size_ == (\d+)", runtime[1])) == \
        policy.ONE_SHOT_WORLD_SIZES, "P2PRuntime.plan's one-shot check (csrc/echo_binding.cpp)"
    assert all(policy.one_shot_max_bytes(p) == 0 for p in K.KERNEL_WORLD_SIZES if p not in policy.ONE_SHOT_WORLD_SIZES)


def test_the_tables_hold_the_largest_world_size():
    largest = max(K.KERNEL_WORLD_SIZES)
    assert constant(source("echo_api.cuh"), "kMaxWorldSize") == largest == L.kMaxWorld


def test_the_support_check_refuses_every_other_world_size():
    """unsupported_reason, which the transport asks before it runs a kernel, takes exactly the declared sizes
    and names both the size refused and the sizes built (P = 3 among the refused: no kernel has it)."""
    spec = Q.QuantSpec(bits=4, group_size=min(K.SUPPORTED_GROUP_SIZES))
    for world_size in range(1, 2 * max(K.KERNEL_WORLD_SIZES) + 1):
        why = K.unsupported_reason(world_size, spec)
        if world_size in K.KERNEL_WORLD_SIZES:
            assert why is None, f"P = {world_size}: {why}"
        else:
            assert why is not None, f"P = {world_size} accepted"
            assert f"world size {world_size} " in why and str(K.KERNEL_WORLD_SIZES) in why, why


# ----------------------------------------------------------------------------------------------------
# Group sizes and bit widths
# ----------------------------------------------------------------------------------------------------

def test_group_sizes_are_the_group_size_dispatch():
    dispatch = macro(source("echo_device.cuh"), "ECHO_DISPATCH_GROUP_SIZE")
    assert tuple(cases(dispatch)) == K.SUPPORTED_GROUP_SIZES, "ECHO_DISPATCH_GROUP_SIZE (csrc/echo_device.cuh)"
    assert tuple(built_for(dispatch)) == K.SUPPORTED_GROUP_SIZES, "ECHO_DISPATCH_GROUP_SIZE's error message"
    binding = source("echo_binding.cpp")
    checked = tuple(int(g) for g in re.findall(r"group_size == (\d+)", binding))
    assert checked == K.SUPPORTED_GROUP_SIZES, "make_layout's check (csrc/echo_binding.cpp)"
    api = source("echo_api.cuh")
    bounds = [constant(api, "kMinGroupSize"), constant(api, "kMaxGroupSize")]
    assert bounds == [min(K.SUPPORTED_GROUP_SIZES), max(K.SUPPORTED_GROUP_SIZES)], "kMin/kMaxGroupSize"
    assert all(Q.is_group_size(g) for g in K.SUPPORTED_GROUP_SIZES), "the kernels' sizes are the quantizer's"


def test_bit_widths_are_the_bits_dispatch():
    dispatch = macro(source("echo_device.cuh"), "ECHO_DISPATCH_BITS")
    assert tuple(cases(dispatch)) == Q.SUPPORTED_BITS, "ECHO_DISPATCH_BITS (csrc/echo_device.cuh)"
    checked = re.findall(r"bits == (\d+)", source("echo_binding.cpp"))
    assert tuple(int(b) for b in checked) == Q.SUPPORTED_BITS, "check_bits (csrc/echo_binding.cpp)"


# ----------------------------------------------------------------------------------------------------
# Codes: quantizers, dtypes, residuals, pow2 modes
# ----------------------------------------------------------------------------------------------------

def test_quantizer_codes_are_the_kernels_enum():
    enumerators = enum(source("echo_api.cuh"), "Quantizer")
    assert {snake(k): code for code, k in enumerators.items()} == K.QUANTIZER_CODES, "enum Quantizer (echo_api.cuh)"
    binding = source("echo_binding.cpp")
    named = {name: code for code, name in coded_names(binding, "quantizer").items()}
    assert named == K.QUANTIZER_CODES, "quantizer_of's message (csrc/echo_binding.cpp)"
    assert upper_bound(binding, "quantizer") == len(Q.QUANTIZERS) - 1, "quantizer_of's check"
    packed = re.search(r"bool packed_params\(Quantizer q\) \{([^}]*)\}", binding)
    assert packed, "no packed_params in csrc/echo_binding.cpp"
    packed_names = tuple(snake(k) for k in re.findall(r"Quantizer::(\w+)", packed[1]))
    assert packed_names == Q.PACKED_QUANTIZERS, "packed_params (csrc/echo_binding.cpp)"


def test_dtype_codes_are_the_kernels_enum():
    api = source("echo_api.cuh")
    by_code = enum(api, "DType")
    names = tuple(by_code[c].removeprefix("k").lower() for c in sorted(by_code))
    assert names == proto.DESCRIPTOR_DTYPES, "enum DType (csrc/echo_api.cuh) against kernels.SUPPORTED_DTYPES"
    dispatch = macro(source("echo_device.cuh"), "ECHO_DISPATCH_DTYPE")
    assert set(re.findall(r"DType::(\w+)", dispatch)) == set(by_code.values()), "ECHO_DISPATCH_DTYPE"
    message = re.search(r'" must be ([\w, ]+ or \w+), got "', source("echo_binding.cpp"))
    assert message, "no dtype_of message in csrc/echo_binding.cpp"
    listed = tuple(re.findall(r"\w+", message[1].replace(" or ", ", ")))
    assert listed == proto.DESCRIPTOR_DTYPES, "dtype_of's message (csrc/echo_binding.cpp)"


def test_residual_and_pow2_codes_are_the_one_launch_calls():
    binding = source("echo_binding.cpp")
    residual_codes = coded_names(binding, "residual")
    assert tuple(residual_codes[c] for c in sorted(residual_codes)) == proto.DESCRIPTOR_RESIDUALS, \
        "P2PRuntime.plan's residual check (csrc/echo_binding.cpp)"
    residuals = get_args(DirectionConfig.model_fields["residual"].annotation)
    assert set(proto.DESCRIPTOR_RESIDUALS) == {"none", *residuals}, "echo.<direction>.residual"
    assert [A.pow2_code(m) for m in A.POW2_MODES] == list(range(len(A.POW2_MODES))), "algorithm.pow2_code"
    assert upper_bound(binding, "pow2") == len(A.POW2_MODES) - 1, "P2PRuntime.plan's pow2 check"


def test_error_codes_and_wait_stages_are_the_records():
    """The one error record's codes and stage ids (csrc/echo_p2p.h, written by both transports' waits) are
    the table the host decodes it with (echo_ds/p2p/protocol.py)."""
    header = source("echo_p2p.h")
    declared = {name: int(v) for name, v in re.findall(r"constexpr uint32_t (k(?:Wait|Error)\w+) = (\d+);", header)}
    python = {name: getattr(proto, name) for name in dir(proto) if re.fullmatch(r"k(?:Wait|Error)[A-Z]\w*", name)}
    assert declared == python, "kWait* / kError* of csrc/echo_p2p.h against echo_ds/p2p/protocol.py"
    assert set(proto.WAIT_STAGE_NAMES) == {v for k, v in declared.items() if k.startswith("kWait")}
    api = source("echo_api.cuh") + source("p2p_all_reduce.cuh")
    assert not re.search(r"\bkP2P(?:Wait|Error)\w*", api), "a second table of codes in the one-launch sources"


# ----------------------------------------------------------------------------------------------------
# The call descriptor
# ----------------------------------------------------------------------------------------------------

def test_every_descriptor_value_has_its_code_in_its_own_bits():
    shifts = proto.descriptor_shifts()
    base = dict(numel=1, dtype="float32", bits=4, group_size=64, quantizer="zero_aware", rotation=False, pow2=False,
                residual="none")
    for field in proto.DESCRIPTOR_LAYOUT:
        if field.values is None:
            continue
        for code, value in enumerate(field.values):
            if value == proto.kOtherGroupSize:  # stands for every size the kernels do not take
                value, shown = 16, value
            else:
                shown = value
            d = proto.call_descriptor(**dict(base, **{field.arg: value}))
            assert (d >> shifts[field.arg]) & field.mask == code, (field.name, value)
            assert proto.decode_descriptor(d)[field.name] == shown
    assert shifts["hash"] + proto.kNumelHashBits == proto.kDescriptorBits


def test_a_field_too_narrow_for_its_values_is_refused():
    fields = list(proto.DESCRIPTOR_LAYOUT)
    g = next(i for i, f in enumerate(fields) if f.name == "group_size")
    fields[g] = proto.DescriptorField("group_size", "group_size", 2, (16, 32, 64, 128, 256))
    with pytest.raises(ValueError, match="'group_size': 5 codes do not fit its 2 bits"):
        proto.check_descriptor_layout(tuple(fields))
    r = next(i for i, f in enumerate(fields) if f.arg == "residual")
    fields = list(proto.DESCRIPTOR_LAYOUT)
    fields[r] = proto.DescriptorField("compensator", "residual", 2, ("none", "local", "output", "both"))
    with pytest.raises(ValueError, match="'compensator': 5 codes"):  # and one for the plain call
        proto.check_descriptor_layout(tuple(fields))
    last = proto.DESCRIPTOR_LAYOUT[-1]
    shorter = proto.DESCRIPTOR_LAYOUT[:-1] + (proto.DescriptorField(last.name, last.arg, last.width - 1, None),)
    with pytest.raises(ValueError, match=f"take {proto.kDescriptorBits - 1} bits"):
        proto.check_descriptor_layout(shorter)


def test_the_docs_state_the_hash_width_of_the_code():
    # docs/p2p.md once said 21 bits where the code hashed to 20.
    stated = []
    for doc in sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md")):
        text = " ".join(doc.read_text().split())  # a sentence may break across lines
        pattern = r"(\d+)[- ]bit hash|(\d+) bits hashing|hashes [^.]*? to (\d+) bits"
        stated += [(doc.name, int("".join(m))) for m in re.findall(pattern, text)]
    assert stated, "no doc states the descriptor's hash width any more: drop this test"
    assert all(width == proto.kNumelHashBits for _, width in stated), stated


# ----------------------------------------------------------------------------------------------------
# The loaded extension
# ----------------------------------------------------------------------------------------------------

def test_an_extension_built_for_other_sizes_is_named():
    declared = SimpleNamespace(kMaxWorldSize=max(K.KERNEL_WORLD_SIZES), kMinGroupSize=min(K.SUPPORTED_GROUP_SIZES),
                               kMaxGroupSize=max(K.SUPPORTED_GROUP_SIZES))
    assert K.extension_mismatches(declared) == []
    other = SimpleNamespace(**dict(vars(declared), kMaxWorldSize=16))
    (why,) = K.extension_mismatches(other)
    assert "kMaxWorldSize 16" in why and f"declares {max(K.KERNEL_WORLD_SIZES)}" in why
