// Device basics shared by the stage kernels (internal to csrc/; not host-facing): the dispatch of the
// configuration to template parameters, the thread layout and launch geometry, exact fp32 operations, and
// the loads and stores of a thread's elements.
//
// Numerics contract (echo_ds/quant.py, echo_ds/algorithm.py, echo_ds/compensator.py), reproduced bit for
// bit: fp32 arithmetic, one round-to-nearest-even per operation, no fused multiply-add (the one exception,
// the Hadamard butterflies' multiply-add by +-1 in fwht, rounds once like the addition it replaces). Every
// fp32 operation on values below goes through f_add/f_sub/f_mul/f_div (the _rn intrinsics are never
// contracted), and the builder also passes -fmad=false. Min/max use fminf/fmaxf, which ignore NaN where
// torch propagates it: each group therefore carries an explicit non-finite flag.
//
// Thread layout: a group of g elements is held by kLanes = g / 16 consecutive lanes of one warp, aligned
// to kLanes, 16 elements per lane as kChunks = 2 chunks of kChunkElems = 8 consecutive elements. Chunk c
// of lane l holds the group's elements
//
//     c * (kChunkElems * kLanes) + l * kChunkElems + [0, kChunkElems)          (chunk_offset)
//
// so for each chunk the group's lanes together touch one contiguous run of 8 kLanes elements: a warp-wide
// access of 16-bit data (16 bytes per lane) fills whole 32-byte sectors, and the two 16-byte halves of an
// fp32 chunk fill them together. The first layout, 16 consecutive elements per lane, used half or a
// quarter of each sector per instruction and left the stages bound by L2 requests and by stores draining;
// chunks of 4 measured the same or slower than chunks of 8 (docs/kernels.md, "Thread layout";
// benchmarks/runs/2026-12-03_layout_variants.txt). Register i = c * kChunkElems + j
// of a lane is element chunk_offset(lane, c) + j of its group. Group-wide reductions and the cross-lane
// butterflies of the Hadamard transform are shuffles restricted to the group's lanes (group_mask), so
// whole groups may leave early without stalling their warp neighbours.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>

#include "echo_api.cuh"
#include "echo_check.cuh"

// ---------------------------------------------------------------------------------------------------
// Dispatch: world size, bit width, group size and dtype become template parameters here and only here.
// ---------------------------------------------------------------------------------------------------
#define ECHO_DISPATCH_WORLD_SIZE(world_size, kWorld, ...)                                         \
  switch (world_size) {                                                                            \
    case 2: { constexpr int kWorld = 2; __VA_ARGS__; break; }                                      \
    case 4: { constexpr int kWorld = 4; __VA_ARGS__; break; }                                      \
    case 8: { constexpr int kWorld = 8; __VA_ARGS__; break; }                                      \
    default:                                                                                       \
      ::echo::raise_error(__FILE__, __LINE__,                                                      \
                          "unsupported world size " + std::to_string(world_size) +                 \
                              " (the kernels are built for 2, 4, 8)");                             \
  }

#define ECHO_DISPATCH_BITS(bits, kBitsName, ...)                                                   \
  switch (bits) {                                                                                  \
    case 4: { constexpr int kBitsName = 4; __VA_ARGS__; break; }                                   \
    case 8: { constexpr int kBitsName = 8; __VA_ARGS__; break; }                                   \
    default:                                                                                       \
      ::echo::raise_error(__FILE__, __LINE__, "unsupported bit width " + std::to_string(bits));    \
  }

#define ECHO_DISPATCH_GROUP_SIZE(group_size, kGroup, ...)                                          \
  switch (group_size) {                                                                            \
    case 64: { constexpr int kGroup = 64; __VA_ARGS__; break; }                                    \
    case 128: { constexpr int kGroup = 128; __VA_ARGS__; break; }                                  \
    case 256: { constexpr int kGroup = 256; __VA_ARGS__; break; }                                  \
    default:                                                                                       \
      ::echo::raise_error(__FILE__, __LINE__,                                                      \
                          "unsupported group size " + std::to_string(group_size) +                 \
                              " (the kernels are built for 64, 128, 256)");                        \
  }

#define ECHO_DISPATCH_DTYPE(dtype, T, ...)                                                         \
  switch (dtype) {                                                                                 \
    case ::echo::DType::kFloat32: { using T = float; __VA_ARGS__; break; }                         \
    case ::echo::DType::kFloat16: { using T = __half; __VA_ARGS__; break; }                        \
    case ::echo::DType::kBFloat16: { using T = __nv_bfloat16; __VA_ARGS__; break; }                \
    default:                                                                                       \
      ::echo::raise_error(__FILE__, __LINE__, "unsupported dtype " + std::to_string(int(dtype)));  \
  }

