// Stage 4, compensator update (Compensator.update), meant for a side stream beside the next matrix
// product: m1 = (m1 * beta1) + (u * (1 - beta1)), m2 likewise with beta2, in place.
//
// residual "output": u = r' - s_hat / P. r' = rotate(x) + c(m1, m2) is recomputed from x and the state
// (cheaper than keeping x' from the entry), s_hat from the gathered codes (y itself is rounded to the
// output dtype and unrotated, so it cannot give s_hat back).
// residual "local": u was written by the entry (sent segments) and the owner reduce (own segment).
// Optionally the correction of the new state, c = ((m1 a) + (m2 (1 - a))) eta, is written for the next
// call's entry, which then reads one fp32 array instead of two.
#include "echo_common.cuh"

namespace echo {
namespace {

using namespace detail;

__device__ __forceinline__ void update_state(float (&m1)[kElemsPerThread], float (&m2)[kElemsPerThread],
                                             const float (&u)[kElemsPerThread], const CompensatorCoeffs& k) {
#pragma unroll
  for (int i = 0; i < kElemsPerThread; ++i) {
    m1[i] = f_add(f_mul(m1[i], k.slow_decay), f_mul(u[i], k.one_minus_slow));
    m2[i] = f_add(f_mul(m2[i], k.fast_decay), f_mul(u[i], k.one_minus_fast));
  }
}

template <typename T, int kBits, int kGroupSize>
__global__ void ECHO_KERNEL_BOUNDS(2) compensator_update_output_kernel(const CompensatorUpdateOutputArgs a) {
  constexpr int kLanes = kGroupSize / kElemsPerThread;
  int lane;
  const int64_t gi = group_in_row<kLanes>(lane);
  const int64_t G = a.layout.groups_per_segment;
  if (gi >= G) return;
  const int seg = static_cast<int>(blockIdx.y);
  const int64_t e = (seg * G + gi) * kGroupSize;  // the group's first element in the padded tensor

  float x[kElemsPerThread], m1[kElemsPerThread], m2[kElemsPerThread];
  load_thread<T, kLanes>(static_cast<const T*>(a.x), e, lane, a.layout.numel, aligned16(a.x), x);
  load_thread_f32<kLanes>(a.m1 + e, lane, m1);
  load_thread_f32<kLanes>(a.m2 + e, lane, m2);
  GroupParams p;
  const Codes<kBits> codes = load_packet_group<kBits, kLanes>(a.in, seg, gi, lane, p);

  if (a.hadamard.enabled) rotate<kLanes>(x, lane, a.hadamard);
  float s_hat[kElemsPerThread];
  decode<kBits>(codes, p.scale, p.zero, s_hat);
  const int k = pow2_exponent(a.pow2_amax);
  const float down = exp2_int(-k);
  // s_hat / P is a product by float(1 / P), as PyTorch computes `cuda_tensor / python_int` (exact for
  // P = 2, 4, 8).
  const float inv_world = f_div(1.0f, static_cast<float>(a.layout.world_size));
  float u[kElemsPerThread];
#pragma unroll
  for (int i = 0; i < kElemsPerThread; ++i) {
    const float r = f_add(x[i], correction(m1[i], m2[i], a.coeffs));
    const float s = k != 0 ? f_mul(s_hat[i], down) : s_hat[i];
    u[i] = f_sub(r, f_mul(s, inv_world));
  }
  update_state(m1, m2, u, a.coeffs);
  store_thread_f32<kLanes>(a.m1 + e, lane, m1);
  store_thread_f32<kLanes>(a.m2 + e, lane, m2);
  if (a.correction_out != nullptr) {
    float c[kElemsPerThread];
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) c[i] = correction(m1[i], m2[i], a.coeffs);
    store_thread_f32<kLanes>(a.correction_out + e, lane, c);
  }
}

__global__ void ECHO_KERNEL_BOUNDS(1) compensator_update_local_kernel(const CompensatorUpdateLocalArgs a) {
  const int64_t e = (int64_t(blockIdx.x) * kThreadsPerBlock + threadIdx.x) * 4;
  if (e >= a.padded_numel) return;
  const float4 u = *reinterpret_cast<const float4*>(a.u + e);
  float4 m1 = *reinterpret_cast<const float4*>(a.m1 + e);
  float4 m2 = *reinterpret_cast<const float4*>(a.m2 + e);
  const CompensatorCoeffs& k = a.coeffs;
  m1.x = f_add(f_mul(m1.x, k.slow_decay), f_mul(u.x, k.one_minus_slow));
  m1.y = f_add(f_mul(m1.y, k.slow_decay), f_mul(u.y, k.one_minus_slow));
  m1.z = f_add(f_mul(m1.z, k.slow_decay), f_mul(u.z, k.one_minus_slow));
  m1.w = f_add(f_mul(m1.w, k.slow_decay), f_mul(u.w, k.one_minus_slow));
  m2.x = f_add(f_mul(m2.x, k.fast_decay), f_mul(u.x, k.one_minus_fast));
  m2.y = f_add(f_mul(m2.y, k.fast_decay), f_mul(u.y, k.one_minus_fast));
  m2.z = f_add(f_mul(m2.z, k.fast_decay), f_mul(u.z, k.one_minus_fast));
  m2.w = f_add(f_mul(m2.w, k.fast_decay), f_mul(u.w, k.one_minus_fast));
  *reinterpret_cast<float4*>(a.m1 + e) = m1;
  *reinterpret_cast<float4*>(a.m2 + e) = m2;
  if (a.correction_out != nullptr) {
    *reinterpret_cast<float4*>(a.correction_out + e) =
        make_float4(correction(m1.x, m2.x, k), correction(m1.y, m2.y, k), correction(m1.z, m2.z, k),
                    correction(m1.w, m2.w, k));
  }
}

}  // namespace

