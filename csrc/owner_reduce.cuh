// Stage 2, owner reduce, the kernel (internal to csrc/; the stage is described in owner_reduce.cu).
// Two translation units instantiate it: owner_reduce.cu the full kernel (compensation, rotation, residual)
// and the host entry point, owner_reduce_uncompensated.cu the uncompensated one (no compensation, rotation
// or residual), so that the two halves of its instantiations build in parallel.
#pragma once

#include "echo_compensator.cuh"
#include "echo_contribution.cuh"
#include "echo_device.cuh"
#include "echo_quantizer.cuh"
#include "echo_rescale.cuh"

namespace echo {
namespace detail {

// Resident blocks per SM: the P - 1 copies are loaded together, so the registers a thread needs grow with P;
// these are the most blocks at which ptxas allocates every instantiation without spilling (64, 85 and 128
// registers). Fewer resident threads are fine here: each has (P - 1) code loads in flight. The full kernel
// also holds the own segment's state words (16 registers) from the correction to the update: at P <= 4 it
// spilled at the uncompensated kernel's bound (ptxas, 2026-12-03), so it is built for one block fewer.
constexpr int owner_min_blocks(int world_size, bool uncompensated) {
  return world_size <= 2 ? (uncompensated ? 4 : 3) : (world_size <= 4 ? (uncompensated ? 3 : 2) : 2);
}

template <typename T, int kWorld, int kBits, int kGroupSize, bool kUncompensated>
__global__ void ECHO_KERNEL_BOUNDS(owner_min_blocks(kWorld, kUncompensated)) owner_reduce_kernel(const OwnerReduceArgs a) {
  constexpr int kLanes = kGroupSize / kElemsPerThread;
  int lane;
  const int64_t item = group_in_row<kLanes>(lane);  // one row: the owned segment
  if (item >= a.num_groups) return;
  const int64_t gi = a.group_begin + item;
  const int64_t in_seg = gi * kGroupSize;  // the group's first element in the segment
  const int64_t code_offset = gi * kGroupCodeBytes<kBits, kLanes>;

  // The own rs: x's loads are issued first. The uncompensated path keeps x as loaded (half the registers
  // of fp32 for 16-bit x) and converts it at its turn in the sum; the others form rs here, so that their
  // state loads are in flight together with the copies'.
  const int64_t own_e = int64_t(a.rank) * a.layout.groups_per_segment * kGroupSize + in_seg;
  RawChunks<T> own_raw;
  load_contribution_x<T, kLanes>(a.src, own_e, lane, a.layout.numel, own_raw);
  const int k = pow2_exponent(a.pow2_amax);
  float own[kUncompensated ? 1 : kElemsPerThread];
  StateWords m;  // the own segment's state, read for c and updated below (residual "local")
  if constexpr (!kUncompensated) contribution_from_raw<T, kLanes>(a.src, own_raw, own_e, lane, k, own, m);
  Codes<kBits> copies[kWorld];
  uint16_t scale_bits[kWorld];
  uint16_t zero_bits[kWorld];
#pragma unroll
  for (int r = 0; r < kWorld; ++r) {
    if (r != a.rank) {
      copies[r] = load_codes<kBits, kLanes>(a.in.codes[r] + code_offset, lane);
      load_param_bits(a.in, r, gi, scale_bits[r], zero_bits[r]);
    }
  }

  float acc[kElemsPerThread];
  sum_in_rank_order<kWorld>(acc, [&](int r, float (&t)[kElemsPerThread]) {
    if (r == a.rank) {
      if constexpr (kUncompensated) {
        contribution_from_raw<T, kLanes, true>(a.src, own_raw, own_e, lane, k, t, m);
      } else {
#pragma unroll
        for (int i = 0; i < kElemsPerThread; ++i) t[i] = own[i];
      }
    } else {
      const GroupParams p = table_params<kBits>(a.in, scale_bits[r], zero_bits[r]);
      decode<kBits>(copies[r], p.scale, p.zero, t);
    }
  });

  Codes<kBits> codes;
  const GroupParams p = quantize_group<kBits, kLanes>(acc, a.quantizer, lane, codes);
#pragma unroll
  for (int d = 0; d < kWorld; ++d) {
    if (a.out.codes[d] != nullptr) store_packet_group<kBits, kLanes>(a.out, d, gi, lane, codes, p);
  }
  if (!kUncompensated && a.src.update_state) {
    // residual "local", own share: e = s_hat_scaled - acc, u = -(e 2^-k).
    float u[kElemsPerThread];
    local_residual<kBits>(codes, p, acc, k, u);
    update_state<kLanes>(a.src, own_e, lane, m, u);
  }
}

// Launches the (kUncompensated, T) instantiation for the configuration of a (the host checks are the caller's).
template <bool kUncompensated, typename T>
void launch_owner_reduce_kernel(const OwnerReduceArgs& a, cudaStream_t stream) {
  ECHO_DISPATCH_WORLD_SIZE(a.layout.world_size, kWorld, ECHO_DISPATCH_BITS(a.bits, kBits, ECHO_DISPATCH_GROUP_SIZE(a.layout.group_size, kGroup, {
    constexpr int kLanes = kGroup / kElemsPerThread;
    const dim3 grid = grid_of_rows<kLanes>(a.num_groups, 1);
    owner_reduce_kernel<T, kWorld, kBits, kGroup, kUncompensated><<<grid, kThreadsPerBlock, 0, stream>>>(a);
    ECHO_CHECK(cudaGetLastError());
  })));
}

// The compensated kernels build in one translation unit per dtype (owner_reduce_<f32|f16|bf16>.cu), the
// uncompensated ones in one (owner_reduce_uncompensated.cu), side by side: `extern` here, `template` there.
#define ECHO_OWNER_REDUCE_KERNELS(kind, kUncompensated, T) \
  kind template void launch_owner_reduce_kernel<kUncompensated, T>(const OwnerReduceArgs&, cudaStream_t);
#ifndef ECHO_OWNER_REDUCE_INSTANTIATING
ECHO_OWNER_REDUCE_KERNELS(extern, true, float)
ECHO_OWNER_REDUCE_KERNELS(extern, true, __half)
ECHO_OWNER_REDUCE_KERNELS(extern, true, __nv_bfloat16)
ECHO_OWNER_REDUCE_KERNELS(extern, false, float)
ECHO_OWNER_REDUCE_KERNELS(extern, false, __half)
ECHO_OWNER_REDUCE_KERNELS(extern, false, __nv_bfloat16)
#endif

}  // namespace detail
}  // namespace echo
