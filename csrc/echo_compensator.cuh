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

}  // namespace detail
}  // namespace echo
