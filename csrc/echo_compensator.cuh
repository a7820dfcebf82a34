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

// compensator.kMinStateExp / kMaxStateExp: every 2^E and 2^-E of the integer formats is a normal fp32, so
// exp2_int builds them and the products by them are exact.
constexpr int kMinStateExp = -126;
constexpr int kMaxStateExp = 126;

// The state of one lane as loaded, in its stored format (Contribution::state), held as words from the load
// that forms c to the update. Per chunk c: kBf16: m1[c], m2[c] are the chunk's bf16 words; kInt8: the
// first kCodeWords words of m1[c] and m2[c] are its int8 codes; kInt4: the first kCodeWords words of m1[c]
// are its bytes (m1's code in the low nibble, m2's in the high). The formats share the registers: a caller
// holds one StateWords whatever the format. The integer formats' exponent is not held: it is read where it
// is used (state_step), one byte per group, so that the kernels at their register cap do not spill.
struct StateWords {
  static constexpr int kWords = kChunkElems / 2;      // a chunk of bf16 values
  static constexpr int kCodeWords = kChunkElems / 4;  // a chunk of one-byte codes
  uint32_t m1[kChunks][kWords];
  uint32_t m2[kChunks][kWords];
};

// The group of element e (padded arrays: whole groups of kLanes * kElemsPerThread elements).
template <int kLanes>
__device__ __forceinline__ int64_t state_group(int64_t e) {
  return e / (kLanes * kElemsPerThread);
}

// This lane's m1 and m2 of the group at element e.
template <int kLanes>
__device__ __forceinline__ void load_state(const Contribution& s, int64_t e, int lane, StateWords& m) {
  if (s.state == StateFormat::kBf16) {
    constexpr int kBytes = kChunkElems * 2;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      load_bytes<kBytes>(static_cast<const uint16_t*>(s.m1) + e + chunk_offset<kLanes>(lane, c), m.m1[c]);
      load_bytes<kBytes>(static_cast<const uint16_t*>(s.m2) + e + chunk_offset<kLanes>(lane, c), m.m2[c]);
    }
    return;
  }
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int64_t at = e + chunk_offset<kLanes>(lane, c);
    load_bytes<kChunkElems>(static_cast<const uint8_t*>(s.m1) + at, m.m1[c]);
    if (s.state == StateFormat::kInt8) load_bytes<kChunkElems>(static_cast<const uint8_t*>(s.m2) + at, m.m2[c]);
  }
}

// The stored values' step 2^E of the group at element e (integer formats; 1 for bf16, which has none).
template <int kLanes>
__device__ __forceinline__ float state_step(const Contribution& s, int64_t e) {
  return s.state == StateFormat::kBf16 ? 1.0f : exp2_int(s.exponent[state_group<kLanes>(e)]);
}

// (m1, m2) of register i = c * kChunkElems + j as the arithmetic reads them, fp32 and exact
// (compensator.Compensator.values: bf16 widened, or code * step, step = 2^E from state_step).
__device__ __forceinline__ void state_values(StateFormat format, const StateWords& m, float step, int i, float& m1,
                                             float& m2) {
  const int c = i / kChunkElems, j = i % kChunkElems;
  if (format == StateFormat::kBf16) {
    m1 = word_to_f32<__nv_bfloat16>(m.m1[c][j / 2], j % 2);
    m2 = word_to_f32<__nv_bfloat16>(m.m2[c][j / 2], j % 2);
    return;
  }
  const uint32_t b = m.m1[c][j / 4] >> (8 * (j % 4));  // this element's byte in the low 8 bits
  int q1, q2;
  if (format == StateFormat::kInt4) {
    q1 = int(b << 28) >> 28;  // sign-extended nibbles (compensator.unpack_int4)
    q2 = int(b << 24) >> 28;
  } else {
    q1 = int(b << 24) >> 24;
    q2 = int((m.m2[c][j / 4] >> (8 * (j % 4))) << 24) >> 24;
  }
  m1 = f_mul(float(q1), step);
  m2 = f_mul(float(q2), step);
}

// compensator.store_state: bf16 by round-to-nearest-even; a value not finite after the rounding is +0.
__device__ __forceinline__ uint32_t state_bits(float v) {
  const uint32_t b = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  return (b & 0x7f80u) == 0x7f80u ? 0u : b;
}

// The updated averages of register i before they are stored: n = (m * decay) + (u * (1 - decay)), fp32.
__device__ __forceinline__ void updated_values(StateFormat format, const StateWords& m, float step, int i,
                                               const CompensatorCoeffs& k, float u, float& n1, float& n2) {
  float m1, m2;
  state_values(format, m, step, i, m1, m2);
  n1 = f_add(f_mul(m1, k.slow_decay), f_mul(u, k.one_minus_slow));
  n2 = f_add(f_mul(m2, k.fast_decay), f_mul(u, k.one_minus_fast));
}

