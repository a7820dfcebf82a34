// Device-side building blocks shared by the stage kernels (internal to csrc/; not host-facing).
//
// Numerics contract (echo_ds/quant.py, echo_ds/collective.py, echo_ds/compensator.py), reproduced bit for
// bit: fp32 arithmetic, one round-to-nearest-even per operation, no fused multiply-add. Every fp32
// operation on values below goes through f_add/f_sub/f_mul/f_div (the _rn intrinsics are never
// contracted), and the builder also passes -fmad=false. Min/max use fminf/fmaxf, which ignore NaN where
// torch propagates it: each group therefore carries an explicit non-finite flag.
//
// Thread layout: every thread holds kElemsPerThread = 16 consecutive elements of one group; a group of g
// elements is held by kLanes = g / 16 consecutive lanes of one warp, aligned to kLanes. Group-wide
// reductions and the cross-lane butterflies of the Hadamard transform are shuffles restricted to the
// group's lanes (group_mask), so whole groups may leave early without stalling their warp neighbours.
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

// 16 elements per thread: a 16-bit input chunk is two 16-byte loads, a fp32 one four, and the thread's
// codes are one 8-byte (4-bit) or 16-byte (8-bit) store. Chosen by construction, not yet tuned.
constexpr int kElemsPerThread = 16;
// 256 threads per block: a common choice for streaming kernels; not tuned on the H200 yet.
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

__device__ __forceinline__ void unpack_vec(const uint4& w, float* v, float) {
  v[0] = __uint_as_float(w.x);
  v[1] = __uint_as_float(w.y);
  v[2] = __uint_as_float(w.z);
  v[3] = __uint_as_float(w.w);
}
__device__ __forceinline__ void unpack_vec(const uint4& w, float* v, __half) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[k] & 0xffffu)));
    v[2 * k + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[k] >> 16)));
  }
}
__device__ __forceinline__ void unpack_vec(const uint4& w, float* v, __nv_bfloat16) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    // bf16 -> fp32 is the upper half of the fp32 pattern.
    v[2 * k] = __uint_as_float(words[k] << 16);
    v[2 * k + 1] = __uint_as_float(words[k] & 0xffff0000u);
  }
}

