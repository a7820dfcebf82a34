// Device-side building blocks shared by the stage kernels (internal to csrc/; not host-facing).
//
// Numerics contract (echo_ds/quant.py, echo_ds/collective.py, echo_ds/compensator.py), reproduced bit for
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
#include <cstring>
#include <string>

#include "echo_api.cuh"
#include "echo_check.cuh"

// ---------------------------------------------------------------------------------------------------
// Dispatch: world size, bit width, group size and dtype become template parameters here and only here.
// ---------------------------------------------------------------------------------------------------
#define ECHO_DISPATCH_WORLD_SIZE(world_size, kWorld, ...)                                         \
  switch (world_size) {                                                                            \
    case 2: { constexpr int kWorld = 2; __VA_ARGS__; break; }                                      \
    case 3: { constexpr int kWorld = 3; __VA_ARGS__; break; }                                      \
    case 4: { constexpr int kWorld = 4; __VA_ARGS__; break; }                                      \
    case 8: { constexpr int kWorld = 8; __VA_ARGS__; break; }                                      \
    default:                                                                                       \
      ::echo::raise_error(__FILE__, __LINE__,                                                      \
                          "unsupported world size " + std::to_string(world_size) +                 \
                              " (the kernels are built for 2, 3, 4, 8)");                          \
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

__device__ __forceinline__ bool is_finite(float v) { return fabsf(v) < __int_as_float(0x7f800000); }

// fp16 NaN as torch writes it (torch.full(..., nan, dtype=float16) converts on the host): 0x7E00.
constexpr uint16_t kFp16NaNBits = 0x7E00;

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
// 16-bit data) until it needs the values (the plain entry's prefetch, the plain owner reduce).
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
// (collective.from_segments): a finite sum beyond T's range comes back as T's largest value, not as an
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

// ---------------------------------------------------------------------------------------------------
// Codes: 16 per thread, code of register i at bits [kBits i, kBits (i + 1)) of the words (4-bit: two
// words, 8-bit: four). In memory, as quant.pack: byte k of a group holds element 2k in its low nibble
// (4-bit) or element k (8-bit); chunk c of a lane is kChunkElems kBits / 8 bytes at its chunk offset.
// ---------------------------------------------------------------------------------------------------
template <int kBits>
struct Codes {
  static constexpr int kWords = kElemsPerThread * kBits / 32;
  uint32_t w[kWords];
};

// Bytes of one group's codes in a packet (g b / 8): group gi's codes start gi kGroupCodeBytes in.
template <int kBits, int kLanes>
constexpr int kGroupCodeBytes = kLanes * kElemsPerThread * kBits / 8;

template <int kBits, int kLanes>
__device__ __forceinline__ void store_codes(uint8_t* __restrict__ group_codes, int lane, const Codes<kBits>& c) {
  constexpr int kChunkBits = kChunkElems * kBits;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    uint8_t* dst = group_codes + chunk_offset<kLanes>(lane, k) * kBits / 8;
    if constexpr (kChunkBits < 32) {
      const uint32_t w = c.w[k * kChunkBits / 32] >> (k * kChunkBits % 32);
      store_bytes<kChunkBits / 8>(dst, &w);
    } else {
      store_bytes<kChunkBits / 8>(dst, c.w + k * kChunkBits / 32);
    }
  }
}
template <int kBits, int kLanes>
__device__ __forceinline__ Codes<kBits> load_codes(const uint8_t* __restrict__ group_codes, int lane) {
  constexpr int kChunkBits = kChunkElems * kBits;
  Codes<kBits> c;
  if constexpr (kChunkBits < 32) {
#pragma unroll
    for (int k = 0; k < Codes<kBits>::kWords; ++k) c.w[k] = 0u;
  }
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const uint8_t* src = group_codes + chunk_offset<kLanes>(lane, k) * kBits / 8;
    if constexpr (kChunkBits < 32) {
      uint32_t w;
      load_bytes<kChunkBits / 8>(src, &w);
      c.w[k * kChunkBits / 32] |= w << (k * kChunkBits % 32);
    } else {
      load_bytes<kChunkBits / 8>(src, c.w + k * kChunkBits / 32);
    }
  }
  return c;
}
template <int kBits>
__device__ __forceinline__ uint32_t code_at(const Codes<kBits>& c, int i) {
  constexpr int kPerWord = 32 / kBits;
  return (c.w[i / kPerWord] >> (kBits * (i % kPerWord))) & ((1u << kBits) - 1u);
}

