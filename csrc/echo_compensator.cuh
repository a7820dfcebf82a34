// The compensator on the device (echo_ds/compensator.py), internal to csrc/: the correction c from the
// state (m1, m2), the state's words as loaded, and its update from the residual u.
#pragma once

#include "echo_device.cuh"
#include "echo_quantizer.cuh"

namespace echo {
namespace detail {

// c = ((m1 * blend) + (m2 * (1 - blend))) * gain  (Compensator.correction)
__device__ __forceinline__ float correction(float m1, float m2, const CompensatorCoeffs& k) {
  return f_mul(f_add(f_mul(m1, k.blend), f_mul(m2, k.one_minus_blend)), k.gain);
}

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

// ---------------------------------------------------------------------------------------------------
// The narrow states, state_dtype "int8" / "int4" (compensator.encode_state, decode_state, pack_int4).
// Not wired into the stages yet: a Contribution carries the bf16 state only (see docs/kernels.md,
// "Compensator state dtype", for what the stages and the binding still need).
// ---------------------------------------------------------------------------------------------------

// compensator.kMinStateExp / kMaxStateExp: every 2^E and 2^-E is a normal fp32, so exp2_int builds them and
// the products by them are exact.
constexpr int kMinStateExp = -126;
constexpr int kMaxStateExp = 126;

// Where a narrow state lives. kBits = 4: q[e] holds m1's code of element e in its low nibble and m2's in
// its high nibble (pack_int4); kBits = 8: q[e] is m1's code and q[padded + e] m2's. exponent[e / g]: the
// group's E (int8). Both arrays are over the padded length, 16-byte aligned.
struct NarrowState {
  uint8_t* q;
  int8_t* exponent;
  int64_t padded;
};

// This lane's codes of one group as loaded: per chunk, kBits = 4: kChunkElems bytes (m1 | m2 << 4);
// kBits = 8: kChunkElems bytes of m1, then kChunkElems bytes of m2. exponent: the group's E.
template <int kBits>
struct NarrowWords {
  static_assert(kBits == 4 || kBits == 8, "narrow states of 4 or 8 bits");
  static constexpr int kWordsPerArray = kChunkElems / 4;
  static constexpr int kWords = kWordsPerArray * (kBits == 8 ? 2 : 1);
  uint32_t w[kChunks][kWords];
  int exponent;
};

template <int kBits, int kLanes>
__device__ __forceinline__ void load_narrow_state(const NarrowState& s, int64_t e, int group_size, int lane,
                                                  NarrowWords<kBits>& m) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int64_t at = e + chunk_offset<kLanes>(lane, c);
    load_bytes<kChunkElems>(s.q + at, m.w[c]);
    if constexpr (kBits == 8) load_bytes<kChunkElems>(s.q + s.padded + at, m.w[c] + NarrowWords<kBits>::kWordsPerArray);
  }
  m.exponent = s.exponent[e / group_size];
}

// The codes (q1, q2) of register i = c * kChunkElems + j, sign-extended.
template <int kBits>
__device__ __forceinline__ void narrow_codes(const NarrowWords<kBits>& m, int c, int j, int& q1, int& q2) {
  const uint32_t w1 = m.w[c][j / 4] >> (8 * (j % 4));
  if constexpr (kBits == 4) {
    q1 = int(w1 << 28) >> 28;
    q2 = int(w1 << 24) >> 28;
  } else {
    q1 = int(w1 << 24) >> 24;
    q2 = int((m.w[c][NarrowWords<kBits>::kWordsPerArray + j / 4] >> (8 * (j % 4))) << 24) >> 24;
  }
}

// compensator.decode_state of register i: (m1, m2) = q 2^E, exact.
template <int kBits>
__device__ __forceinline__ void narrow_values(const NarrowWords<kBits>& m, int i, float& m1, float& m2) {
  int q1, q2;
  narrow_codes<kBits>(m, i / kChunkElems, i % kChunkElems, q1, q2);
  const float step = exp2_int(m.exponent);
  m1 = f_mul(float(q1), step);
  m2 = f_mul(float(q2), step);
}

// compensator.encode_state's code of one value: clamp(round_half_even(n 2^-E), -qmax, qmax).
template <int kBits>
__device__ __forceinline__ uint32_t narrow_code(float n, float down) {
  constexpr int kMax = (1 << (kBits - 1)) - 1;
  const int q = min(max(__float2int_rn(f_mul(n, down)), -kMax), kMax);
  return uint32_t(q) & ((1u << kBits) - 1u);
}

// Compensator.update of this lane under a narrow state: n = (m * decay) + (u * (1 - decay)) from the
// decoded words, non-finite -> +0, the group's largest |n1|, |n2| over its kLanes lanes, E from its
// exponent bits, the codes, written back at element e; lane 0 of the group writes E.
template <int kBits, int kLanes>
__device__ __forceinline__ void update_narrow_state(const NarrowState& s, int64_t e, int group_size, int lane,
                                                    const NarrowWords<kBits>& m, const CompensatorCoeffs& k,
                                                    const float (&u)[kElemsPerThread]) {
  float n1[kElemsPerThread], n2[kElemsPerThread];
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < kElemsPerThread; ++i) {
    float m1, m2;
    narrow_values<kBits>(m, i, m1, m2);
    const float v1 = f_add(f_mul(m1, k.slow_decay), f_mul(u[i], k.one_minus_slow));
    const float v2 = f_add(f_mul(m2, k.fast_decay), f_mul(u[i], k.one_minus_fast));
    n1[i] = is_finite(v1) ? v1 : 0.0f;
    n2[i] = is_finite(v2) ? v2 : 0.0f;
    a = fmaxf(a, fmaxf(fabsf(n1[i]), fabsf(n2[i])));
  }
  const unsigned mask = group_mask<kLanes>();
#pragma unroll
  for (int o = 1; o < kLanes; o <<= 1) a = fmaxf(a, __shfl_xor_sync(mask, a, o));
  // a = f 2^ea, f in [0.5, 1); zero and subnormals give -126 (encode_state reads the same bits).
  const int ea = int((__float_as_uint(a) >> 23) & 0xffu) - 126;
  const int E = min(max(ea - (kBits - 1), kMinStateExp), kMaxStateExp);
  const float down = exp2_int(-E);
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    uint32_t w[NarrowWords<kBits>::kWords];
#pragma unroll
    for (int t = 0; t < NarrowWords<kBits>::kWords; ++t) w[t] = 0u;
#pragma unroll
    for (int j = 0; j < kChunkElems; ++j) {
      const int i = c * kChunkElems + j;
      const uint32_t q1 = narrow_code<kBits>(n1[i], down), q2 = narrow_code<kBits>(n2[i], down);
      if constexpr (kBits == 4) {
        w[j / 4] |= (q1 | (q2 << 4)) << (8 * (j % 4));
      } else {
        w[j / 4] |= q1 << (8 * (j % 4));
        w[NarrowWords<kBits>::kWordsPerArray + j / 4] |= q2 << (8 * (j % 4));
      }
    }
    const int64_t at = e + chunk_offset<kLanes>(lane, c);
    store_bytes<kChunkElems>(s.q + at, w);
    if constexpr (kBits == 8) store_bytes<kChunkElems>(s.q + s.padded + at, w + NarrowWords<kBits>::kWordsPerArray);
  }
  if (lane == 0) s.exponent[e / group_size] = static_cast<int8_t>(E);
}

}  // namespace detail
}  // namespace echo
