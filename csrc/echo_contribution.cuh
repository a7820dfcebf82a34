// A rank's contribution rs = (rotate(x) + c) 2^k (algorithm.py), formed on the device from x, the
// compensator's state and the rotation (internal to csrc/), and the uncompensated entry's group.
#pragma once

#include "echo_compensator.cuh"
#include "echo_device.cuh"
#include "echo_quantizer.cuh"
#include "echo_rotation.cuh"

namespace echo {
namespace detail {

// r' of one thread: rotate(x) + c, c from the state (m1, m2), whose words are left in m for the update.
// v holds x on entry; the state is loaded before the rotation so that its loads are in flight meanwhile.
// e: the group's first element in the padded arrays.
template <int kLanes>
__device__ __forceinline__ void compensated_input(float (&v)[kElemsPerThread], int lane, int64_t e,
                                                  const Contribution& s, StateWords& m) {
  if (s.m1 != nullptr) load_state<kLanes>(s, e, lane, m);
  if (s.hadamard.enabled) rotate<kLanes>(v, lane, s.hadamard);
  if (s.m1 != nullptr) {
    const float step = state_step<kLanes>(s, e);
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) {
      float a, b;
      state_values(s.state, m, step, i, a, b);
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
// kUncompensated: the caller knows there is neither compensation nor rotation (no code for them is
// generated).
// m: the state's words of the group, for the caller's update (untouched without compensation).
template <typename T, int kLanes, bool kUncompensated = false>
__device__ __forceinline__ void contribution_from_raw(const Contribution& s, const RawChunks<T>& r, int64_t e,
                                                      int lane, int k, float (&v)[kElemsPerThread], StateWords& m) {
  unpack_raw<T>(r, v);
  if constexpr (!kUncompensated) compensated_input<kLanes>(v, lane, e, s, m);
  if (k != 0) {
    const float up = exp2_int(k);
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) v[i] = f_mul(v[i], up);
  }
}
template <typename T, int kLanes>
__device__ __forceinline__ void contribution(const Contribution& s, int64_t e, int lane, int64_t numel, int k,
                                             float (&v)[kElemsPerThread], StateWords& m) {
  RawChunks<T> r;
  load_contribution_x<T, kLanes>(s, e, lane, numel, r);
  contribution_from_raw<T, kLanes>(s, r, e, lane, k, v, m);
}

// The uncompensated entry's group (rs = x 2^k, no compensation, rotation or residual) of 16-bit x from its
// loaded words r: the statistics from the packed words (group_stats_packed) and the parameters, then v = rs
// and its codes. Converting x after the parameters keeps 8 words live across the parameter chain rather
// than 16 floats: 40 registers instead of 48 for two groups per thread (push_quantize.cu).
template <typename T, int kBits, int kLanes>
__device__ __forceinline__ GroupParams quantize_uncompensated_group(const Contribution& s, const RawChunks<T>& r,
                                                                    int64_t e, int lane, int k, Quantizer quantizer,
                                                                    float (&v)[kElemsPerThread],
                                                                    Codes<kBits>& codes) {
  float mn, mx;
  bool finite;
  group_stats_packed<T, kLanes>(r, k, mn, mx, finite);
  const GroupParams p = compute_params<kBits, kLanes>(mn, mx, finite, quantizer, lane);
  StateWords none;  // the uncompensated path has no state
  contribution_from_raw<T, kLanes, true>(s, r, e, lane, k, v, none);
  codes = encode<kBits>(v, p, quantizer);
  return p;
}

// The host-side invariants of a Contribution (the binding checks them with clearer messages first).
inline void check_contribution(const Contribution& s) {
  ECHO_HOST_ASSERT(s.x != nullptr, "x is required");
  ECHO_HOST_ASSERT(!s.update_state || s.m1 != nullptr, "updating the state needs the state");
  ECHO_HOST_ASSERT(aligned16(s.m1) && aligned16(s.m2), "the state must be 16-byte aligned");
  if (s.m1 == nullptr) {
    ECHO_HOST_ASSERT(s.m2 == nullptr && s.exponent == nullptr, "m2 and the exponents come with m1");
    return;
  }
  switch (s.state) {
    case StateFormat::kBf16: ECHO_HOST_ASSERT(s.m2 != nullptr && s.exponent == nullptr, "bf16: m1 and m2"); break;
    case StateFormat::kInt8: ECHO_HOST_ASSERT(s.m2 != nullptr && s.exponent != nullptr, "int8: m1, m2, exponents"); break;
    case StateFormat::kInt4: ECHO_HOST_ASSERT(s.m2 == nullptr && s.exponent != nullptr, "int4: bytes, exponents"); break;
    default: ECHO_HOST_ASSERT(false, "unknown state format");
  }
}

// The uncompensated instantiation of a stage applies: neither compensation nor rotation (rs = x 2^k).
inline bool is_uncompensated(const Contribution& s) { return s.m1 == nullptr && s.hadamard.enabled == 0; }

}  // namespace detail
}  // namespace echo
