"""The narrow compensator states on the device (csrc/echo_compensator.cuh: load_narrow_state,
narrow_values, update_narrow_state) against the reference (echo_ds.compensator.encode_state,
decode_state, pack_int4), bit for bit.

The device functions are not wired into the stages yet (docs/kernels.md, "Compensator state dtype"), so
the test builds its own small kernel around them: one update of a random state from a random residual,
for every group size the kernels take and both bit widths. Without nvcc the compile test skips; without a
GPU the bitwise test skips (run it on a GPU node: ``python -m pytest -q tests/test_state_narrow_kernels.py``).
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from echo_ds import compensator as C
from echo_ds.ops.builder import CSRC_DIR, EXACT_FP_NVCC_FLAGS, cxx_std, find_nvcc
from echo_ds.ops.kernels import SUPPORTED_GROUP_SIZES

NVCC = find_nvcc()

# One thread per 16 elements, kLanes = g / 16 lanes per group (csrc/echo_device.cuh's layout); the state
# updated in place from u with the coefficients of a DirectionConfig, and the values it decoded before the
# update written to values_before (m1, then m2). BINDING wraps the launcher for load_inline; it repeats
# NarrowState's definition, since the host compiler cannot include the device header.
KERNEL = r"""
#include <cstdint>
#include "echo_api.cuh"
#include "echo_compensator.cuh"

namespace echo {
namespace detail {
template <int kBits, int kLanes>
__global__ void narrow_update_kernel(NarrowState s, const float* u, CompensatorCoeffs k, int64_t num_groups,
                                     float* values_before) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t group = t / kLanes;
  if (group >= num_groups) return;  // whole groups per block: kLanes divides the block size
  const int lane = int(t % kLanes);
  const int g = kLanes * kElemsPerThread;
  const int64_t e = group * g;
  NarrowWords<kBits> m;
  load_narrow_state<kBits, kLanes>(s, e, g, lane, m);
  float v[kElemsPerThread];
#pragma unroll
  for (int c = 0; c < kChunks; ++c)
#pragma unroll
    for (int j = 0; j < kChunkElems; ++j) {
      const int i = c * kChunkElems + j;
      const int64_t at = e + chunk_offset<kLanes>(lane, c) + j;
      v[i] = u[at];
      float m1, m2;
      narrow_values<kBits>(m, i, m1, m2);
      values_before[at] = m1;
      values_before[s.padded + at] = m2;
    }
  update_narrow_state<kBits, kLanes>(s, e, g, lane, m, k, v);
}
}  // namespace detail
}  // namespace echo

template <int kBits, int kLanes>
void launch(echo::detail::NarrowState s, const float* u, echo::CompensatorCoeffs k, int64_t num_groups,
            float* before) {
  const int64_t threads = num_groups * kLanes;
  echo::detail::narrow_update_kernel<kBits, kLanes><<<unsigned((threads + 255) / 256), 256>>>(s, u, k, num_groups,
                                                                                            before);
}
"""

BINDING = r"""
#include <torch/extension.h>
#include "echo_api.cuh"
namespace echo { namespace detail { struct NarrowState { uint8_t* q; int8_t* exponent; int64_t padded; }; } }
template <int kBits, int kLanes>
void launch(echo::detail::NarrowState s, const float* u, echo::CompensatorCoeffs k, int64_t num_groups, float* before);

