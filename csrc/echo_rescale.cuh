// pow2 rescaling (algorithm.pow2_exponent; paper, section 5.4) on the device, internal to csrc/: the
// exponent k from the all-reduced max, the "auto" gate, and a block's share of max |r'|.
#pragma once

#include "echo_contribution.cuh"
#include "echo_device.cuh"

namespace echo {
namespace detail {

// k of algorithm.pow2_exponent: amax 2^k in [2^14, 2^15); 0 for 0 or non-finite; clamped to [-126, 126].
__device__ __forceinline__ int pow2_exponent(const float* amax_ptr) {
  if (amax_ptr == nullptr) return 0;
  const float a = *amax_ptr;
  if (!is_finite(a) || a == 0.0f) return 0;
  int e;
  frexpf(a, &e);
  const int k = 15 - e;  // algorithm.kPow2Target = 15
  return k < -126 ? -126 : (k > 126 ? 126 : k);
}
// Rescaling "auto" (algorithm.pow2_exponent): a group max inside [kAutoLow, kAutoHigh) = [2^-6, 2^15)
// becomes 0, whose exponent is k = 0; outside it (or NaN) it is kept, and rescales as "always" does.
__device__ __forceinline__ float pow2_auto_gate(float amax) {
  return (amax >= 0x1p-6f && amax < 0x1p15f) ? 0.0f : amax;
}

// pow2 rescaling: max |r'| over this rank's padded tensor, r' = rotate(x) + c, the block's share of it
// (groups blockIdx.x * items + ..., a grid stride apart), as the bit pattern of the float: non-negative
// floats order as their unsigned patterns and |NaN| lies above +inf, so the unsigned max is torch.amax's
// max with NaN winning. Reduced over the block: the result is valid in thread 0. block_max: one word per
// warp of shared memory. Every lane of a group runs the same iterations, as the rotation's shuffles need.
template <typename T, int kLanes>
__device__ __forceinline__ unsigned block_amax_bits(const Contribution& s, const Layout& layout,
                                                    unsigned (&block_max)[kThreadsPerBlock / kWarpSize]) {
  constexpr int kItemsPerBlock = kThreadsPerBlock / kLanes;
  const int64_t num_items = int64_t(layout.world_size) * layout.groups_per_segment;
  const int lane = static_cast<int>(threadIdx.x % kLanes);
  unsigned best = 0u;
  for (int64_t item = int64_t(blockIdx.x) * kItemsPerBlock + threadIdx.x / kLanes; item < num_items;
       item += int64_t(gridDim.x) * kItemsPerBlock) {
    float v[kElemsPerThread];
    StateWords m;  // read only here
    contribution<T, kLanes>(s, item * layout.group_size, lane, layout.numel, /*k=*/0, v, m);
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) best = max(best, __float_as_uint(fabsf(v[i])));
  }
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o /= 2) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
  if (threadIdx.x % kWarpSize == 0) block_max[threadIdx.x / kWarpSize] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreadsPerBlock / kWarpSize; ++w) best = max(best, block_max[w]);
  }
  return best;
}

}  // namespace detail
}  // namespace echo
