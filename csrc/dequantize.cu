// Stage 3, dequantize (gather on the owner, tail on the others): codes of segment j -> s_hat_scaled ->
// s_hat = s_hat_scaled 2^-k -> unrotate -> output dtype (round to nearest even). Every rank decodes the
// same codes, its own segment included, so all ranks hold the same bits (paper, section 4.1).
#include "echo_common.cuh"

namespace echo {
namespace {

using namespace detail;

template <typename T, int kBits, int kGroupSize>
__global__ void __launch_bounds__(kThreadsPerBlock) dequantize_kernel(const DequantizeArgs a) {
  constexpr int kLanes = kGroupSize / kElemsPerThread;
  constexpr int kCodeBytes = kGroupSize * kBits / 8;
  const int64_t tid = int64_t(blockIdx.x) * kThreadsPerBlock + threadIdx.x;
  const int64_t item = tid / kLanes;
  const int lane = static_cast<int>(tid % kLanes);
  if (item >= int64_t(a.num_segments) * a.num_groups) return;
  const int seg = a.segment_begin + static_cast<int>(item / a.num_groups);
  const int64_t gi = a.group_begin + item % a.num_groups;
  const int64_t e = int64_t(seg) * a.layout.groups_per_segment * kGroupSize + gi * kGroupSize +
                    int64_t(lane) * kElemsPerThread;
  if (!a.hadamard.enabled && e >= a.layout.numel) return;  // all padding (the rotation needs whole groups)

  const Codes<kBits> codes =
      load_codes<kBits>(a.in.codes[seg] + gi * kCodeBytes + lane * Codes<kBits>::kBytesPerThread);
  const GroupParams p = params_from_bits(a.in.scales[seg][gi], a.in.zeros[seg][gi]);
  float v[kElemsPerThread];
  decode<kBits>(codes, p.scale, p.zero, v);
  const int k = pow2_exponent(a.pow2_amax);
  if (k != 0) {
    const float down = exp2_int(-k);
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) v[i] = f_mul(v[i], down);
  }
  if (a.hadamard.enabled) unrotate<kLanes>(v, lane, a.hadamard);
  store16(static_cast<T*>(a.out), e, a.layout.numel, aligned16(a.out), v);
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
    const int64_t threads = int64_t(a.num_segments) * a.num_groups * kLanes;
    dequantize_kernel<T, kBits, kGroup><<<num_blocks(threads), kThreadsPerBlock, 0, stream>>>(a);
    ECHO_CHECK(cudaGetLastError());
  })));
}

}  // namespace echo