// ---------------------------------------------------------------------------------------------------
// Per-group parameters (quant.compute_params).
// ---------------------------------------------------------------------------------------------------
struct GroupParams {
  float scale;  // fp16 scale as fp32 (NaN for a non-finite group)
  float zero;   // fp16 zero-point as fp32
  float inv;    // fp32 1 / scale
  uint16_t scale_bits;
  uint16_t zero_bits;
  bool finite;
};

constexpr float kFp16Max = 65504.0f;
constexpr float kFp16MinSubnormal = 5.9604644775390625e-08f;  // 2^-24
// amax / kMaxZeroPoint with kMaxZeroPoint = 1024: a power of two, so the product by 2^-10 is the
// quotient exactly (quant.kMaxZeroPoint).
constexpr float kInvMaxZeroPoint = 0.0009765625f;

// fp32 scale -> fp16 scale: clamp to [2^-24, 65504], round up (quant._group_scale).
__device__ __forceinline__ __half group_scale(float raw) {
  return __float2half_ru(fminf(fmaxf(raw, kFp16MinSubnormal), kFp16Max));
}

// NOTE: the three divisions by a constant of quant.compute_params (max|x| / (2^(b-1) - 1),
// (max - min) / (2^b - 1), max|x| / 1024) are products by the fp32 reciprocal, as the reference writes
// them (quant.reciprocal): PyTorch on a GPU computes `cuda_tensor / python_scalar` that way and on the
// CPU divides, so the reference spells out the product to agree on both (a quotient that differs in the
// last bit reached the fp16 scale in about 1e-4 of the groups, docs/kernels.md). The fp32 reciprocals
// below are float(1.0 / double(b)), which is what quant.reciprocal rounds.
// `lane`: the thread's lane in its group (the straddling case spreads its four divisions over four lanes).
template <int kBits, int kLanes>
__device__ __forceinline__ GroupParams compute_params(float mn, float mx, bool finite, Policy policy, int lane) {
  static_assert(kLanes >= 4, "the straddling case needs four lanes per group");
  constexpr float kLevels = float((1 << kBits) - 1);
  constexpr float kInvLevels = float(1.0 / double((1 << kBits) - 1));
  constexpr float kInvQmax = float(1.0 / double((1 << (kBits - 1)) - 1));
  constexpr float kSymZero = float(1 << (kBits - 1));
  if (!finite) {  // torch.where(finite, mn, 0): the parameters of an all-zero group, then scale = NaN
    mn = 0.0f;
    mx = 0.0f;
  }
  const float amax = fmaxf(fabsf(mn), fabsf(mx));
  __half sh;
  __half zh;
  if (policy == Policy::kSymmetric) {
    sh = group_scale(f_mul(amax, kInvQmax));
    zh = __float2half_rn(kSymZero);
  } else {
    const float s0 = fmaxf(f_mul(f_sub(mx, mn), kInvLevels), f_mul(amax, kInvMaxZeroPoint));
    if (policy == Policy::kNaive) {
      sh = group_scale(s0);
      zh = __float2half_rn(f_div(-mn, __half2float(sh)));
    } else {
      // Zero-aware (quant._zero_aware_params), in the reference's operation order; only the branch the
      // group takes is computed (the reference computes all and selects).
      const float z0 = f_div(-mn, s0);
      float raw, z;
      bool naive_zero = false;
      if (mn < 0.0f && mx > 0.0f) {
        // Straddling: the integer zero-point next to z0 in [1, L - 1] with the smaller widened scale,
        //   sf = max(-mn / zf, mx / (L - zf)),  sc = max(-mn / zc, mx / (L - zc)).
        // Each of the group's lanes computes one of the four quotients (lane % 4, in that order) and two
        // shuffles give every lane both maxima: one division per lane instead of four. The quotients are
        // positive (mn < 0 < mx, zf and zc in [1, L - 1]), so the max does not depend on operand order.
        const float zf = fminf(fmaxf(floorf(z0), 1.0f), kLevels - 1.0f);
        const float zc = fminf(fmaxf(ceilf(z0), 1.0f), kLevels - 1.0f);
        const bool ceil_lane = (lane & 2) != 0;
        const bool upper_lane = (lane & 1) != 0;
        const float zq = ceil_lane ? zc : zf;
        const float quotient = f_div(upper_lane ? mx : -mn, upper_lane ? f_sub(kLevels, zq) : zq);
        const unsigned mask = group_mask<kLanes>();
        const float own_pair = fmaxf(quotient, __shfl_xor_sync(mask, quotient, 1));
        const float other_pair = __shfl_xor_sync(mask, own_pair, 2);
        const float sf = ceil_lane ? other_pair : own_pair;
        const float sc = ceil_lane ? own_pair : other_pair;
        const bool use_ceil = sc < sf;
        z = use_ceil ? zc : zf;
        raw = use_ceil ? sc : sf;
      } else if (mn >= 0.0f && mn < s0) {
        // One-sided positive within one code of 0: blend towards z = 1.
        const float wp = f_sub(1.0f, f_div(mn, s0));
        z = f_add(z0, f_mul(wp, f_sub(1.0f, z0)));
        raw = f_div(mx, f_sub(kLevels, z));
      } else if (mx <= 0.0f && -mx < s0) {
        // One-sided negative within one code of 0: blend towards z = L - 1.
        const float wn = f_add(f_div(mx, s0), 1.0f);
        z = f_add(z0, f_mul(wn, f_sub(kLevels - 1.0f, z0)));
        raw = f_div(-mn, z);
      } else {
        raw = s0;
        z = 0.0f;
        naive_zero = true;
      }
      sh = group_scale(raw);
      zh = __float2half_rn(naive_zero ? f_div(-mn, __half2float(sh)) : z);
    }
  }
  GroupParams p;
  p.finite = finite;
  p.scale_bits = finite ? __half_as_ushort(sh) : kFp16NaNBits;
  p.zero_bits = __half_as_ushort(zh);
  p.scale = __half2float(__ushort_as_half(p.scale_bits));
  p.zero = __half2float(zh);
  p.inv = f_div(1.0f, p.scale);
  return p;
}

