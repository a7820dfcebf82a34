// Stage 1, entry (push): x -> r' = rotate(x) + c -> rs = r' 2^k -> codes of the non-owned segments. The
// correction, the rotation and the statistics live in registers only; x' is never written (paper, section
// 5.3). The owned segment is not touched: the owner reduce forms its rs from the same inputs.
#include "echo_common.cuh"

namespace echo {
namespace {

using namespace detail;

// Two instantiations per configuration: the plain entry (no compensation, rotation or residual), which is
// latency-bound and needs 40 registers, and the full one (64), bound by the bytes of the state it reads
// (benchmarks/RESULTS.md). Sharing one instantiation held the plain entry at the full one's registers.
template <typename T, int kBits, int kGroupSize, bool kPlain>
__global__ void ECHO_KERNEL_BOUNDS(4) push_quantize_kernel(const PushQuantizeArgs a) {
  constexpr int kLanes = kGroupSize / kElemsPerThread;
  int lane;
  const int64_t item = group_in_row<kLanes>(lane);  // one group of a sent segment; its lanes share it
  if (item >= a.num_groups) return;                 // whole groups leave together
  const int row = static_cast<int>(blockIdx.y);     // rows are the P - 1 sent segments
  const int seg = row < a.rank ? row : row + 1;
  const int64_t gi = a.group_begin + item;
  const int64_t seg_numel = a.layout.groups_per_segment * kGroupSize;
  const int64_t e = int64_t(seg) * seg_numel + gi * kGroupSize;  // the group's first element (padded tensor)

  const int k = pow2_exponent(a.pow2_amax);
  float v[kElemsPerThread];
  Codes<kBits> codes;
  GroupParams p;
  if constexpr (kPlain) {
    p = quantize_plain_group<T, kBits, kLanes>(a.src, e, lane, a.layout.numel, k, a.policy, v, codes);
  } else {
    contribution<T, kLanes>(a.src, e, lane, a.layout.numel, k, v);
    p = quantize_group<kBits, kLanes>(v, a.policy, lane, codes);
  }
  store_packet_group<kBits, kLanes>(a.out, seg, gi, lane, codes, p);
  if (!kPlain && a.residual_out != nullptr) {
    // residual "local" of the sent segments: the rounding error this rank added to rs.
    store_local_residual<kBits, kLanes>(a.residual_out + e, lane, codes, p, v, k);
  }
}

}  // namespace

void launch_push_quantize(const PushQuantizeArgs& a, cudaStream_t stream) {
  ECHO_HOST_ASSERT(a.layout.world_size >= 2 && a.layout.world_size <= kMaxWorldSize, "world size out of range");
  ECHO_HOST_ASSERT(a.rank >= 0 && a.rank < a.layout.world_size, "rank out of range");
  ECHO_HOST_ASSERT(a.group_begin >= 0 && a.num_groups >= 0 &&
                       a.group_begin + a.num_groups <= a.layout.groups_per_segment,
                   "group range outside the segment");
  check_contribution(a.src);
  if (a.num_groups == 0) return;
  ECHO_DISPATCH_WORLD_SIZE(a.layout.world_size, kWorld, (void)kWorld);  // raises for unsupported P
  ECHO_DISPATCH_DTYPE(a.src.x_dtype, T, ECHO_DISPATCH_BITS(a.bits, kBits, ECHO_DISPATCH_GROUP_SIZE(a.layout.group_size, kGroup, {
    constexpr int kLanes = kGroup / kElemsPerThread;
    const dim3 grid = grid_of_rows<kLanes>(a.num_groups, a.layout.world_size - 1);
    if (is_plain(a.src, a.residual_out)) {
      push_quantize_kernel<T, kBits, kGroup, true><<<grid, kThreadsPerBlock, 0, stream>>>(a);
    } else {
      push_quantize_kernel<T, kBits, kGroup, false><<<grid, kThreadsPerBlock, 0, stream>>>(a);
    }
    ECHO_CHECK(cudaGetLastError());
  })));
}

}  // namespace echo