namespace echo {
namespace detail {

// 16 elements per thread in 2 chunks of 8 (see the thread layout above). ECHO_CHUNK_ELEMS = 4 or 16
// builds the alternatives that were measured against it; 8 is the shipped one.
constexpr int kElemsPerThread = 16;
#ifndef ECHO_CHUNK_ELEMS
#define ECHO_CHUNK_ELEMS 8
#endif
constexpr int kChunkElems = ECHO_CHUNK_ELEMS;
constexpr int kChunks = kElemsPerThread / kChunkElems;
static_assert(kChunkElems == 4 || kChunkElems == 8 || kChunkElems == 16, "chunks of 4, 8 or 16 elements");
// ECHO_KERNEL_BOUNDS(n): 256 threads per block and at least n resident blocks per SM, which caps the
// registers at 65536 / (256 n) (n = 4: 64, 5: 48). Each kernel picks its n from the ptxas register and
// spill report and the occupancy it needs (benchmarks/runs/2026-12-03.md); -DECHO_MIN_BLOCKS_PER_SM=n sets every
// kernel's n, for experiments.
#ifdef ECHO_MIN_BLOCKS_PER_SM
#define ECHO_KERNEL_BOUNDS(n) __launch_bounds__(::echo::detail::kThreadsPerBlock, ECHO_MIN_BLOCKS_PER_SM)
#else
#define ECHO_KERNEL_BOUNDS(n) __launch_bounds__(::echo::detail::kThreadsPerBlock, n)
#endif
constexpr int kThreadsPerBlock = 256;
constexpr int kWarpSize = 32;

static_assert(kMinGroupSize % kElemsPerThread == 0, "a group must be whole threads");
static_assert(kMaxGroupSize / kElemsPerThread <= kWarpSize, "a group must fit in one warp");
static_assert(kThreadsPerBlock % kWarpSize == 0, "blocks are whole warps");

// fp32 operations, one rounding each (never contracted into an FMA).
__device__ __forceinline__ float f_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float f_sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float f_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float f_div(float a, float b) { return __fdiv_rn(a, b); }

// The owner's sum of a thread's elements over the P ranks' terms, ((t_0 + t_1) + ...) + t_{P-1}: rank order,
// one rounding per addition, the order echo_ds.algorithm sums in. term(r, t) fills rank r's term (the caller's
// own, held or formed, or decoded from its copy). Every kernel that reduces sums through here.
template <int kWorld, typename Term>
__device__ __forceinline__ void sum_in_rank_order(float (&acc)[kElemsPerThread], Term&& term) {
#pragma unroll
  for (int r = 0; r < kWorld; ++r) {
    float t[kElemsPerThread];
    term(r, t);
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) acc[i] = (r == 0) ? t[i] : f_add(acc[i], t[i]);
  }
}

__device__ __forceinline__ bool is_finite(float v) { return fabsf(v) < __int_as_float(0x7f800000); }

// 2^k for k in [-126, 126], exactly.
__device__ __forceinline__ float exp2_int(int k) { return __int_as_float((127 + k) << 23); }

// ---------------------------------------------------------------------------------------------------
// Lanes of one group.
// ---------------------------------------------------------------------------------------------------
template <int kLanes>
__device__ __forceinline__ unsigned group_mask() {
  if constexpr (kLanes == kWarpSize) {
    return 0xffffffffu;
  } else {
    const unsigned lane_in_warp = threadIdx.x % kWarpSize;
    return ((1u << kLanes) - 1u) << (lane_in_warp & ~unsigned(kLanes - 1));
  }
}

// ---------------------------------------------------------------------------------------------------
// Loads and stores of one thread's 16 elements.
// ---------------------------------------------------------------------------------------------------
// First element (within its group) of chunk c of lane `lane`.
template <int kLanes>
__device__ __forceinline__ int chunk_offset(int lane, int c) {
  return c * (kChunkElems * kLanes) + lane * kChunkElems;
}

// kBytes (2, 4, 8, 16, 32 or 64) of aligned memory <-> 32-bit words (2 bytes: the low half of w[0]).
template <int kBytes>
__device__ __forceinline__ void load_bytes(const void* __restrict__ p, uint32_t* w) {
  if constexpr (kBytes == 2) {
    w[0] = *static_cast<const uint16_t*>(p);
  } else if constexpr (kBytes == 4) {
    w[0] = *static_cast<const uint32_t*>(p);
  } else if constexpr (kBytes == 8) {
    const uint2 t = *static_cast<const uint2*>(p);
    w[0] = t.x;
    w[1] = t.y;
  } else {
    static_assert(kBytes % 16 == 0, "2, 4, 8 or a multiple of 16 bytes");
#pragma unroll
    for (int k = 0; k < kBytes / 16; ++k) {
      const uint4 t = static_cast<const uint4*>(p)[k];
      w[4 * k] = t.x;
      w[4 * k + 1] = t.y;
      w[4 * k + 2] = t.z;
      w[4 * k + 3] = t.w;
    }
  }
}
template <int kBytes>
__device__ __forceinline__ void store_bytes(void* __restrict__ p, const uint32_t* w) {
  if constexpr (kBytes == 2) {
    *static_cast<uint16_t*>(p) = static_cast<uint16_t>(w[0]);
  } else if constexpr (kBytes == 4) {
    *static_cast<uint32_t*>(p) = w[0];
  } else if constexpr (kBytes == 8) {
    *static_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
    static_assert(kBytes % 16 == 0, "2, 4, 8 or a multiple of 16 bytes");
#pragma unroll
    for (int k = 0; k < kBytes / 16; ++k) {
      static_cast<uint4*>(p)[k] = make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
    }
  }
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// One chunk: words of kChunkElems elements of T <-> fp32 (round to nearest even on the way out).
template <typename T>
__device__ __forceinline__ float word_to_f32(uint32_t w, int half);
template <>
__device__ __forceinline__ float word_to_f32<__half>(uint32_t w, int half) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(half ? w >> 16 : w & 0xffffu)));
}
template <>
__device__ __forceinline__ float word_to_f32<__nv_bfloat16>(uint32_t w, int half) {
  return __uint_as_float(half ? (w & 0xffff0000u) : (w << 16));  // bf16 is the upper half of fp32
}
__device__ __forceinline__ uint32_t f32_bits16(float v, __half) { return __half_as_ushort(__float2half_rn(v)); }
__device__ __forceinline__ uint32_t f32_bits16(float v, __nv_bfloat16) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