void launch_compensator_update_output(const CompensatorUpdateOutputArgs& a, cudaStream_t stream) {
  ECHO_HOST_ASSERT(a.m1 != nullptr && a.m2 != nullptr, "the update needs the state");
  for (int j = 0; j < a.layout.world_size && j < kMaxWorldSize; ++j) {
    ECHO_HOST_ASSERT(a.in.codes[j] && a.in.scales[j] && a.in.zeros[j], "the update reads every segment's codes");
  }
  ECHO_DISPATCH_WORLD_SIZE(a.layout.world_size, kWorld, (void)kWorld);
  ECHO_DISPATCH_DTYPE(a.x_dtype, T, ECHO_DISPATCH_BITS(a.bits, kBits, ECHO_DISPATCH_GROUP_SIZE(a.layout.group_size, kGroup, {
    constexpr int kLanes = kGroup / kElemsPerThread;
    static_assert(kLanes * kElemsPerThread == kGroup, "lanes cover the group");
    const dim3 grid = grid_of_rows<kLanes>(a.layout.groups_per_segment, a.layout.world_size);
    compensator_update_output_kernel<T, kBits, kGroup><<<grid, kThreadsPerBlock, 0, stream>>>(a);
    ECHO_CHECK(cudaGetLastError());
  })));
}

void launch_compensator_update_local(const CompensatorUpdateLocalArgs& a, cudaStream_t stream) {
  ECHO_HOST_ASSERT(a.padded_numel % 4 == 0, "the padded length is a multiple of the group size");
  ECHO_HOST_ASSERT(a.u && a.m1 && a.m2, "the update needs u and the state");
  if (a.padded_numel == 0) return;
  compensator_update_local_kernel<<<num_blocks(a.padded_numel / 4), kThreadsPerBlock, 0, stream>>>(a);
  ECHO_CHECK(cudaGetLastError());
}

}  // namespace echo
