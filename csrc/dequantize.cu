// Stage 3, dequantize (gather on the owner, tail on the others): codes of segment j -> s_hat_scaled ->
// s_hat = s_hat_scaled 2^-k -> unrotate -> output dtype (round to nearest even). Every rank decodes the
// same codes, its own segment included, so all ranks hold the same bits (paper, section 4.1).
#include "echo_common.cuh"

namespace echo {
namespace {

using namespace detail;

// Two instantiations per configuration, with and without the inverse rotation: without it the kernel needs
// 32 registers instead of 40 (8 resident blocks per SM instead of 6).
template <typename T, int kBits, int kGroupSize, bool kRotated>
__global__ void ECHO_KERNEL_BOUNDS(6) dequantize_kernel(const DequantizeArgs a) {
  constexpr int kLanes = kGroupSize / kElemsPerThread;
  int lane;
  const int64_t item = group_in_row<kLanes>(lane);
  if (item >= a.num_groups) return;
  const int seg = a.segment_begin + static_cast<int>(blockIdx.y);
  const int64_t gi = a.group_begin + item;
  const int64_t e = int64_t(seg) * a.layout.groups_per_segment * kGroupSize + gi * kGroupSize;  // group start
  if (e >= a.layout.numel) return;  // the whole group is padding

  GroupParams p;
  const Codes<kBits> codes = load_packet_group<kBits, kLanes>(a.in, seg, gi, lane, p);
  float v[kElemsPerThread];
  decode<kBits>(codes, p.scale, p.zero, v);
  const int k = pow2_exponent(a.pow2_amax);
  if (k != 0) {
    const float down = exp2_int(-k);
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) v[i] = f_mul(v[i], down);
  }
  if constexpr (kRotated) unrotate<kLanes>(v, lane, a.hadamard);
  store_thread<T, kLanes>(static_cast<T*>(a.out), e, lane, a.layout.numel, aligned16(a.out), v);
}

}  // namespace

void launch_dequantize(const DequantizeArgs& a, cudaStream_t stream) {
  ECHO_HOST_ASSERT(a.segment_begin >= 0 && a.num_segments >= 0 &&
                       a.segment_begin + a.num_segments <= a.layout.world_size,
                   "segment range outside the layout");
  ECHO_HOST_ASSERT(a.group_begin >= 0 && a.num_groups >= 0 &&
                       a.group_begin + a.num_groups <= a.layout.groups_per_segment,
                   "group range outside the segment");
  for (int j = a.segment_begin; j < a.segment_begin + a.num_segments; ++j) {
    ECHO_HOST_ASSERT(a.in.codes[j] && a.in.scales[j] && a.in.zeros[j], "dequantize needs every segment it reads");
  }
  if (a.num_groups == 0 || a.num_segments == 0) return;
  ECHO_DISPATCH_DTYPE(a.out_dtype, T, ECHO_DISPATCH_BITS(a.bits, kBits, ECHO_DISPATCH_GROUP_SIZE(a.layout.group_size, kGroup, {
    constexpr int kLanes = kGroup / kElemsPerThread;
    const dim3 grid = grid_of_rows<kLanes>(a.num_groups, a.num_segments);
    if (a.hadamard.enabled) {
      dequantize_kernel<T, kBits, kGroup, true><<<grid, kThreadsPerBlock, 0, stream>>>(a);
    } else {
      dequantize_kernel<T, kBits, kGroup, false><<<grid, kThreadsPerBlock, 0, stream>>>(a);
    }
    ECHO_CHECK(cudaGetLastError());
  })));
}

}  // namespace echo