template <typename T>
__device__ __forceinline__ void unpack_chunk(const uint32_t* w, float* v) {
#pragma unroll
  for (int j = 0; j < kChunkElems; ++j) {
    if constexpr (sizeof(T) == 4) {
      v[j] = __uint_as_float(w[j]);
    } else {
      v[j] = word_to_f32<T>(w[j / 2], j % 2);
    }
  }
}
template <typename T>
__device__ __forceinline__ void pack_chunk(const float* v, uint32_t* w) {
#pragma unroll
  for (int k = 0; k < kChunkElems * int(sizeof(T)) / 4; ++k) {
    if constexpr (sizeof(T) == 4) {
      w[k] = __float_as_uint(v[k]);
    } else {
      w[k] = f32_bits16(v[2 * k], T()) | (f32_bits16(v[2 * k + 1], T()) << 16);
    }
  }
}

// This lane's 16 elements of T as loaded, before conversion: kChunks chunks of words. Splitting the load
// from the conversion lets a kernel issue a load early and hold its words (half the registers of fp32 for
// 16-bit data) until it needs the values (the uncompensated entry's prefetch, the uncompensated owner
// reduce).
template <typename T>
struct RawChunks {
  static constexpr int kWords = kChunkElems * int(sizeof(T)) / 4;
  uint32_t w[kChunks][kWords];
};

// The words of this lane's elements of the group starting at p[group_base]; zeros past numel (the layout's
// padding). vec_ok: p is 16-byte aligned. Every chunk's load is issued before any word is used.
template <typename T, int kLanes>
__device__ __forceinline__ void load_raw(const T* __restrict__ p, int64_t group_base, int lane, int64_t numel,
                                         bool vec_ok, RawChunks<T>& r) {
  constexpr int kBytes = kChunkElems * int(sizeof(T));
  if (vec_ok && group_base + chunk_offset<kLanes>(lane, kChunks - 1) + kChunkElems <= numel) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) load_bytes<kBytes>(p + group_base + chunk_offset<kLanes>(lane, c), r.w[c]);
  } else {
    constexpr int kBits = 8 * int(sizeof(T));
    constexpr int kPerWord = 32 / kBits;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t e = group_base + chunk_offset<kLanes>(lane, c);
#pragma unroll
      for (int k = 0; k < RawChunks<T>::kWords; ++k) r.w[c][k] = 0u;
#pragma unroll
      for (int j = 0; j < kChunkElems; ++j) {
        if (e + j < numel) {
          uint32_t bits;
          if constexpr (sizeof(T) == 4) {
            bits = __float_as_uint(p[e + j]);
          } else {
            bits = *reinterpret_cast<const uint16_t*>(p + e + j);
          }
          r.w[c][j / kPerWord] |= bits << (kBits * (j % kPerWord));
        }
      }
    }
  }
}

