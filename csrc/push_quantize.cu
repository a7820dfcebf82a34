// Stage 1, entry (push): x -> r' = rotate(x) + c -> rs = r' 2^k -> codes of the non-owned segments,
// fp32 rs of the owned one. The correction, the rotation and the statistics live in registers only;
// x' is never written (paper, section 5.3).
//
// A persistent grid-stride loop (echo_common.cuh, GridCursor): each thread issues the loads of its next
// group's x before it quantizes the current one.
#include "echo_common.cuh"

namespace echo {
namespace {

using namespace detail;

// Where the entry's correction comes from. A template parameter, so that the plain entry carries no
// registers for a correction it does not read.
enum class CompMode { kNone, kCorrection, kState };

template <typename T, int kBits, int kGroupSize, CompMode kComp, bool kRotate>
__global__ void __launch_bounds__(kThreadsPerBlock) push_quantize_kernel(const PushQuantizeArgs a) {
  constexpr int kLanes = kGroupSize / kElemsPerThread;
  constexpr int kCodeBytes = kGroupSize * kBits / 8;
  const int world_size = a.layout.world_size;
  const int64_t numel = a.layout.numel;
  const int64_t seg_numel = a.layout.groups_per_segment * kGroupSize;
  const int64_t per_segment = a.num_groups * kLanes;
  const T* __restrict__ x = static_cast<const T*>(a.x);
  const bool vec_ok = aligned16(a.x);
  const int lane = static_cast<int>(threadIdx.x % kLanes);  // fixed for the whole loop (GridCursor)
  const ElementMap<kLanes, kRotate> map(lane);              // where each register sits after the rotation
  const uint32_t signs = kRotate ? thread_signs(a.hadamard, lane) : 0u;
  const int k = pow2_exponent(a.pow2_amax);
  const float up = exp2_int(k);
  const float down = exp2_int(-k);

  auto group_begin_of = [&](const GridCursor& c) {  // first element of the cursor's group, padded index
    return int64_t(c.seg) * seg_numel + (a.group_begin + c.w / kLanes) * kGroupSize;
  };
  // NOTE: only x is fetched ahead. Fetching the fp32 correction ahead too took 80-124 registers (ptxas),
  // a third to a half of the plain entry's occupancy; its loads are issued first in the body instead.
  Chunk<T> xc;
  GridCursor cur = GridCursor::first(per_segment, world_size);
  if (cur.seg < world_size) chunk_load(xc, x, group_begin_of(cur) + lane * kElemsPerThread, numel, vec_ok);
  while (cur.seg < world_size) {
    const GridCursor nxt = cur.next(per_segment, world_size);
    Chunk<T> xn;
    if (nxt.seg < world_size) chunk_load(xn, x, group_begin_of(nxt) + lane * kElemsPerThread, numel, vec_ok);

    const int64_t g0 = group_begin_of(cur);
    const int64_t gi = a.group_begin + cur.w / kLanes;
    // c is loaded before x is converted and rotated, so that its loads are in flight meanwhile.
    float c[kElemsPerThread];
    if constexpr (kComp == CompMode::kState) {  // c = ((m1 a) + (m2 (1 - a))) eta
      float m2[kElemsPerThread];
      load_f32_mapped(a.m1 + g0, map, c);
      load_f32_mapped(a.m2 + g0, map, m2);
#pragma unroll
      for (int i = 0; i < kElemsPerThread; ++i) c[i] = correction(c[i], m2[i], a.coeffs);
    } else if constexpr (kComp == CompMode::kCorrection) {
      load_f32_mapped(a.correction + g0, map, c);
    }
    float v[kElemsPerThread];
    chunk_values(xc, x, g0 + lane * kElemsPerThread, numel, v);
    if constexpr (kRotate) {  // rotate: (H (D v)) * norm, leaving the registers as ElementMap says
#pragma unroll
      for (int i = 0; i < kElemsPerThread; ++i) v[i] = f_mul(v[i], ((signs >> i) & 1u) ? -1.0f : 1.0f);
      fwht_swapped<kLanes>(v, lane);
#pragma unroll
      for (int i = 0; i < kElemsPerThread; ++i) v[i] = f_mul(v[i], a.hadamard.norm);
    }
    if constexpr (kComp != CompMode::kNone) {
#pragma unroll
      for (int i = 0; i < kElemsPerThread; ++i) v[i] = f_add(v[i], c[i]);
    }
    if (k != 0) {
#pragma unroll
      for (int i = 0; i < kElemsPerThread; ++i) v[i] = f_mul(v[i], up);
    }

    if (cur.seg == a.rank) {  // the owned segment enters the owner's sum unquantized
      store_f32_mapped(a.own_out + gi * kGroupSize, map, v);
    } else {
      Codes<kBits> codes;
      const GroupParams p = quantize_group<kBits, kLanes>(v, a.policy, codes);
      store_codes_mapped<kBits>(a.out.codes[cur.seg] + gi * kCodeBytes, map, codes);
      if (lane == 0) {
        a.out.scales[cur.seg][gi] = p.scale_bits;
        a.out.zeros[cur.seg][gi] = p.zero_bits;
      }
      if (a.residual_out != nullptr) {
        // residual "local": u = -(e 2^-k), e = decode(codes) - rs, the rounding error this rank added.
        float u[kElemsPerThread];
        decode<kBits>(codes, p.scale, p.zero, u);
#pragma unroll
        for (int i = 0; i < kElemsPerThread; ++i) {
          const float err = f_sub(u[i], v[i]);
          u[i] = -(k != 0 ? f_mul(err, down) : err);
        }
        store_f32_mapped(a.residual_out + g0, map, u);
      }
    }

    cur = nxt;
    xc = xn;
  }
}

template <typename T, int kBits, int kGroupSize, CompMode kComp, bool kRotate>
void launch(const PushQuantizeArgs& a, cudaStream_t stream) {
  constexpr int kLanes = kGroupSize / kElemsPerThread;
  const auto kernel = push_quantize_kernel<T, kBits, kGroupSize, kComp, kRotate>;
  const int64_t threads = int64_t(a.layout.world_size) * a.num_groups * kLanes;
  kernel<<<persistent_blocks(reinterpret_cast<const void*>(kernel), threads), kThreadsPerBlock, 0, stream>>>(a);
  ECHO_CHECK(cudaGetLastError());
}

template <typename T, int kBits, int kGroupSize>
void launch_mode(const PushQuantizeArgs& a, cudaStream_t stream) {
  const bool rotate = a.hadamard.enabled != 0;
  if (a.m1 != nullptr) {
    rotate ? launch<T, kBits, kGroupSize, CompMode::kState, true>(a, stream)
           : launch<T, kBits, kGroupSize, CompMode::kState, false>(a, stream);
  } else if (a.correction != nullptr) {
    rotate ? launch<T, kBits, kGroupSize, CompMode::kCorrection, true>(a, stream)
           : launch<T, kBits, kGroupSize, CompMode::kCorrection, false>(a, stream);
  } else {
    rotate ? launch<T, kBits, kGroupSize, CompMode::kNone, true>(a, stream)
           : launch<T, kBits, kGroupSize, CompMode::kNone, false>(a, stream);
  }
}

}  // namespace

void launch_push_quantize(const PushQuantizeArgs& a, cudaStream_t stream) {
  ECHO_HOST_ASSERT(a.layout.world_size >= 2 && a.layout.world_size <= kMaxWorldSize, "world size out of range");
  ECHO_HOST_ASSERT(a.rank >= 0 && a.rank < a.layout.world_size, "rank out of range");
  ECHO_HOST_ASSERT(a.group_begin >= 0 && a.num_groups >= 0 &&
                       a.group_begin + a.num_groups <= a.layout.groups_per_segment,
                   "group range outside the segment");
  ECHO_HOST_ASSERT(!(a.m1 != nullptr && a.correction != nullptr), "pass the state or the correction, not both");
  ECHO_HOST_ASSERT((a.m1 == nullptr) == (a.m2 == nullptr), "m1 and m2 come together");
  if (a.num_groups == 0) return;
  ECHO_DISPATCH_WORLD_SIZE(a.layout.world_size, kWorld, (void)kWorld);  // raises for unsupported P
  ECHO_DISPATCH_DTYPE(a.x_dtype, T, ECHO_DISPATCH_BITS(a.bits, kBits, ECHO_DISPATCH_GROUP_SIZE(a.layout.group_size, kGroup, {
    launch_mode<T, kBits, kGroup>(a, stream);
  })));
}

}  // namespace echo
