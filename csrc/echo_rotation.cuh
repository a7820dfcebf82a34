// The randomized Hadamard rotation (quant.rotate / quant.unrotate) of a group held by its lanes, in
// registers (internal to csrc/).
#pragma once

#include "echo_device.cuh"

namespace echo {
namespace detail {

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
    // and NaN included), and a + b = b + a exactly; a sign flip and an addition would take one instruction
    // more per value and stage.
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

}  // namespace detail
}  // namespace echo