__device__ __forceinline__ GroupParams params_from_bits(uint16_t scale_bits, uint16_t zero_bits) {
  GroupParams p;
  p.scale_bits = scale_bits;
  p.zero_bits = zero_bits;
  p.scale = __half2float(__ushort_as_half(scale_bits));
  p.zero = __half2float(__ushort_as_half(zero_bits));
  p.inv = 0.0f;  // unused when decoding
  p.finite = true;
  return p;
}

// NaN-propagating min/max (PTX min.NaN / max.NaN, sm_80+): with them the group's min and max are NaN
// exactly when torch.amin / torch.amax are, and finite = isfinite(min) && isfinite(max) is the
// reference's flag (quant.compute_params) without a per-element test.
__device__ __forceinline__ float min_nan(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// min, max and the finite flag over the group's lanes.
template <int kLanes>
__device__ __forceinline__ void group_stats(const float (&v)[kElemsPerThread], float& mn, float& mx, bool& finite) {
  mn = v[0];
  mx = v[0];
#pragma unroll
  for (int i = 1; i < kElemsPerThread; ++i) {
    mn = min_nan(mn, v[i]);
    mx = max_nan(mx, v[i]);
  }
  const unsigned mask = group_mask<kLanes>();
#pragma unroll
  for (int o = kLanes / 2; o > 0; o /= 2) {
    mn = min_nan(mn, __shfl_xor_sync(mask, mn, o));
    mx = max_nan(mx, __shfl_xor_sync(mask, mx, o));
  }
  finite = is_finite(mn) && is_finite(mx);
}

// Two codes into a word being built from its top byte down (PTX cvt.pack.sat, sm_72+): returns
// (acc << 2 kBits) | (clip(hi) << kBits) | clip(lo), clip to [0, 2^b - 1]. One instruction does the clip
// and the packing of two codes, which took a min, a shift and an or for each.
template <int kBits>
__device__ __forceinline__ uint32_t pack_code_pair(int hi, int lo, uint32_t acc) {
  static_assert(kBits == 4 || kBits == 8, "4- or 8-bit codes");
  uint32_t d;
  if constexpr (kBits == 4) {
    asm("cvt.pack.sat.u4.s32.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(hi), "r"(lo), "r"(acc));
  } else {
    asm("cvt.pack.sat.u8.s32.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(hi), "r"(lo), "r"(acc));
  }
  return d;
}

// codes of v under p (quant.encode): clip(rint(v * inv + z), q_min, 2^b - 1), 0 for a non-finite group.
// cvt.rni.s32 rounds half to even and saturates to the int range (NaN to 0), and pack_code_pair clips to
// [0, 2^b - 1], which gives clip(rint(t), 0, 2^b - 1) for every t; the symmetric grid's q_min = 1 is a max
// before the packing. The policy and the finite flag are the group's, so their branches sit outside the
// per-element loop. Word k holds registers kPerWord k .. kPerWord (k + 1) - 1, the lowest in its low bits,
// so it is built from its last pair of registers down.
template <int kBits, bool kSymmetric>
__device__ __forceinline__ Codes<kBits> encode_finite(const float (&v)[kElemsPerThread], const GroupParams& p) {
  constexpr int kPerWord = 32 / kBits;
  const auto code = [&](int i) {
    const int q = __float2int_rn(f_add(f_mul(v[i], p.inv), p.zero));
    return kSymmetric ? max(q, 1) : q;
  };
  Codes<kBits> c;
#pragma unroll
  for (int k = 0; k < Codes<kBits>::kWords; ++k) {
    uint32_t w = 0u;
#pragma unroll
    for (int i = kPerWord - 2; i >= 0; i -= 2) {
      const int r = k * kPerWord + i;
      w = pack_code_pair<kBits>(code(r + 1), code(r), w);
    }
    c.w[k] = w;
  }
  return c;
}

template <int kBits>
__device__ __forceinline__ Codes<kBits> encode(const float (&v)[kElemsPerThread], const GroupParams& p,
                                               Policy policy) {
  if (!p.finite) {
    Codes<kBits> c;
#pragma unroll
    for (int k = 0; k < Codes<kBits>::kWords; ++k) c.w[k] = 0u;
    return c;
  }
  return policy == Policy::kSymmetric ? encode_finite<kBits, true>(v, p) : encode_finite<kBits, false>(v, p);
}

// fp32 values of codes (quant.decode): (q - z) * s.
template <int kBits>
__device__ __forceinline__ void decode(const Codes<kBits>& c, float scale, float zero, float (&v)[kElemsPerThread]) {
#pragma unroll
  for (int i = 0; i < kElemsPerThread; ++i) {
    v[i] = f_mul(f_sub(static_cast<float>(code_at<kBits>(c, i)), zero), scale);
  }
}

// Full group quantization of v held by the group's lanes.
template <int kBits, int kLanes>
__device__ __forceinline__ GroupParams quantize_group(const float (&v)[kElemsPerThread], Policy policy, int lane,
                                                      Codes<kBits>& codes) {
  float mn, mx;
  bool finite;
  group_stats<kLanes>(v, mn, mx, finite);
  const GroupParams p = compute_params<kBits, kLanes>(mn, mx, finite, policy, lane);
  codes = encode<kBits>(v, p, policy);
  return p;
}

// ---------------------------------------------------------------------------------------------------
// Randomized Hadamard rotation (quant.rotate / quant.unrotate), in registers.
// ---------------------------------------------------------------------------------------------------
// Unnormalised Walsh-Hadamard transform over the group, butterflies h = 1, 2, 4, ... in that order: stage
// h pairs element o with o + h and writes (a + b, a - b), a the lower element (quant._fwht). With the
// chunked layout an element offset is (chunk, lane, j) from the top bit down, so h < kChunkElems pairs
// registers i and i + h of one lane, kChunkElems <= h < kChunkElems kLanes the same register of lanes
// lane and lane ^ (h / kChunkElems), and larger h registers i and i + h / kLanes (another chunk) of one
// lane. The stages run in the reference's order, so the roundings are the same.
__device__ __forceinline__ void butterfly_in_thread(float (&v)[kElemsPerThread], int stride) {
#pragma unroll
  for (int i = 0; i < kElemsPerThread; ++i) {
    if ((i & stride) == 0) {
      const float a = v[i];
      const float b = v[i + stride];
      v[i] = f_add(a, b);
      v[i + stride] = f_sub(a, b);
    }
  }
}

// v with its sign bit flipped where `sign` (0 or 0x80000000) says: exactly v * -1 or v * 1 (a product by
// -1 is exact, and so is a - b = a + (-b)), in one logic operation.
__device__ __forceinline__ float flip_sign(float v, uint32_t sign) {
  return __uint_as_float(__float_as_uint(v) ^ sign);
}

template <int kLanes>
__device__ __forceinline__ void fwht(float (&v)[kElemsPerThread], int lane) {
#pragma unroll
  for (int h = 1; h < kChunkElems; h *= 2) butterfly_in_thread(v, h);
  const unsigned mask = group_mask<kLanes>();
#pragma unroll
  for (int m = 1; m < kLanes; m *= 2) {
    // The lower lane holds a, the upper b: lower b * 1 + a = a + b, upper b * -1 + a = a - b, as one fused
    // multiply-add: the product by +-1 is exact, so its single rounding is the addition's (signed zeros
    // and NaN included), and a + b = b + a exactly. (A sign flip and an addition before: one instruction
    // more per value and stage.)
    const float sign = (lane & m) != 0 ? -1.0f : 1.0f;
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) {
      const float other = __shfl_xor_sync(mask, v[i], m);
      v[i] = __fmaf_rn(v[i], sign, other);
    }
  }
#pragma unroll
  for (int h = kChunkElems; h < kElemsPerThread; h *= 2) butterfly_in_thread(v, h);
}

// The 16 sign bits of this lane's registers (bit i set: register i's element is multiplied by -1).
template <int kLanes>
__device__ __forceinline__ uint32_t thread_signs(const HadamardSpec& h, int lane) {
  uint32_t signs = 0u;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int first = chunk_offset<kLanes>(lane, c);
    const uint32_t bits = (h.sign_bits[first / 32] >> (first % 32)) & ((1u << kChunkElems) - 1u);
    signs |= bits << (c * kChunkElems);
  }
  return signs;
}

// rotate: (H (D v)) * norm
template <int kLanes>
__device__ __forceinline__ void rotate(float (&v)[kElemsPerThread], int lane, const HadamardSpec& h) {
  const uint32_t signs = thread_signs<kLanes>(h, lane);
#pragma unroll
  for (int i = 0; i < kElemsPerThread; ++i) v[i] = flip_sign(v[i], (signs << (31 - i)) & 0x80000000u);
  fwht<kLanes>(v, lane);
#pragma unroll
  for (int i = 0; i < kElemsPerThread; ++i) v[i] = f_mul(v[i], h.norm);
}

// unrotate: ((H v) * norm) * D
template <int kLanes>
__device__ __forceinline__ void unrotate(float (&v)[kElemsPerThread], int lane, const HadamardSpec& h) {
  fwht<kLanes>(v, lane);
  const uint32_t signs = thread_signs<kLanes>(h, lane);
#pragma unroll
  for (int i = 0; i < kElemsPerThread; ++i) {
    v[i] = flip_sign(f_mul(v[i], h.norm), (signs << (31 - i)) & 0x80000000u);
  }
}

// ---------------------------------------------------------------------------------------------------
// Compensator and rescaling.
// ---------------------------------------------------------------------------------------------------
// c = ((m1 * blend) + (m2 * (1 - blend))) * gain  (Compensator.correction)
__device__ __forceinline__ float correction(float m1, float m2, const CompensatorCoeffs& k) {
  return f_mul(f_add(f_mul(m1, k.blend), f_mul(m2, k.one_minus_blend)), k.gain);
}

// k of collective.pow2_exponent: amax 2^k in [2^14, 2^15); 0 for 0 or non-finite; clamped to [-126, 126].
__device__ __forceinline__ int pow2_exponent(const float* amax_ptr) {
  if (amax_ptr == nullptr) return 0;
  const float a = *amax_ptr;
  if (!is_finite(a) || a == 0.0f) return 0;
  int e;
  frexpf(a, &e);
  const int k = 15 - e;  // collective.kPow2Target = 15
  return k < -126 ? -126 : (k > 126 ? 126 : k);
}
// Rescaling "auto" (collective.pow2_exponent): a group max inside [kAutoLow, kAutoHigh) = [2^-6, 2^15)
// becomes 0, whose exponent is k = 0; outside it (or NaN) it is kept, and rescales as "always" does.
__device__ __forceinline__ float pow2_auto_gate(float amax) {
  return (amax >= 0x1p-6f && amax < 0x1p15f) ? 0.0f : amax;
}
// 2^k for k in [-126, 126], exactly.
__device__ __forceinline__ float exp2_int(int k) { return __int_as_float((127 + k) << 23); }

// The state of one lane as loaded: m1 or m2 of its 16 elements as bf16 words (compensator.kStateDtype).
// Held as words, half the registers of fp32, from the load that forms c to the update.
using StateWords = RawChunks<__nv_bfloat16>;

// This lane's m1 and m2 of the group at element e (padded arrays: whole groups, 16-byte aligned).
template <int kLanes>
__device__ __forceinline__ void load_state(const Contribution& s, int64_t e, int lane, StateWords& m1, StateWords& m2) {
  constexpr int kBytes = kChunkElems * 2;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    load_bytes<kBytes>(s.m1 + e + chunk_offset<kLanes>(lane, c), m1.w[c]);
    load_bytes<kBytes>(s.m2 + e + chunk_offset<kLanes>(lane, c), m2.w[c]);
  }
}

