// The group quantizer on the device (quant.py), internal to csrc/: a group's statistics, its parameters
// (quant.compute_params), the codes (quant.encode / quant.decode, packed as quant.pack) and their place in a
// packet table (QuantTable: codes, and scales and zero-points or packed words, per segment).
#pragma once

#include <cstring>

#include "echo_device.cuh"

namespace echo {
namespace detail {

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
constexpr float kFp16MinNormal = 6.103515625e-05f;             // 2^-14 (algorithm.kFp16MinNormal)
// fp16 NaN as torch writes it (torch.full(..., nan, dtype=float16) converts on the host): 0x7E00.
constexpr uint16_t kFp16NaNBits = 0x7E00;
// amax / kMaxZeroPoint with kMaxZeroPoint = 1024: a power of two, so the product by 2^-10 is the
// quotient exactly (quant.kMaxZeroPoint).
constexpr float kInvMaxZeroPoint = 0.0009765625f;

// fp32 scale -> fp16 scale: clamp to [2^-24, 65504], round up (quant._group_scale).
__device__ __forceinline__ __half group_scale(float raw) {
  return __float2half_ru(fminf(fmaxf(raw, kFp16MinSubnormal), kFp16Max));
}

// fp32 scale -> the packed format's scale (quant.packed_scale): fp16 without its kBits - 1 low mantissa
// bits; clamp to [2^(kBits - 25), the largest such value], round up to fp16, then round the pattern up to
// a multiple of 2^(kBits - 1) (the carry into the exponent is exact).
template <int kBits>
__device__ __forceinline__ __half packed_scale(float raw) {
  constexpr int kDrop = kBits - 1;
  constexpr uint32_t kMask = (1u << kDrop) - 1u;
  constexpr float kMin = kFp16MinSubnormal * float(1 << kDrop);
  const float max_scale = __half2float(__ushort_as_half(static_cast<uint16_t>(0x7C00u - (1u << kDrop))));
  const uint32_t h = __half_as_ushort(__float2half_ru(fminf(fmaxf(raw, kMin), max_scale)));
  return __ushort_as_half(static_cast<uint16_t>((h + kMask) & ~kMask));
}

// The straddling group's integer zero-point and raw scale (quant._straddle_params): of zf = floor(z0) and
// zc = ceil(z0), clamped to [1, L - 1], the one with the smaller s(z) = max(-mn / z, mx / (L - z)).
// Each of the group's lanes computes one of the four quotients (lane % 4, in that order) and two shuffles
// give every lane both maxima: one division per lane instead of four. The quotients are positive
// (mn < 0 < mx, zf and zc in [1, L - 1]), so the max does not depend on operand order. Called by all the
// group's lanes together (mn, mx are the group's).
template <int kBits, int kLanes>
__device__ __forceinline__ void straddle_params(float mn, float mx, float z0, int lane, float& z, float& raw) {
  constexpr float kLevels = float((1 << kBits) - 1);
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
}

// NOTE: the three divisions by a constant of quant.compute_params (max|x| / (2^(b-1) - 1),
// (max - min) / (2^b - 1), max|x| / 1024) are products by the fp32 reciprocal, as the reference writes
// them (quant.reciprocal): PyTorch on a GPU computes `cuda_tensor / python_scalar` that way and on the
// CPU divides, so the reference spells out the product to agree on both (a quotient that differs in the
// last bit reached the fp16 scale in about 1e-4 of the groups, docs/kernels.md). The fp32 reciprocals
// below are float(1.0 / double(b)), which is what quant.reciprocal rounds.
// `lane`: the thread's lane in its group (the straddling case spreads its four divisions over four lanes).
template <int kBits, int kLanes>
__device__ __forceinline__ GroupParams compute_params(float mn, float mx, bool finite, Quantizer quantizer, int lane) {
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
  if (quantizer == Quantizer::kSymmetric) {
    sh = group_scale(f_mul(amax, kInvQmax));
    zh = __float2half_rn(kSymZero);
  } else if (quantizer == Quantizer::kZeroAwareInt) {
    // quant._integer_zero_params: zero-aware's integer choice where the group straddles 0, else 0 at the
    // grid's end on the group's side; the scale rounds up to the packed format.
    float raw, z;
    if (mn < 0.0f && mx > 0.0f) {
      const float s0 = fmaxf(f_mul(f_sub(mx, mn), kInvLevels), f_mul(amax, kInvMaxZeroPoint));
      straddle_params<kBits, kLanes>(mn, mx, f_div(-mn, s0), lane, z, raw);
    } else if (mn >= 0.0f) {
      z = 0.0f;
      raw = f_mul(mx, kInvLevels);
    } else {
      z = kLevels;
      raw = f_mul(-mn, kInvLevels);
    }
    sh = packed_scale<kBits>(raw);
    zh = __float2half_rn(z);
  } else {
    const float s0 = fmaxf(f_mul(f_sub(mx, mn), kInvLevels), f_mul(amax, kInvMaxZeroPoint));
    if (quantizer == Quantizer::kNaive) {
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
        straddle_params<kBits, kLanes>(mn, mx, z0, lane, z, raw);
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

// The packed word of "zero_aware_int" (quant.pack_params / unpack_params): the scale's fp16 pattern
// without the sign and its kBits - 1 dropped mantissa bits, above the integer zero-point's kBits bits.
// A NaN scale (0x7E00) keeps a non-zero mantissa, so it unpacks to NaN.
template <int kBits>
__device__ __forceinline__ uint16_t pack_params(const GroupParams& p) {
  return static_cast<uint16_t>((((p.scale_bits & 0x7FFFu) >> (kBits - 1)) << kBits) | static_cast<uint32_t>(p.zero));
}
template <int kBits>
__device__ __forceinline__ GroupParams params_from_word(uint16_t word) {
  const uint32_t w = word;
  return params_from_bits(static_cast<uint16_t>((w >> kBits) << (kBits - 1)),
                          __half_as_ushort(__uint2half_rn(w & ((1u << kBits) - 1u))));
}

// A group's parameter words in a packet table: the fp16 scale and zero-point, or the packed word (its
// zero-point word reads 0 and is ignored) ...
__device__ __forceinline__ void load_param_bits(const QuantTable& t, int seg, int64_t gi, uint16_t& scale_bits,
                                                uint16_t& zero_bits) {
  scale_bits = t.scales[seg][gi];
  zero_bits = t.packed ? uint16_t(0) : t.zeros[seg][gi];
}
// ... and the parameters they hold.
template <int kBits>
__device__ __forceinline__ GroupParams table_params(const QuantTable& t, uint16_t scale_bits, uint16_t zero_bits) {
  return t.packed ? params_from_word<kBits>(scale_bits) : params_from_bits(scale_bits, zero_bits);
}

// ---------------------------------------------------------------------------------------------------
// Group statistics: min, max and the finite flag.
// ---------------------------------------------------------------------------------------------------
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

// min, max and the finite flag of rs = x 2^k over the group's lanes, from the packed words of 16-bit x
// (the uncompensated entry): two elements per min/max instruction (HMNMX2 with NaN propagation, sm_80+),
// and the min and the negated max travel in one word through the shuffles. The same values as group_stats
// on rs: x 2^k rounds monotonically, so min(x 2^k) = min(x) 2^k (and likewise max; NaN and infinity carry
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

// ---------------------------------------------------------------------------------------------------
// Encoding and decoding (quant.encode / quant.decode).
// ---------------------------------------------------------------------------------------------------
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
// before the packing. The quantizer and the finite flag are the group's, so their branches sit outside the
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
                                               Quantizer quantizer) {
  if (!p.finite) {
    Codes<kBits> c;
#pragma unroll
    for (int k = 0; k < Codes<kBits>::kWords; ++k) c.w[k] = 0u;
    return c;
  }
  return quantizer == Quantizer::kSymmetric ? encode_finite<kBits, true>(v, p) : encode_finite<kBits, false>(v, p);
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
__device__ __forceinline__ GroupParams quantize_group(const float (&v)[kElemsPerThread], Quantizer quantizer, int lane,
                                                      Codes<kBits>& codes) {
  float mn, mx;
  bool finite;
  group_stats<kLanes>(v, mn, mx, finite);
  const GroupParams p = compute_params<kBits, kLanes>(mn, mx, finite, quantizer, lane);
  codes = encode<kBits>(v, p, quantizer);
  return p;
}

// ---------------------------------------------------------------------------------------------------
// Packets: one group's codes and parameters in a packet table (QuantTable).
// ---------------------------------------------------------------------------------------------------
// Group gi of segment seg of a packet table: the lanes' codes, and the parameters from the group's lane 0.
template <int kBits, int kLanes>
__device__ __forceinline__ void store_packet_group(const QuantTable& t, int seg, int64_t gi, int lane,
                                                   const Codes<kBits>& codes, const GroupParams& p) {
  store_codes<kBits, kLanes>(t.codes[seg] + gi * kGroupCodeBytes<kBits, kLanes>, lane, codes);
  if (lane == 0) {
    if (t.packed) {
      t.scales[seg][gi] = pack_params<kBits>(p);
    } else {
      t.scales[seg][gi] = p.scale_bits;
      t.zeros[seg][gi] = p.zero_bits;
    }
  }
}

// The reverse: this lane's codes of group gi of segment seg and the group's parameters p.
template <int kBits, int kLanes>
__device__ __forceinline__ Codes<kBits> load_packet_group(const QuantTable& t, int seg, int64_t gi, int lane,
                                                          GroupParams& p) {
  const Codes<kBits> codes = load_codes<kBits, kLanes>(t.codes[seg] + gi * kGroupCodeBytes<kBits, kLanes>, lane);
  uint16_t scale_bits, zero_bits;
  load_param_bits(t, seg, gi, scale_bits, zero_bits);
  p = table_params<kBits>(t, scale_bits, zero_bits);
  return codes;
}

}  // namespace detail
}  // namespace echo