void narrow_update(torch::Tensor q, torch::Tensor exponent, torch::Tensor u, std::vector<double> c, int64_t bits,
                   int64_t group_size, torch::Tensor before) {
  echo::detail::NarrowState s{q.data_ptr<uint8_t>(), exponent.data_ptr<int8_t>(), u.numel()};
  echo::CompensatorCoeffs k{float(c[0]), float(c[1]), float(c[2]), float(c[3]), float(c[4]), float(c[5]), float(c[6])};
  const int64_t groups = u.numel() / group_size;
#define CASE(B, G) if (bits == B && group_size == G) return launch<B, G / 16>(s, u.data_ptr<float>(), k, groups, before.data_ptr<float>());
  CASE(4, 64) CASE(4, 128) CASE(4, 256) CASE(8, 64) CASE(8, 128) CASE(8, 256)
  TORCH_CHECK(false, "unsupported bits / group size");
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("narrow_update", &narrow_update); }
"""

INSTANTIATIONS = "".join(f"template void launch<{b}, {g // 16}>(echo::detail::NarrowState, const float*, "
                         f"echo::CompensatorCoeffs, int64_t, float*);\n"
                         for b in (4, 8) for g in SUPPORTED_GROUP_SIZES)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME or PATH)")
def test_the_narrow_state_functions_compile_without_fused_multiply_adds():
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "narrow.cu"
        src.write_text(KERNEL + INSTANTIATIONS)
        cmd = [NVCC, "-O3", cxx_std(), "-arch=sm_90", *EXACT_FP_NVCC_FLAGS, "-I", str(CSRC_DIR), "--ptx",
               "-o", str(Path(d) / "narrow.ptx"), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-4000:]
        ptx = (Path(d) / "narrow.ptx").read_text()
    assert ptx.count(".entry") == 2 * len(SUPPORTED_GROUP_SIZES)
    assert "fma.rn.f32" not in ptx, "the state's arithmetic must round every operation (no fused multiply-add)"
    assert "cvt.rni.s32.f32" in ptx  # the codes round half to even, as torch.round


def _device_codes(comp):
    """A copy of the state's codes as one flat uint8 array, as the kernel above holds them: "int4" the
    compensator's own packed bytes (q); "int8" m1's codes, then m2's."""
    if comp.state_dtype == "int4":
        return comp.q.reshape(-1).clone()
    return torch.cat((comp.m1.reshape(-1), comp.m2.reshape(-1))).view(torch.uint8)


def _coefficients(comp):
    return [float(comp.gain), float(comp.blend), float(comp.one_minus_blend), float(comp.slow_decay),
            float(comp.one_minus_slow), float(comp.fast_decay), float(comp.one_minus_fast)]


@pytest.mark.skipif(not torch.cuda.is_available() or NVCC is None, reason="needs a CUDA GPU and nvcc")
@pytest.mark.parametrize("group_size", SUPPORTED_GROUP_SIZES)
@pytest.mark.parametrize("state_dtype", ("int4", "int8"))
def test_update_narrow_state_is_the_reference_bit_for_bit(state_dtype, group_size):
    from torch.utils.cpp_extension import load_inline

    from echo_ds.config import DirectionConfig

    ext = load_inline(name="echo_narrow_state_test", cpp_sources=[BINDING], cuda_sources=[KERNEL + INSTANTIATIONS],
                      extra_include_paths=[str(CSRC_DIR)], extra_cflags=[cxx_std()],
                      extra_cuda_cflags=[cxx_std(), *EXACT_FP_NVCC_FLAGS],
                      verbose=False)
    bits = C.kStateBits[state_dtype]
    comp = C.Compensator(DirectionConfig(state_dtype=state_dtype))
    gen = torch.Generator().manual_seed(group_size + bits)
    num_groups = 4096
    shape = (num_groups, group_size)
    # A state as the reference leaves it (magnitudes over many decades, saturating groups, a zero group),
    # then one update from a residual with non-finite values.
    magnitude = torch.logspace(-30, 30, num_groups)[:, None]
    comp.correction(shape, "cpu")
    comp.update(torch.randn(shape, generator=gen) * magnitude)
    comp.update(torch.randn(shape, generator=gen) * magnitude)
    u = torch.randn(shape, generator=gen) * magnitude * torch.rand(shape, generator=gen)
    u[7] = 0.0
    u[11, 3], u[12, 5], u[13, 0] = float("nan"), float("inf"), -float("inf")
    q, exponent = _device_codes(comp), comp.exponent.clone()
    before = comp.values()
    comp.update(u)

    q, e_dev = q.cuda(), exponent.reshape(-1).cuda()
    got_before = torch.full((2 * u.numel(),), float("nan"), device="cuda")  # poisoned
    ext.narrow_update(q, e_dev, u.reshape(-1).cuda(), _coefficients(comp), bits, group_size, got_before)
    torch.cuda.synchronize()
    assert torch.equal(got_before[: u.numel()].cpu().view(torch.int32), before[0].reshape(-1).view(torch.int32))
    assert torch.equal(got_before[u.numel():].cpu().view(torch.int32), before[1].reshape(-1).view(torch.int32))
    assert torch.equal(q.cpu(), _device_codes(comp)), "codes differ from compensator.encode_state"
    assert torch.equal(e_dev.cpu(), comp.exponent.reshape(-1)), "exponents differ"