// compensator.store_state: bf16 by round-to-nearest-even; a value not finite after the rounding is +0.
__device__ __forceinline__ uint32_t state_bits(float v) {
  const uint32_t b = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  return (b & 0x7f80u) == 0x7f80u ? 0u : b;
}

// Compensator.update of this lane: m = store((m * decay) + (u * (1 - decay))) for m1 and m2, from the
// words load_state gave, written back at element e.
template <int kLanes>
__device__ __forceinline__ void update_state(const Contribution& s, int64_t e, int lane, const StateWords& m1,
                                             const StateWords& m2, const float (&u)[kElemsPerThread]) {
  constexpr int kBytes = kChunkElems * 2;
  const CompensatorCoeffs& k = s.coeffs;
  const auto step = [](uint32_t w, int half, float decay, float u, float one_minus) {
    return state_bits(f_add(f_mul(word_to_f32<__nv_bfloat16>(w, half), decay), f_mul(u, one_minus)));
  };
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    uint32_t w1[StateWords::kWords], w2[StateWords::kWords];
#pragma unroll
    for (int j = 0; j < StateWords::kWords; ++j) {
      const float u0 = u[c * kChunkElems + 2 * j], u1 = u[c * kChunkElems + 2 * j + 1];
      w1[j] = step(m1.w[c][j], 0, k.slow_decay, u0, k.one_minus_slow) |
              (step(m1.w[c][j], 1, k.slow_decay, u1, k.one_minus_slow) << 16);
      w2[j] = step(m2.w[c][j], 0, k.fast_decay, u0, k.one_minus_fast) |
              (step(m2.w[c][j], 1, k.fast_decay, u1, k.one_minus_fast) << 16);
    }
    store_bytes<kBytes>(s.m1 + e + chunk_offset<kLanes>(lane, c), w1);
    store_bytes<kBytes>(s.m2 + e + chunk_offset<kLanes>(lane, c), w2);
  }
}

