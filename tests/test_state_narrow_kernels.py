"""The compensator state's device functions (csrc/echo_compensator.cuh: load_state, state_step,
state_values, update_state) against the reference (echo_ds.compensator: Compensator.values, update with
encode_state, pack_int4 and store_state), bit for bit, for every stored format ("bf16", "int8", "int4").

The one-launch kernel uses these functions (tests/p2p_suite.check_state_formats checks its outputs and
states against the emulator); this test isolates them in a small kernel of its own: one update of a
random state from a random residual, for every group size the kernels take. Without nvcc the compile
test skips; without a GPU the bitwise test skips (run it on a GPU node:
``python -m pytest -q tests/test_state_narrow_kernels.py``).
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
# of the Contribution s updated in place from u, and the values it decoded before the update written to
# values_before (m1, then m2). BINDING wraps the launcher for load_inline (echo_api.cuh, which declares
# Contribution, is host code too).
KERNEL = r"""
#include <cstdint>
#include "echo_api.cuh"
#include "echo_compensator.cuh"

namespace echo {
namespace detail {
template <int kLanes>
__global__ void state_update_kernel(Contribution s, const float* u, int64_t num_groups, float* values_before) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t group = t / kLanes;
  if (group >= num_groups) return;  // whole groups per block: kLanes divides the block size
  const int lane = int(t % kLanes);
  const int64_t e = group * kLanes * kElemsPerThread;
  const int64_t numel = num_groups * kLanes * kElemsPerThread;
  StateWords m;
  load_state<kLanes>(s, e, lane, m);
  const float step = state_step<kLanes>(s, e);
  float v[kElemsPerThread];
#pragma unroll
  for (int c = 0; c < kChunks; ++c)
#pragma unroll
    for (int j = 0; j < kChunkElems; ++j) {
      const int i = c * kChunkElems + j;
      const int64_t at = e + chunk_offset<kLanes>(lane, c) + j;
      v[i] = u[at];
      float m1, m2;
      state_values(s.state, m, step, i, m1, m2);
      values_before[at] = m1;
      values_before[numel + at] = m2;
    }
  update_state<kLanes>(s, e, lane, m, v);
}
}  // namespace detail
}  // namespace echo

template <int kLanes>
void launch(echo::Contribution s, const float* u, int64_t num_groups, float* before) {
  const int64_t threads = num_groups * kLanes;
  echo::detail::state_update_kernel<kLanes><<<unsigned((threads + 255) / 256), 256>>>(s, u, num_groups, before);
}
"""

BINDING = r"""
#include <torch/extension.h>
#include "echo_api.cuh"
template <int kLanes>
void launch(echo::Contribution s, const float* u, int64_t num_groups, float* before);

// format: 0 bf16 (m1, m2 bf16 words), 1 int8 (m1, m2 codes, exponent), 2 int4 (m1 packed bytes, exponent).
void state_update(int64_t format, torch::Tensor m1, c10::optional<torch::Tensor> m2,
                  c10::optional<torch::Tensor> exponent, torch::Tensor u, std::vector<double> c, int64_t group_size,
                  torch::Tensor before) {
  echo::Contribution s{};
  s.state = static_cast<echo::StateFormat>(format);
  s.m1 = m1.data_ptr();
  s.m2 = m2.has_value() ? m2->data_ptr() : nullptr;
  s.exponent = exponent.has_value() ? exponent->data_ptr<int8_t>() : nullptr;
  s.coeffs = echo::CompensatorCoeffs{float(c[0]), float(c[1]), float(c[2]), float(c[3]), float(c[4]), float(c[5]),
                                     float(c[6])};
  const int64_t groups = u.numel() / group_size;
#define CASE(G) if (group_size == G) return launch<G / 16>(s, u.data_ptr<float>(), groups, before.data_ptr<float>());
  CASE(64) CASE(128) CASE(256)
  TORCH_CHECK(false, "unsupported group size");
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("state_update", &state_update); }
"""

INSTANTIATIONS = "".join(f"template void launch<{g // 16}>(echo::Contribution, const float*, int64_t, float*);\n"
                         for g in SUPPORTED_GROUP_SIZES)
FORMATS = {"bf16": 0, "int8": 1, "int4": 2}


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME or PATH)")
def test_the_state_functions_compile_without_fused_multiply_adds():
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "state.cu"
        src.write_text(KERNEL + INSTANTIATIONS)
        cmd = [NVCC, "-O3", cxx_std(), "-arch=sm_90", *EXACT_FP_NVCC_FLAGS, "-I", str(CSRC_DIR), "--ptx",
               "-o", str(Path(d) / "state.ptx"), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-4000:]
        ptx = (Path(d) / "state.ptx").read_text()
    assert ptx.count(".entry") == len(SUPPORTED_GROUP_SIZES)
    assert "fma.rn.f32" not in ptx, "the state's arithmetic must round every operation (no fused multiply-add)"
    assert "cvt.rni.s32.f32" in ptx  # the codes round half to even, as torch.round


def _device_state(comp):
    """The compensator's state tensors as the kernel takes them: (m1, m2, exponent), flattened copies."""
    flat = (lambda t: None if t is None else t.reshape(-1).clone())
    if comp.state_dtype == "int4":
        return flat(comp.q), None, flat(comp.exponent)
    return flat(comp.m1), flat(comp.m2), flat(comp.exponent)


def _coefficients(comp):
    return [float(comp.gain), float(comp.blend), float(comp.one_minus_blend), float(comp.slow_decay),
            float(comp.one_minus_slow), float(comp.fast_decay), float(comp.one_minus_fast)]


@pytest.mark.skipif(not torch.cuda.is_available() or NVCC is None, reason="needs a CUDA GPU and nvcc")
@pytest.mark.parametrize("group_size", SUPPORTED_GROUP_SIZES)
@pytest.mark.parametrize("state_dtype", ("int4", "int8", "bf16"))
def test_the_state_update_is_the_reference_bit_for_bit(state_dtype, group_size):
    from torch.utils.cpp_extension import load_inline

    from echo_ds.config import DirectionConfig

    ext = load_inline(name="echo_state_update_test", cpp_sources=[BINDING], cuda_sources=[KERNEL + INSTANTIATIONS],
                      extra_include_paths=[str(CSRC_DIR)], extra_cflags=[cxx_std()],
                      extra_cuda_cflags=[cxx_std(), *EXACT_FP_NVCC_FLAGS],
                      verbose=False)
    comp = C.Compensator(DirectionConfig(state_dtype=state_dtype))
    gen = torch.Generator().manual_seed(group_size + FORMATS[state_dtype])
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
    state = [None if t is None else t.cuda() for t in _device_state(comp)]
    before = comp.values()
    comp.update(u)

    got_before = torch.full((2 * u.numel(),), float("nan"), device="cuda")  # poisoned
    ext.state_update(FORMATS[state_dtype], *state, u.reshape(-1).cuda(), _coefficients(comp), group_size, got_before)
    torch.cuda.synchronize()
    assert torch.equal(got_before[: u.numel()].cpu().view(torch.int32), before[0].reshape(-1).view(torch.int32))
    assert torch.equal(got_before[u.numel():].cpu().view(torch.int32), before[1].reshape(-1).view(torch.int32))
    for name, got, want in zip(("m1 (int4: both codes)", "m2", "exponent"), state, _device_state(comp)):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got.cpu(), want), f"{state_dtype}: {name} differs from the reference's update"
