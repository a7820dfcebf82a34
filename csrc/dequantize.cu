// Stage 3, dequantize (gather on the owner, tail on the others): codes of segment j -> s_hat_scaled ->
// s_hat = s_hat_scaled 2^-k -> unrotate -> output dtype (round to nearest even). Every rank decodes the
// same codes, its own segment included, so all ranks hold the same bits (paper, section 4.1). With
// residual "output" it is also the compensator's update, which needs s_hat: it re-reads x and the state
// (the entry read them too: 12 bytes of state per element and call) and writes the state once.
#include "echo_compensator.cuh"
#include "echo_contribution.cuh"
#include "echo_device.cuh"
#include "echo_quantizer.cuh"
#include "echo_rescale.cuh"
#include "echo_rotation.cuh"

namespace echo {
namespace {

using namespace detail;

// Instantiations per configuration: with and without the inverse rotation (without it the kernel needs 32
// registers instead of 40, 8 resident blocks per SM instead of 6), and with the compensator update of
// residual "output" (kUpdate: it also forms r' from x and the state; built for 3 blocks, 85 registers, as
// it spilled at 4 blocks in its first build, 2026-12-03).
template <bool kUpdate>
constexpr int dequantize_min_blocks() { return kUpdate ? 3 : 6; }

template <typename T, int kBits, int kGroupSize, bool kRotated, bool kUpdate>
__global__ void ECHO_KERNEL_BOUNDS((dequantize_min_blocks<kUpdate>())) dequantize_kernel(const DequantizeArgs a) {
  constexpr int kLanes = kGroupSize / kElemsPerThread;
  int lane;
  const int64_t item = group_in_row<kLanes>(lane);
  if (item >= a.num_groups) return;
  const int seg = a.segment_begin + static_cast<int>(blockIdx.y);
  const int64_t gi = a.group_begin + item;
  const int64_t e = int64_t(seg) * a.layout.groups_per_segment * kGroupSize + gi * kGroupSize;  // group start
  if (!kUpdate && e >= a.layout.numel) return;  // the whole group is padding (whose state is still updated)

  GroupParams p;
  const Codes<kBits> codes = load_packet_group<kBits, kLanes>(a.in, seg, gi, lane, p);
  const int k = pow2_exponent(a.pow2_amax);
  const float down = exp2_int(-k);
  float v[kElemsPerThread];
  if constexpr (kUpdate) {
    // residual "output": u = r' - s_hat / P, r' formed again as the entry formed it (x is T here: the
    // launcher requires x and y of one dtype), before s_hat is decoded so that fewer values are live.
    // s_hat / P is a product by fp32(1 / P) (__frcp_rn is the correctly rounded reciprocal), as PyTorch
    // computes `cuda_tensor / python_int` and the reference writes it (exact for P = 2, 4, 8).
    float r[kElemsPerThread];
    StateWords m;
    contribution<T, kLanes>(a.src, e, lane, a.layout.numel, /*k=*/0, r, m);
    decode<kBits>(codes, p.scale, p.zero, v);
    const float inv_world = __frcp_rn(static_cast<float>(a.layout.world_size));
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) {
      if (k != 0) v[i] = f_mul(v[i], down);
      r[i] = f_sub(r[i], f_mul(v[i], inv_world));
    }
    update_state<kLanes>(a.src, e, lane, m, r);
    if (e >= a.layout.numel) return;
  } else {
    decode<kBits>(codes, p.scale, p.zero, v);
    if (k != 0) {
#pragma unroll
      for (int i = 0; i < kElemsPerThread; ++i) v[i] = f_mul(v[i], down);
    }
  }
  if constexpr (kRotated) unrotate<kLanes>(v, lane, a.src.hadamard);
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
  if (a.src.update_state) {
    check_contribution(a.src);
    ECHO_HOST_ASSERT(a.src.x_dtype == a.out_dtype, "the update reads x of the output's dtype");
  }
  if (a.num_groups == 0 || a.num_segments == 0) return;
  ECHO_DISPATCH_DTYPE(a.out_dtype, T, ECHO_DISPATCH_BITS(a.bits, kBits, ECHO_DISPATCH_GROUP_SIZE(a.layout.group_size, kGroup, {
    constexpr int kLanes = kGroup / kElemsPerThread;
    const dim3 grid = grid_of_rows<kLanes>(a.num_groups, a.num_segments);
    if (a.src.update_state) {
      if (a.src.hadamard.enabled) {
        dequantize_kernel<T, kBits, kGroup, true, true><<<grid, kThreadsPerBlock, 0, stream>>>(a);
      } else {
        dequantize_kernel<T, kBits, kGroup, false, true><<<grid, kThreadsPerBlock, 0, stream>>>(a);
      }
    } else if (a.src.hadamard.enabled) {
      dequantize_kernel<T, kBits, kGroup, true, false><<<grid, kThreadsPerBlock, 0, stream>>>(a);
    } else {
      dequantize_kernel<T, kBits, kGroup, false, false><<<grid, kThreadsPerBlock, 0, stream>>>(a);
    }
    ECHO_CHECK(cudaGetLastError());
  })));
}

}  // namespace echo