// Residual "local" of one lane: u = -(e 2^-k), e = decode(codes) - v, the rounding error the codes carry
// against the values v they quantized, scaled back when rescaling by 2^k.
template <int kBits>
__device__ __forceinline__ void local_residual(const Codes<kBits>& codes, const GroupParams& p,
                                               const float (&v)[kElemsPerThread], int k, float (&u)[kElemsPerThread]) {
  decode<kBits>(codes, p.scale, p.zero, u);
  const float down = exp2_int(-k);
#pragma unroll
  for (int i = 0; i < kElemsPerThread; ++i) {
    const float err = f_sub(u[i], v[i]);
    u[i] = -(k != 0 ? f_mul(err, down) : err);
  }
}

// Group gi of segment seg of a packet table: the lanes' codes, and the parameters from the group's lane 0.
template <int kBits, int kLanes>
__device__ __forceinline__ void store_packet_group(const QuantTable& t, int seg, int64_t gi, int lane,
                                                   const Codes<kBits>& codes, const GroupParams& p) {
  store_codes<kBits, kLanes>(t.codes[seg] + gi * kGroupCodeBytes<kBits, kLanes>, lane, codes);
  if (lane == 0) {
    t.scales[seg][gi] = p.scale_bits;
    t.zeros[seg][gi] = p.zero_bits;
  }
}