template <typename T>
__device__ __forceinline__ void unpack_raw(const RawChunks<T>& r, float (&v)[kElemsPerThread]) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c) unpack_chunk<T>(r.w[c], v + c * kChunkElems);
}

// v = this lane's 16 elements of the group starting at p[group_base], as fp32; zeros past numel.
template <typename T, int kLanes>
__device__ __forceinline__ void load_thread(const T* __restrict__ p, int64_t group_base, int lane, int64_t numel,
                                            bool vec_ok, float (&v)[kElemsPerThread]) {
  RawChunks<T> r;
  load_raw<T, kLanes>(p, group_base, lane, numel, vec_ok, r);
  unpack_raw<T>(r, v);
}

// The largest finite value of T as fp32 (torch.finfo(T).max), and a finite fp32 value saturated to it
// (algorithm.from_segments): a finite sum beyond T's range comes back as T's largest value, not as an
// infinity; NaN and infinities pass unchanged.
template <typename T>
constexpr float kMaxFinite = 3.4028234663852886e38f;
template <>
constexpr float kMaxFinite<__half> = 65504.0f;
template <>
constexpr float kMaxFinite<__nv_bfloat16> = 3.3895313892515355e38f;  // 0x7F7F: (2 - 2^-7) 2^127
template <typename T>
__device__ __forceinline__ float saturate(float v) {
  if constexpr (sizeof(T) == 4) {
    return v;
  } else {
    return is_finite(v) ? fminf(fmaxf(v, -kMaxFinite<T>), kMaxFinite<T>) : v;
  }
}

// p[group_base + this lane's elements, below numel] = v in T (saturated, then rounded to nearest even).
template <typename T, int kLanes>
__device__ __forceinline__ void store_thread(T* __restrict__ p, int64_t group_base, int lane, int64_t numel,
                                             bool vec_ok, const float (&values)[kElemsPerThread]) {
  constexpr int kBytes = kChunkElems * int(sizeof(T));
  float v[kElemsPerThread];
#pragma unroll
  for (int i = 0; i < kElemsPerThread; ++i) v[i] = saturate<T>(values[i]);
  if (vec_ok && group_base + chunk_offset<kLanes>(lane, kChunks - 1) + kChunkElems <= numel) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      uint32_t w[kBytes / 4];
      pack_chunk<T>(v + c * kChunkElems, w);
      store_bytes<kBytes>(p + group_base + chunk_offset<kLanes>(lane, c), w);
    }
  } else {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t e = group_base + chunk_offset<kLanes>(lane, c);
#pragma unroll
      for (int j = 0; j < kChunkElems; ++j) {
        if (e + j < numel) p[e + j] = from_f32<T>(v[c * kChunkElems + j]);
      }
    }
  }
}

// p is 16-byte aligned (the vector loads and stores need it).
__host__ __device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---------------------------------------------------------------------------------------------------
// Launch geometry: a launch's grid (host) and a thread's place in it (device).
// ---------------------------------------------------------------------------------------------------
// Groups per block and item under grid_of_rows.
template <int kLanes>
constexpr int kGroupsPerBlockItem = kThreadsPerBlock / kLanes;

// (group within the row, lane) of this thread's first item under grid_of_rows<kLanes, kItems>: a block
// covers kItems consecutive runs of kGroupsPerBlockItem groups; item i of a thread is its first group plus
// i kGroupsPerBlockItem.
template <int kLanes, int kItems = 1>
__device__ __forceinline__ int64_t group_in_row(int& lane) {
  lane = static_cast<int>(threadIdx.x % kLanes);
  return int64_t(blockIdx.x) * (kItems * kGroupsPerBlockItem<kLanes>) + threadIdx.x / kLanes;
}

inline unsigned num_blocks(int64_t num_threads) {
  const int64_t blocks = (num_threads + kThreadsPerBlock - 1) / kThreadsPerBlock;
  ECHO_HOST_ASSERT(blocks < (int64_t(1) << 31), "launch too large");
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
}

// Grid of `rows` rows (blockIdx.y: a segment) of `groups` groups each (blockIdx.x), kLanes lanes per group,
// kItems groups per thread (group_in_row): the segment comes from the block row, so no thread divides by
// the group count.
template <int kLanes, int kItems = 1>
inline dim3 grid_of_rows(int64_t groups, int rows) {
  ECHO_HOST_ASSERT(rows >= 1 && rows <= 65535, "launch too large");
  constexpr int64_t kPerBlock = int64_t(kItems) * kGroupsPerBlockItem<kLanes>;
  const int64_t blocks = (groups + kPerBlock - 1) / kPerBlock;
  return dim3(num_blocks(blocks * kThreadsPerBlock), static_cast<unsigned>(rows), 1u);
}

}  // namespace detail
}  // namespace echo