// compensator.encode_state's code of one value: clamp(round_half_even(n 2^-E), -qmax, qmax), as kBits bits.
template <int kBits>
__device__ __forceinline__ uint32_t state_code(float n, float down) {
  constexpr int kMax = (1 << (kBits - 1)) - 1;
  const int q = min(max(__float2int_rn(f_mul(n, down)), -kMax), kMax);
  return uint32_t(q) & ((1u << kBits) - 1u);
}

// The integer formats' update (Compensator.update): the averages n of every register, non-finite -> +0, the
// group's largest |n1|, |n2| over its kLanes lanes, E from its exponent bits, the codes written back at
// element e; lane 0 of the group writes E. The averages are formed twice, once for the maximum and once for
// the codes (the same operations give the same bits), so that 32 of them are never live at once.
template <int kBits, int kLanes>
__device__ __forceinline__ void update_integer_state(const Contribution& s, int64_t e, int lane, const StateWords& m,
                                                     const float (&u)[kElemsPerThread]) {
  constexpr StateFormat kFormat = kBits == 4 ? StateFormat::kInt4 : StateFormat::kInt8;
  const auto finite = [](float v) { return is_finite(v) ? v : 0.0f; };
  // Read by every lane before the group's shuffles below, so before lane 0 writes the new E.
  const float step = state_step<kLanes>(s, e);
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < kElemsPerThread; ++i) {
    float n1, n2;
    updated_values(kFormat, m, step, i, s.coeffs, u[i], n1, n2);
    a = fmaxf(a, fmaxf(fabsf(finite(n1)), fabsf(finite(n2))));
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
    uint32_t w1[StateWords::kCodeWords] = {}, w2[StateWords::kCodeWords] = {};
#pragma unroll
    for (int j = 0; j < kChunkElems; ++j) {
      float n1, n2;
      updated_values(kFormat, m, step, c * kChunkElems + j, s.coeffs, u[c * kChunkElems + j], n1, n2);
      const uint32_t q1 = state_code<kBits>(finite(n1), down), q2 = state_code<kBits>(finite(n2), down);
      if constexpr (kBits == 4) {
        w1[j / 4] |= (q1 | (q2 << 4)) << (8 * (j % 4));
      } else {
        w1[j / 4] |= q1 << (8 * (j % 4));
        w2[j / 4] |= q2 << (8 * (j % 4));
      }
    }
    const int64_t at = e + chunk_offset<kLanes>(lane, c);
    store_bytes<kChunkElems>(static_cast<uint8_t*>(s.m1) + at, w1);
    if constexpr (kBits == 8) store_bytes<kChunkElems>(static_cast<uint8_t*>(s.m2) + at, w2);
  }
  if (lane == 0) s.exponent[state_group<kLanes>(e)] = static_cast<int8_t>(E);
}

// The bf16 state's update (Compensator.update, store_state per value).
template <int kLanes>
__device__ __forceinline__ void update_bf16_state(const Contribution& s, int64_t e, int lane, const StateWords& m,
                                                  const float (&u)[kElemsPerThread]) {
  constexpr int kBytes = kChunkElems * 2;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    uint32_t w1[StateWords::kWords], w2[StateWords::kWords];
#pragma unroll
    for (int j = 0; j < StateWords::kWords; ++j) {
      float n[2][2];  // [element of the word][m1, m2]
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = c * kChunkElems + 2 * j + h;
        updated_values(StateFormat::kBf16, m, 1.0f, i, s.coeffs, u[i], n[h][0], n[h][1]);
      }
      w1[j] = state_bits(n[0][0]) | (state_bits(n[1][0]) << 16);
      w2[j] = state_bits(n[0][1]) | (state_bits(n[1][1]) << 16);
    }
    store_bytes<kBytes>(static_cast<uint16_t*>(s.m1) + e + chunk_offset<kLanes>(lane, c), w1);
    store_bytes<kBytes>(static_cast<uint16_t*>(s.m2) + e + chunk_offset<kLanes>(lane, c), w2);
  }
}

// Compensator.update of this lane: m = store((m * decay) + (u * (1 - decay))) for m1 and m2, from the
// words load_state gave, written back at element e, in the state's format. Every lane of the group calls
// it together (the integer formats reduce over the group's lanes).
template <int kLanes>
__device__ __forceinline__ void update_state(const Contribution& s, int64_t e, int lane, const StateWords& m,
                                             const float (&u)[kElemsPerThread]) {
  if (s.state == StateFormat::kInt4) return update_integer_state<4, kLanes>(s, e, lane, m, u);
  if (s.state == StateFormat::kInt8) return update_integer_state<8, kLanes>(s, e, lane, m, u);
  update_bf16_state<kLanes>(s, e, lane, m, u);
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

}  // namespace detail
}  // namespace echo