// The reverse: this lane's codes of group gi of segment seg and the group's parameters p.
template <int kBits, int kLanes>
__device__ __forceinline__ Codes<kBits> load_packet_group(const QuantTable& t, int seg, int64_t gi, int lane,
                                                          GroupParams& p) {
  const Codes<kBits> codes = load_codes<kBits, kLanes>(t.codes[seg] + gi * kGroupCodeBytes<kBits, kLanes>, lane);
  p = params_from_bits(t.scales[seg][gi], t.zeros[seg][gi]);
  return codes;
}

__host__ __device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// r' of one thread: rotate(x) + c, c from the state (m1, m2), whose words are left in m1, m2 for the
// update. v holds x on entry; the state is loaded before the rotation so that its loads are in flight
// meanwhile. e: the group's first element in the padded arrays.
template <int kLanes>
__device__ __forceinline__ void compensated_input(float (&v)[kElemsPerThread], int lane, int64_t e,
                                                  const Contribution& s, StateWords& m1, StateWords& m2) {
  if (s.m1 != nullptr) load_state<kLanes>(s, e, lane, m1, m2);
  if (s.hadamard.enabled) rotate<kLanes>(v, lane, s.hadamard);
  if (s.m1 != nullptr) {
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) {
      const int c = i / kChunkElems, j = i % kChunkElems;
      const float a = word_to_f32<__nv_bfloat16>(m1.w[c][j / 2], j % 2);
      const float b = word_to_f32<__nv_bfloat16>(m2.w[c][j / 2], j % 2);
      v[i] = f_add(v[i], correction(a, b, s.coeffs));
    }
  }
}

