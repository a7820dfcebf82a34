// pow2 rescaling (paper, section 5.4): amax = max |r'| over this rank's padded tensor, r' = rotate(x) + c.
// The caller takes the max over the ranks (one scalar all-reduce) and hands the result to the other
// stages, which derive k = algorithm.pow2_exponent(amax) on the device (no host round trip).
// NaN propagates as torch.amax does (block_amax_bits). The one-launch call computes the same max inside
// its own kernel (p2p_all_reduce.cuh).
#include "echo_contribution.cuh"
#include "echo_device.cuh"
#include "echo_rescale.cuh"

namespace echo {
namespace {

using namespace detail;

// Blocks per SM of the grid-stride loop: enough resident warps to keep the loads in flight; from the
// occupancy of a 256-thread block, not measured.
constexpr int kAmaxBlocksPerSm = 8;

template <typename T, int kGroupSize>
__global__ void ECHO_KERNEL_BOUNDS(1) pow2_amax_kernel(const Pow2AmaxArgs a) {
  __shared__ unsigned block_max[kThreadsPerBlock / kWarpSize];
  const unsigned best = block_amax_bits<T, kGroupSize / kElemsPerThread>(a.src, a.layout, block_max);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned*>(a.amax_out), best);
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