__device__ __forceinline__ uint4 pack_vec(const float* v, float) {
  return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
}
__device__ __forceinline__ uint32_t half_bits(float v) { return __half_as_ushort(__float2half_rn(v)); }
__device__ __forceinline__ uint32_t bf16_bits(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
__device__ __forceinline__ uint4 pack_vec(const float* v, __half) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = half_bits(v[2 * k]) | (half_bits(v[2 * k + 1]) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ uint4 pack_vec(const float* v, __nv_bfloat16) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = bf16_bits(v[2 * k]) | (bf16_bits(v[2 * k + 1]) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// v = p[e .. e + 16) as fp32, zeros past numel (the layout's padding). vec_ok: p is 16-byte aligned.
template <typename T>
__device__ __forceinline__ void load16(const T* __restrict__ p, int64_t e, int64_t numel, bool vec_ok,
                                       float (&v)[kElemsPerThread]) {
  constexpr int kPerVec = 16 / sizeof(T);
  if (vec_ok && e + kElemsPerThread <= numel) {
    const uint4* q = reinterpret_cast<const uint4*>(p + e);
    uint4 w[kElemsPerThread / kPerVec];
#pragma unroll
    for (int k = 0; k < kElemsPerThread / kPerVec; ++k) w[k] = q[k];
#pragma unroll
    for (int k = 0; k < kElemsPerThread / kPerVec; ++k) unpack_vec(w[k], v + k * kPerVec, T());
  } else {
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) v[i] = (e + i < numel) ? to_f32(p[e + i]) : 0.0f;
  }
}

// p[e .. min(e + 16, numel)) = v in T (round to nearest even).
template <typename T>
__device__ __forceinline__ void store16(T* __restrict__ p, int64_t e, int64_t numel, bool vec_ok,
                                        const float (&v)[kElemsPerThread]) {
  constexpr int kPerVec = 16 / sizeof(T);
  if (vec_ok && e + kElemsPerThread <= numel) {
    uint4* q = reinterpret_cast<uint4*>(p + e);
#pragma unroll
    for (int k = 0; k < kElemsPerThread / kPerVec; ++k) q[k] = pack_vec(v + k * kPerVec, T());
  } else {
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) {
      if (e + i < numel) p[e + i] = from_f32<T>(v[i]);
    }
  }
}

// fp32 arrays of padded length (the compensator state, workspaces): always whole and aligned.
__device__ __forceinline__ void load16_f32(const float* __restrict__ p, float (&v)[kElemsPerThread]) {
  const float4* q = reinterpret_cast<const float4*>(p);
#pragma unroll
  for (int k = 0; k < kElemsPerThread / 4; ++k) {
    const float4 w = q[k];
    v[4 * k] = w.x;
    v[4 * k + 1] = w.y;
    v[4 * k + 2] = w.z;
    v[4 * k + 3] = w.w;
  }
}
__device__ __forceinline__ void store16_f32(float* __restrict__ p, const float (&v)[kElemsPerThread]) {
  float4* q = reinterpret_cast<float4*>(p);
#pragma unroll
  for (int k = 0; k < kElemsPerThread / 4; ++k) q[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
}

// ---------------------------------------------------------------------------------------------------
// Codes: 16 per thread. 4-bit: two 32-bit words, nibble i of word w = element 8 w + i (so byte k holds
// element 2k in its low nibble, as quant.pack). 8-bit: four words, byte i of word w = element 4 w + i.
// ---------------------------------------------------------------------------------------------------
template <int kBits>
struct Codes {
  static constexpr int kWords = kElemsPerThread * kBits / 32;
  static constexpr int kBytesPerThread = kElemsPerThread * kBits / 8;
  uint32_t w[kWords];
};

template <int kBits>
__device__ __forceinline__ void store_codes(uint8_t* __restrict__ dst, const Codes<kBits>& c) {
  if constexpr (kBits == 4) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(c.w[0], c.w[1]);
  } else {
    *reinterpret_cast<uint4*>(dst) = make_uint4(c.w[0], c.w[1], c.w[2], c.w[3]);
  }
}
template <int kBits>
__device__ __forceinline__ Codes<kBits> load_codes(const uint8_t* __restrict__ src) {
  Codes<kBits> c;
  if constexpr (kBits == 4) {
    const uint2 w = *reinterpret_cast<const uint2*>(src);
    c.w[0] = w.x;
    c.w[1] = w.y;
  } else {
    const uint4 w = *reinterpret_cast<const uint4*>(src);
    c.w[0] = w.x;
    c.w[1] = w.y;
    c.w[2] = w.z;
    c.w[3] = w.w;
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
template <int kBits>
__device__ __forceinline__ GroupParams compute_params(float mn, float mx, bool finite, Policy policy) {
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
        // Straddling: the integer zero-point next to z0 in [1, L - 1] with the smaller widened scale.
        const float zf = fminf(fmaxf(floorf(z0), 1.0f), kLevels - 1.0f);
        const float zc = fminf(fmaxf(ceilf(z0), 1.0f), kLevels - 1.0f);
        const float sf = fmaxf(f_div(-mn, zf), f_div(mx, f_sub(kLevels, zf)));
        const float sc = fmaxf(f_div(-mn, zc), f_div(mx, f_sub(kLevels, zc)));
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

// codes of v under p (quant.encode): clip(rint(v * inv + z), q_min, 2^b - 1), 0 for a non-finite group.
template <int kBits>
__device__ __forceinline__ Codes<kBits> encode(const float (&v)[kElemsPerThread], const GroupParams& p,
                                               Policy policy) {
  constexpr uint32_t kMaxCode = (1u << kBits) - 1u;
  constexpr int kPerWord = 32 / kBits;
  const uint32_t q_min = (policy == Policy::kSymmetric) ? 1u : 0u;
  Codes<kBits> c;
#pragma unroll
  for (int k = 0; k < Codes<kBits>::kWords; ++k) c.w[k] = 0u;
#pragma unroll
  for (int i = 0; i < kElemsPerThread; ++i) {
    const float t = f_add(f_mul(v[i], p.inv), p.zero);
    // cvt.rni.u32 rounds half to even and saturates (negatives to 0), so with the integer min/max it
    // equals clip(rint(t), q_min, 2^b - 1) for every finite t.
    uint32_t code = __float2uint_rn(t);
    code = max(min(code, kMaxCode), q_min);
    code = p.finite ? code : 0u;
    c.w[i / kPerWord] |= code << (kBits * (i % kPerWord));
  }
  return c;
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
__device__ __forceinline__ GroupParams quantize_group(const float (&v)[kElemsPerThread], Policy policy,
                                                      Codes<kBits>& codes) {
  float mn, mx;
  bool finite;
  group_stats<kLanes>(v, mn, mx, finite);
  const GroupParams p = compute_params<kBits>(mn, mx, finite, policy);
  codes = encode<kBits>(v, p, policy);
  return p;
}

// ---------------------------------------------------------------------------------------------------
// Randomized Hadamard rotation (quant.rotate / quant.unrotate), in registers.
// ---------------------------------------------------------------------------------------------------
// Unnormalised Walsh-Hadamard transform over the group, butterflies h = 1, 2, 4, ... in that order: stage
// h pairs element i with i + h and writes (a + b, a - b), a the lower element (quant._fwht). h < 16 pairs
// elements of one thread, h >= 16 the same register of lanes lane and lane ^ (h / 16).
template <int kLanes>
__device__ __forceinline__ void fwht(float (&v)[kElemsPerThread], int lane) {
#pragma unroll
  for (int h = 1; h < kElemsPerThread; h *= 2) {
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) {
      if ((i & h) == 0) {
        const float a = v[i];
        const float b = v[i + h];
        v[i] = f_add(a, b);
        v[i + h] = f_sub(a, b);
      }
    }
  }
  const unsigned mask = group_mask<kLanes>();
#pragma unroll
  for (int m = 1; m < kLanes; m *= 2) {
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) {
      const float other = __shfl_xor_sync(mask, v[i], m);
      v[i] = upper ? f_sub(other, v[i]) : f_add(v[i], other);
    }
  }
}

// The 16 sign bits of this thread's elements (bit i set: element lane * 16 + i is multiplied by -1).
__device__ __forceinline__ uint32_t thread_signs(const HadamardSpec& h, int lane) {
  const int first = lane * kElemsPerThread;
  return (h.sign_bits[first / 32] >> (first % 32)) & 0xffffu;
}

// rotate: (H (D v)) * norm
template <int kLanes>
__device__ __forceinline__ void rotate(float (&v)[kElemsPerThread], int lane, const HadamardSpec& h) {
  const uint32_t signs = thread_signs(h, lane);
#pragma unroll
  for (int i = 0; i < kElemsPerThread; ++i) v[i] = f_mul(v[i], ((signs >> i) & 1u) ? -1.0f : 1.0f);
  fwht<kLanes>(v, lane);
#pragma unroll
  for (int i = 0; i < kElemsPerThread; ++i) v[i] = f_mul(v[i], h.norm);
}

// unrotate: ((H v) * norm) * D
template <int kLanes>
__device__ __forceinline__ void unrotate(float (&v)[kElemsPerThread], int lane, const HadamardSpec& h) {
  fwht<kLanes>(v, lane);
  const uint32_t signs = thread_signs(h, lane);
#pragma unroll
  for (int i = 0; i < kElemsPerThread; ++i) {
    v[i] = f_mul(f_mul(v[i], h.norm), ((signs >> i) & 1u) ? -1.0f : 1.0f);
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
// 2^k for k in [-126, 126], exactly.
__device__ __forceinline__ float exp2_int(int k) { return __int_as_float((127 + k) << 23); }

// r' of one thread: rotate(x) + c, with c from the state (m1, m2) or precomputed (correction).
// v holds x on entry; the state is loaded before the rotation so that its loads are in flight meanwhile.
template <int kLanes>
__device__ __forceinline__ void compensated_input(float (&v)[kElemsPerThread], int lane, int64_t e,
                                                  const HadamardSpec& h, const float* m1, const float* m2,
                                                  const float* corr, const CompensatorCoeffs& coeffs) {
  float c[kElemsPerThread];
  if (m1 != nullptr) {
    float b[kElemsPerThread];
    load16_f32(m1 + e, c);
    load16_f32(m2 + e, b);
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) c[i] = correction(c[i], b[i], coeffs);
  } else if (corr != nullptr) {
    load16_f32(corr + e, c);
  }
  if (h.enabled) rotate<kLanes>(v, lane, h);
  if (m1 != nullptr || corr != nullptr) {
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) v[i] = f_add(v[i], c[i]);
  }
}

__host__ __device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline unsigned num_blocks(int64_t num_threads) {
  const int64_t blocks = (num_threads + kThreadsPerBlock - 1) / kThreadsPerBlock;
  ECHO_HOST_ASSERT(blocks < (int64_t(1) << 31), "launch too large");
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
}

}  // namespace detail
}  // namespace echo