// rs of one thread for the group at element e of the padded tensor: (rotate(x) + c) 2^k, the values the
// entry quantizes and the owner sums unquantized (contribution). numel: n of the call (zeros past it).
// In two steps: load_contribution_x issues the loads of x, contribution_from_raw does the rest.
template <typename T, int kLanes>
__device__ __forceinline__ void load_contribution_x(const Contribution& s, int64_t e, int lane, int64_t numel,
                                                    RawChunks<T>& r) {
  load_raw<T, kLanes>(static_cast<const T*>(s.x), e, lane, numel, aligned16(s.x), r);
}
// kPlain: the caller knows there is neither compensation nor rotation (no code for them is generated).
// m1, m2: the state's words of the group, for the caller's update (untouched without compensation).
template <typename T, int kLanes, bool kPlain = false>
__device__ __forceinline__ void contribution_from_raw(const Contribution& s, const RawChunks<T>& r, int64_t e,
                                                      int lane, int k, float (&v)[kElemsPerThread], StateWords& m1,
                                                      StateWords& m2) {
  unpack_raw<T>(r, v);
  if constexpr (!kPlain) compensated_input<kLanes>(v, lane, e, s, m1, m2);
  if (k != 0) {
    const float up = exp2_int(k);
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) v[i] = f_mul(v[i], up);
  }
}
template <typename T, int kLanes>
__device__ __forceinline__ void contribution(const Contribution& s, int64_t e, int lane, int64_t numel, int k,
                                             float (&v)[kElemsPerThread], StateWords& m1, StateWords& m2) {
  RawChunks<T> r;
  load_contribution_x<T, kLanes>(s, e, lane, numel, r);
  contribution_from_raw<T, kLanes>(s, r, e, lane, k, v, m1, m2);
}

// pow2 rescaling: max |r'| over this rank's padded tensor, r' = rotate(x) + c, the block's share of it
// (groups blockIdx.x * items + ..., a grid stride apart), as the bit pattern of the float: non-negative
// floats order as their unsigned patterns and |NaN| lies above +inf, so the unsigned max is torch.amax's
// max with NaN winning. Reduced over the block: the result is valid in thread 0. block_max: one word per
// warp of shared memory. Every lane of a group runs the same iterations, as the rotation's shuffles need.
template <typename T, int kLanes>
__device__ __forceinline__ unsigned block_amax_bits(const Contribution& s, const Layout& layout,
                                                    unsigned (&block_max)[kThreadsPerBlock / kWarpSize]) {
  constexpr int kItemsPerBlock = kThreadsPerBlock / kLanes;
  const int64_t num_items = int64_t(layout.world_size) * layout.groups_per_segment;
  const int lane = static_cast<int>(threadIdx.x % kLanes);
  unsigned best = 0u;
  for (int64_t item = int64_t(blockIdx.x) * kItemsPerBlock + threadIdx.x / kLanes; item < num_items;
       item += int64_t(gridDim.x) * kItemsPerBlock) {
    float v[kElemsPerThread];
    StateWords m1, m2;  // read only here
    contribution<T, kLanes>(s, item * layout.group_size, lane, layout.numel, /*k=*/0, v, m1, m2);
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) best = max(best, __float_as_uint(fabsf(v[i])));
  }
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o /= 2) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
  if (threadIdx.x % kWarpSize == 0) block_max[threadIdx.x / kWarpSize] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreadsPerBlock / kWarpSize; ++w) best = max(best, block_max[w]);
  }
  return best;
}

