// Stage 3, dequantize (gather on the owner, tail on the others): codes of segment j -> s_hat_scaled ->
// s_hat = s_hat_scaled 2^-k -> unrotate -> output dtype (round to nearest even). Every rank decodes the
// same codes, its own segment included, so all ranks hold the same bits (paper, section 4.1).
//
// A persistent grid-stride loop (echo_common.cuh, GridCursor): each thread issues the loads of its next
// group's codes and parameters before it decodes the current one.
#include "echo_common.cuh"

namespace echo {
namespace {

using namespace detail;

template <int kBits>
struct CodeChunk {
  Codes<kBits> codes;
  uint16_t scale_bits;
  uint16_t zero_bits;
};

// Output pairs (elements 2j, 2j + 1) where the swapped inverse rotation leaves them.
__device__ __forceinline__ void store_pair(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
__device__ __forceinline__ void store_pair(__half* p, float a, float b) {
  *reinterpret_cast<uint32_t*>(p) = half_bits(a) | (half_bits(b) << 16);
}
__device__ __forceinline__ void store_pair(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<uint32_t*>(p) = bf16_bits(a) | (bf16_bits(b) << 16);
}

template <typename T, int kBits, int kGroupSize, bool kRotate>
__global__ void __launch_bounds__(kThreadsPerBlock) dequantize_kernel(const DequantizeArgs a) {
  constexpr int kLanes = kGroupSize / kElemsPerThread;
  constexpr int kCodeBytes = kGroupSize * kBits / 8;
  const int64_t numel = a.layout.numel;
  const int64_t seg_numel = a.layout.groups_per_segment * kGroupSize;
  const int64_t per_segment = a.num_groups * kLanes;
  const int num_segments = a.num_segments;
  T* __restrict__ out = static_cast<T*>(a.out);
  const bool vec_ok = aligned16(a.out);
  const int lane = static_cast<int>(threadIdx.x % kLanes);  // fixed for the whole loop (GridCursor)
  const ElementMap<kLanes, kRotate> map(lane);
  const uint32_t signs = kRotate ? mapped_signs(a.hadamard, map) : 0u;
  const int k = pow2_exponent(a.pow2_amax);
  const float down = exp2_int(-k);

  auto group_of = [&](const GridCursor& c) { return a.group_begin + c.w / kLanes; };
  auto group_begin_of = [&](const GridCursor& c) {  // first element of the cursor's group in y
    return int64_t(a.segment_begin + c.seg) * seg_numel + group_of(c) * kGroupSize;
  };
  // Without the rotation a thread whose 16 elements are all padding has nothing to do; with it every
  // lane of a group takes part in the transform.
  auto active = [&](const GridCursor& c) {
    return c.seg < num_segments && (kRotate || group_begin_of(c) + lane * kElemsPerThread < numel);
  };
  auto fetch = [&](const GridCursor& c, CodeChunk<kBits>& o) {
    const int seg = a.segment_begin + c.seg;
    const int64_t gi = group_of(c);
    o.codes = load_codes<kBits>(a.in.codes[seg] + gi * kCodeBytes + lane * Codes<kBits>::kBytesPerThread);
    o.scale_bits = a.in.scales[seg][gi];
    o.zero_bits = a.in.zeros[seg][gi];
  };

  CodeChunk<kBits> cc;
  GridCursor cur = GridCursor::first(per_segment, num_segments);
  if (active(cur)) fetch(cur, cc);
  while (cur.seg < num_segments) {
    const GridCursor nxt = cur.next(per_segment, num_segments);
    CodeChunk<kBits> cn;
    if (active(nxt)) fetch(nxt, cn);

    if (active(cur)) {
      const int64_t g0 = group_begin_of(cur);
      const GroupParams p = params_from_bits(cc.scale_bits, cc.zero_bits);
      float v[kElemsPerThread];
      decode<kBits>(cc.codes, p.scale, p.zero, v);
      if (k != 0) {
#pragma unroll
        for (int i = 0; i < kElemsPerThread; ++i) v[i] = f_mul(v[i], down);
      }
      if constexpr (kRotate) {  // unrotate: ((H v) * norm) * D, leaving the registers as ElementMap says
        fwht_swapped<kLanes>(v, lane);
#pragma unroll
        for (int i = 0; i < kElemsPerThread; ++i) {
          v[i] = f_mul(f_mul(v[i], a.hadamard.norm), ((signs >> i) & 1u) ? -1.0f : 1.0f);
        }
        const bool whole = vec_ok && g0 + kGroupSize <= numel;
#pragma unroll
        for (int q = 0; q < kElemsPerThread / 2; ++q) {
          const int64_t e = g0 + map.index(2 * q);
          if (whole) {
            store_pair(out + e, v[2 * q], v[2 * q + 1]);
          } else {
            if (e < numel) out[e] = from_f32<T>(v[2 * q]);
            if (e + 1 < numel) out[e + 1] = from_f32<T>(v[2 * q + 1]);
          }
        }
      } else {
        store16(out, g0 + lane * kElemsPerThread, numel, vec_ok, v);
      }
    }

    cur = nxt;
    cc = cn;
  }
}

template <typename T, int kBits, int kGroupSize, bool kRotate>
void launch(const DequantizeArgs& a, cudaStream_t stream) {
  constexpr int kLanes = kGroupSize / kElemsPerThread;
  const auto kernel = dequantize_kernel<T, kBits, kGroupSize, kRotate>;
  const int64_t threads = int64_t(a.num_segments) * a.num_groups * kLanes;
  kernel<<<persistent_blocks(reinterpret_cast<const void*>(kernel), threads), kThreadsPerBlock, 0, stream>>>(a);
  ECHO_CHECK(cudaGetLastError());
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
    a.hadamard.enabled ? launch<T, kBits, kGroup, true>(a, stream) : launch<T, kBits, kGroup, false>(a, stream);
  })));
}

}  // namespace echo
