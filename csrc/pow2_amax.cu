// pow2 rescaling (paper, section 5.4): amax = max |r'| over this rank's padded tensor, r' = rotate(x) + c.
// The caller takes the max over the ranks (one scalar all-reduce) and hands the result to the other
// stages, which derive k = collective.pow2_exponent(amax) on the device (no host round trip).
// NaN propagates as torch.amax does: |NaN| has a larger bit pattern than +inf, and non-negative floats
// order as their unsigned patterns, so an unsigned max over the patterns is the float max with NaN winning.
#include "echo_common.cuh"

namespace echo {
namespace {

using namespace detail;

// Blocks per SM of the grid-stride loop: enough resident warps to keep the loads in flight; from the
// occupancy of a 256-thread block, not measured.
constexpr int kAmaxBlocksPerSm = 8;

template <typename T, int kGroupSize>
__global__ void ECHO_KERNEL_BOUNDS(1) pow2_amax_kernel(const Pow2AmaxArgs a) {
  constexpr int kLanes = kGroupSize / kElemsPerThread;
  __shared__ unsigned block_max[kThreadsPerBlock / kWarpSize];
  const int64_t num_items = int64_t(a.layout.world_size) * a.layout.groups_per_segment;
  const int64_t items_per_pass = int64_t(gridDim.x) * (kThreadsPerBlock / kLanes);
  const int lane = static_cast<int>(threadIdx.x % kLanes);
  unsigned best = 0u;
  // Every lane of a group runs the same iterations (the item is per group), as the rotation's shuffles need.
  for (int64_t item = int64_t(blockIdx.x) * (kThreadsPerBlock / kLanes) + threadIdx.x / kLanes; item < num_items;
       item += items_per_pass) {
    const int64_t e = item * kGroupSize;  // the group's first element
    float v[kElemsPerThread];
    StateWords m1, m2;  // read only here
    contribution<T, kLanes>(a.src, e, lane, a.layout.numel, /*k=*/0, v, m1, m2);
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) best = max(best, __float_as_uint(fabsf(v[i])));
  }
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o /= 2) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
  if (threadIdx.x % kWarpSize == 0) block_max[threadIdx.x / kWarpSize] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreadsPerBlock / kWarpSize; ++w) best = max(best, block_max[w]);
    atomicMax(reinterpret_cast<unsigned*>(a.amax_out), best);
  }
}

}  // namespace

void launch_pow2_amax(const Pow2AmaxArgs& a, cudaStream_t stream) {
  ECHO_HOST_ASSERT(a.amax_out != nullptr, "amax_out is required");
  check_contribution(a.src);
  ECHO_HOST_ASSERT(!a.src.update_state, "the max pass does not update the state");
  ECHO_CHECK(cudaMemsetAsync(a.amax_out, 0, sizeof(float), stream));
  int device = 0, num_sms = 0;
  ECHO_CHECK(cudaGetDevice(&device));
  ECHO_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  ECHO_DISPATCH_DTYPE(a.src.x_dtype, T, ECHO_DISPATCH_GROUP_SIZE(a.layout.group_size, kGroup, {
    constexpr int kLanes = kGroup / kElemsPerThread;
    const int64_t threads = padded_numel(a.layout) / kElemsPerThread;
    const int64_t wanted = (threads + kThreadsPerBlock - 1) / kThreadsPerBlock;
    const int64_t cap = int64_t(num_sms) * kAmaxBlocksPerSm;
    static_assert(kThreadsPerBlock % kLanes == 0, "groups do not straddle blocks");
    pow2_amax_kernel<T, kGroup><<<static_cast<unsigned>(wanted < cap ? wanted : cap), kThreadsPerBlock, 0, stream>>>(a);
    ECHO_CHECK(cudaGetLastError());
  }));
}

}  // namespace echo