// min, max and the finite flag of rs = x 2^k over the group's lanes, from the packed words of 16-bit x
// (the plain entry): two elements per min/max instruction (HMNMX2 with NaN propagation, sm_80+), and the
// min and the negated max travel in one word through the shuffles. The same values as group_stats on rs:
// x 2^k rounds monotonically, so min(x 2^k) = min(x) 2^k (and likewise max; NaN and infinity carry
// through the product, and a zero's sign does not reach the codes, tests/test_kernels_gpu.py).
template <typename T>
struct PairOf;  // the two-element type of T (__hmin2_nan / __hmax2_nan are overloaded for both)
template <>
struct PairOf<__half> {
  using type = __half2;
};
template <>
struct PairOf<__nv_bfloat16> {
  using type = __nv_bfloat162;
};

template <typename T, int kLanes>
__device__ __forceinline__ void group_stats_packed(const RawChunks<T>& r, int k, float& mn, float& mx,
                                                   bool& finite) {
  static_assert(sizeof(T) == 2, "packed statistics are for 16-bit x");
  using T2 = typename PairOf<T>::type;
  const auto as_pair = [](uint32_t w) {
    T2 t;
    memcpy(&t, &w, sizeof(t));
    return t;
  };
  const auto bits_of = [](T2 t) {
    uint32_t w;
    memcpy(&w, &t, sizeof(w));
    return w;
  };
  T2 lo = as_pair(r.w[0][0]);  // element-wise min and max of the lane's pairs
  T2 hi = lo;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
#pragma unroll
    for (int j = 0; j < RawChunks<T>::kWords; ++j) {
      if (c == 0 && j == 0) continue;
      lo = __hmin2_nan(lo, as_pair(r.w[c][j]));
      hi = __hmax2_nan(hi, as_pair(r.w[c][j]));
    }
  }
  // (min, -max): the low halves of lo and hi against their high halves, the max side negated.
  const uint32_t lo_bits = bits_of(lo);
  const uint32_t hi_bits = bits_of(hi);
  T2 m = __hmin2_nan(as_pair(__byte_perm(lo_bits, hi_bits, 0x5410) ^ 0x80000000u),
                     as_pair(__byte_perm(lo_bits, hi_bits, 0x7632) ^ 0x80000000u));
  const unsigned mask = group_mask<kLanes>();
#pragma unroll
  for (int o = kLanes / 2; o > 0; o /= 2) {
    m = __hmin2_nan(m, as_pair(__shfl_xor_sync(mask, bits_of(m), o)));
  }
  mn = word_to_f32<T>(bits_of(m), 0);
  mx = -word_to_f32<T>(bits_of(m), 1);
  if (k != 0) {
    const float up = exp2_int(k);
    mn = f_mul(mn, up);
    mx = f_mul(mx, up);
  }
  finite = is_finite(mn) && is_finite(mx);
}

// The plain entry's group (rs = x 2^k, no compensation, rotation or residual) of 16-bit x from its loaded
// words r: the statistics from the packed words (group_stats_packed) and the parameters, then v = rs and
// its codes. Converting x after the parameters keeps 8 words live across the parameter chain rather than
// 16 floats: 40 registers instead of 48 for two groups per thread (push_quantize.cu).
template <typename T, int kBits, int kLanes>
__device__ __forceinline__ GroupParams quantize_plain_group(const Contribution& s, const RawChunks<T>& r, int64_t e,
                                                            int lane, int k, Policy policy,
                                                            float (&v)[kElemsPerThread], Codes<kBits>& codes) {
  float mn, mx;
  bool finite;
  group_stats_packed<T, kLanes>(r, k, mn, mx, finite);
  const GroupParams p = compute_params<kBits, kLanes>(mn, mx, finite, policy, lane);
  StateWords none;  // the plain path has no state
  contribution_from_raw<T, kLanes, true>(s, r, e, lane, k, v, none, none);
  codes = encode<kBits>(v, p, policy);
  return p;
}

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

// The host-side invariants of a Contribution (the binding checks them with clearer messages first).
inline void check_contribution(const Contribution& s) {
  ECHO_HOST_ASSERT(s.x != nullptr, "x is required");
  ECHO_HOST_ASSERT((s.m1 == nullptr) == (s.m2 == nullptr), "m1 and m2 come together");
  ECHO_HOST_ASSERT(!s.update_state || s.m1 != nullptr, "updating the state needs the state");
  ECHO_HOST_ASSERT(aligned16(s.m1) && aligned16(s.m2), "the state must be 16-byte aligned");
}

// The plain instantiation of a stage applies: neither compensation nor rotation (rs = x 2^k).
inline bool is_plain(const Contribution& s) { return s.m1 == nullptr && s.hadamard.enabled == 0; }

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
