// The host-facing API of the Echo kernels: raw pointers, sizes and a stream in; no torch types.
//
// One call of the Echo all-reduce on rank i of P, with n elements and group size g (echo_ds/algorithm.py):
//
//   padded = ceil(n / (P g)) * P g       (at least one chunk; zeros appended)
//   segment j = padded elements [j S, (j + 1) S), S = G g, G = groups_per_segment, owned by rank j
//
//   1. launch_push_quantize     x (+ the state m1, m2) -> r' = rotate(x) + c, rs = r' 2^k; the non-owned
//                               segments j != i as codes + fp16 (scale, zero) into out[j]; residual "local":
//                               m1, m2 of those segments updated in place from the rounding error.
//   2. launch_owner_reduce      ordered fp32 sum over ranks 0..P-1 (own copy unquantized: rs of segment i,
//                               formed again from the same inputs; P-1 decoded copies), requantized once
//                               into every non-null out[d]; residual "local": m1, m2 of segment i updated.
//   3. launch_dequantize        codes of every segment -> s_hat 2^-k -> unrotate -> output dtype; residual
//                               "output": m1, m2 of the segments it decodes updated from r' - s_hat / P.
//   (launch_pow2_amax           max |r'| over this rank's padded tensor, for the power-of-two rescaling.)
//
// The compensator's state (echo_ds/compensator.py, "Storage") is m1 and m2 stored as bf16, or as int8 / int4
// codes with one exponent per group (StateFormat), and computed with in fp32. Each element's state is read
// once per call by the pass that forms its r' (entry or owner reduce) and, with residual "local", updated
// by that same pass from the rounding error it holds in registers; with residual "output" the dequantize
// reads it again and updates it. No correction, residual or other fp32 array is written: with bf16 the
// state costs 8 bytes per element per call ("local"; pow2 rescaling adds a read of 4 in its max pass;
// "output" reads it twice, 12), with int4 2 + 2/g.
//
// Wire format of one segment (the reference's packet, echo_ds/reference.py::_packet): codes
// [G, g * b / 8] uint8 (4-bit: element 2k in the low nibble of byte k), then scales [G] fp16, then
// zeros [G] fp16. The kernels take the three parts as separate pointers so that a caller may place them
// anywhere (its own buffers or a peer's); a packet laid out as the reference's is one choice.
//
// Every pointer may point into a peer's memory (CUDA IPC / peer access): the kernels only read what was
// complete before they were launched and only write what they own. NOTE: none of these kernels polls
// memory that another device writes while it runs; cross-device readiness is the caller's (flags or
// stream order), so plain loads are correct here.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "echo_p2p.h"

namespace echo {

// World sizes the kernels are built for (ECHO_DISPATCH_WORLD_SIZE); the reference supports any P.
constexpr int kMaxWorldSize = 8;
// Group sizes the kernels are built for: a group is held by g / 16 consecutive lanes of one warp.
constexpr int kMinGroupSize = 64;
constexpr int kMaxGroupSize = 256;

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
// The group quantizer (quant.QUANTIZERS, in that order: echo_ds.ops.kernels.QUANTIZER_CODES).
enum class Quantizer : int32_t { kZeroAware = 0, kSymmetric = 1, kNaive = 2, kZeroAwareInt = 3 };
// The compensator state's stored format (echo_ds/compensator.py, "Storage"; state_dtype "bf16", "int8",
// "int4"): the values are computed with in fp32 either way and rounded once when stored.
enum class StateFormat : int32_t { kBf16 = 0, kInt8 = 1, kInt4 = 2 };

// Where the quantized segments live: entry [j] holds segment j (push, dequantize) or the copy of rank j
// (owner reduce input), or a destination d of the reduced segment (owner reduce output). A null codes
// pointer means "no such entry". fp16 parameters are passed as their 16-bit patterns; a packed quantizer
// ("zero_aware_int", quant.pack_params) keeps its one 16-bit word per group in `scales` and never reads
// or writes `zeros`.
struct QuantTable {
  uint8_t* codes[kMaxWorldSize];
  uint16_t* scales[kMaxWorldSize];
  uint16_t* zeros[kMaxWorldSize];
  int32_t packed;  // 1: scale and zero-point share the word in `scales`
  int32_t reserved;
};
static_assert(sizeof(QuantTable) == 3 * kMaxWorldSize * sizeof(void*) + 8, "QuantTable: three pointer arrays and the format");
static_assert(offsetof(QuantTable, scales) == kMaxWorldSize * sizeof(void*), "QuantTable.scales offset");
static_assert(offsetof(QuantTable, zeros) == 2 * kMaxWorldSize * sizeof(void*), "QuantTable.zeros offset");

// The fixed randomized Hadamard rotation of echo_ds/quant.py: bit i of sign_bits set <=> D_ii = -1,
// norm = fp32(1 / sqrt(g)) exactly as quant.hadamard_norm(g) gives it.
struct HadamardSpec {
  uint32_t sign_bits[kMaxGroupSize / 32];
  float norm;
  int32_t enabled;
};
static_assert(sizeof(HadamardSpec) == (kMaxGroupSize / 32 + 2) * 4, "HadamardSpec layout");
static_assert(offsetof(HadamardSpec, norm) == kMaxGroupSize / 8, "HadamardSpec.norm offset");

// Compensator coefficients, each already rounded to fp32 (echo_ds/compensator.py, Compensator.__init__):
// c = ((m1 * blend) + (m2 * one_minus_blend)) * gain; m = store((m * decay) + (u * one_minus_decay)).
struct CompensatorCoeffs {
  float gain;             // eta
  float blend;            // a
  float one_minus_blend;  // 1 - a
  float slow_decay;       // beta1
  float one_minus_slow;   // 1 - beta1
  float fast_decay;       // beta2
  float one_minus_fast;   // 1 - beta2
};
static_assert(sizeof(CompensatorCoeffs) == 7 * sizeof(float), "CompensatorCoeffs must be 7 packed floats");

// What a rank contributes, r' = rotate(x) + c (reference.echo_all_reduce): x and, when compensating, the
// state (m1, m2) with its coefficients. The entry forms it for the segments it sends, the owner reduce for
// the segment it owns: the owned segment's x and state are read once either way, and no fp32 copy of it
// is written by the entry and read back by the reduce.
struct Contribution {
  const void* x;  // [numel] x_dtype (16-byte alignment enables the vector path)
  DType x_dtype;
  int32_t update_state;  // the stage folds this call's residual into m1, m2 in place (see each stage)
  // Compensation (m1 null: none): the state (m1, m2) in the stored format `state` (StateFormat), each array
  // over the padded length and 16-byte aligned. m1 is the slow average, m2 the fast one.
  StateFormat state;
  void* m1;           // kBf16: bf16 bit patterns; kInt8: int8 codes; kInt4: one byte per element, m1 | m2 << 4
  void* m2;           // kBf16, kInt8: as m1; kInt4: null (m2's codes are m1's high nibbles)
  int8_t* exponent;   // kInt8, kInt4: [padded / g] each group's E (stored value = code 2^E); kBf16: null
  CompensatorCoeffs coeffs;
  HadamardSpec hadamard;
};

// Shape of one call, identical to echo_ds.algorithm.Layout.
struct Layout {
  int64_t numel;               // real elements n of x / y
  int32_t world_size;          // P
  int32_t group_size;          // g
  int64_t groups_per_segment;  // G
};
static_assert(sizeof(Layout) == 24, "Layout layout");

inline int64_t groups_per_segment(int64_t numel, int world_size, int group_size) {
  const int64_t chunk = int64_t(world_size) * group_size;
  const int64_t chunks = numel <= 0 ? 1 : (numel + chunk - 1) / chunk;
  return chunks;  // padded = chunks * P * g, so each of the P segments holds `chunks` groups
}
inline int64_t segment_numel(const Layout& l) { return l.groups_per_segment * l.group_size; }
inline int64_t padded_numel(const Layout& l) { return segment_numel(l) * l.world_size; }
inline int code_bytes_per_group(int group_size, int bits) { return group_size * bits / 8; }

// ---------------------------------------------------------------------------------------------------
// 1. Entry (push): groups [group_begin, group_begin + num_groups) of every segment.
// ---------------------------------------------------------------------------------------------------
// src.update_state (residual "local"): m1, m2 of the sent groups += u = -(e 2^-k), e the codes' rounding
// error against rs, in place.
struct PushQuantizeArgs {
  Layout layout;
  Contribution src;
  int32_t rank;         // i: segment i is not sent (the owner reduce forms it), the others go to out[j]
  int32_t bits;         // 4 or 8
  Quantizer quantizer;
  int32_t pad_;
  int64_t group_begin;  // tile of groups inside each segment
  int64_t num_groups;
  const float* pow2_amax;  // device scalar: max |r'| over all ranks; null: no rescaling (k = 0)
  QuantTable out;          // out[j] for j != rank
};
void launch_push_quantize(const PushQuantizeArgs& args, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------
// 2. Owner reduce: groups [group_begin, group_begin + num_groups) of the owned segment.
// ---------------------------------------------------------------------------------------------------
// src.update_state (residual "local"): m1, m2 of the owned groups += u = -(e 2^-k), e = s_hat_scaled - acc.
struct OwnerReduceArgs {
  Layout layout;
  Contribution src;  // this rank's, as given to launch_push_quantize: the own copy is rs of segment rank
  int32_t rank;      // the owner
  int32_t bits;
  Quantizer quantizer;
  int32_t pad_;
  int64_t group_begin;
  int64_t num_groups;
  QuantTable in;           // in[r] for r != rank: the copy rank r sent
  QuantTable out;          // every non-null out[d] receives the reduced codes
  const float* pow2_amax;  // as in PushQuantizeArgs
};
void launch_owner_reduce(const OwnerReduceArgs& args, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------
// 3. Dequantize (gather / tail): segments [segment_begin, +num_segments), groups [group_begin, +num_groups).
// ---------------------------------------------------------------------------------------------------
// src: its hadamard is the inverse rotation applied to s_hat. With src.update_state (residual "output"),
// src is this rank's contribution as the entry got it, and m1, m2 of the decoded groups (padding included)
// += u = r' - s_hat / P in place, r' = rotate(x) + c formed again from x and the state.
struct DequantizeArgs {
  Layout layout;
  void* out;  // [numel] out_dtype; elements past numel (padding) are not written
  DType out_dtype;
  int32_t bits;
  int32_t segment_begin;
  int32_t num_segments;
  int32_t pad_;
  int64_t group_begin;
  int64_t num_groups;
  QuantTable in;  // in[j]: the reduced codes of segment j
  Contribution src;
  const float* pow2_amax;
};
void launch_dequantize(const DequantizeArgs& args, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------
// pow2 rescaling: amax_out = max over the padded tensor of |rotate(x) + c| (NaN if any is NaN).
// The max over ranks (one scalar all-reduce) is the caller's; the other kernels read the result.
// ---------------------------------------------------------------------------------------------------
struct Pow2AmaxArgs {
  Layout layout;
  Contribution src;
  float* amax_out;  // device scalar, overwritten
};
void launch_pow2_amax(const Pow2AmaxArgs& args, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------
// The whole call in one launch over peer memory (p2p_all_reduce.cu): entry, owner reduce and dequantize
// of a block's groups, ordered across ranks by 64-bit flags in each rank's exported flag area.
// ---------------------------------------------------------------------------------------------------
// Most blocks of one launch (the flag arrays are sized by it). The launcher caps its grid at what is
// resident at once (P2PRuntime::max_blocks), so that a block never waits for a peer block that cannot run.
constexpr int kP2PMaxBlocks = 256;

// The error record's stage ids and codes: echo_p2p.h (kWait*, kError*).

// The flag area of one rank (inside its exported signal memory), written by its peers. Block b of rank s
// publishes push[s][b] on owner j when its codes of owner j's segment are in j's push slot for s; block b
// of owner o publishes gather[o][b] on every rank when its reduced codes are in that rank's gather slot
// for o. A flag holds (epoch << 32) | descriptor: the call's epoch (1, 2, ...: P2PControl::epoch + 1, low 32
// bits), which only grows, and the call's 32-bit descriptor (echo_ds/p2p/protocol.py, call_descriptor:
// dtype, bits, group size, quantizer, rotation, pow2, residual, a hash of the element count, site and
// direction). A waiter is released when the flag EQUALS the value it expects; a flag of the same epoch with
// another descriptor is a mismatch between the ranks' calls (kErrorMismatch); a flag never goes back to 0.
struct P2PFlags {
  uint64_t push[kMaxWorldSize][kP2PMaxBlocks];
  uint64_t gather[kMaxWorldSize][kP2PMaxBlocks];
  uint64_t amax_flag[kMaxWorldSize];  // [src]: rank src's max |r'| (pow2 rescaling) is in amax[src]
  float amax[kMaxWorldSize];
  uint32_t reserved[8];
};
static_assert(sizeof(P2PFlags) == 2 * 8 * kMaxWorldSize * kP2PMaxBlocks + 8 * kMaxWorldSize + 4 * kMaxWorldSize + 32,
              "P2PFlags layout");

// This rank's control block (its own device memory, never exported): the epoch of the last finished
// call (raised by the last block of each launch, so that a CUDA graph replay raises it like an eager
// call), the blocks' arrival counter, the poison word (a wait failed: later waits give up at once), and
// for pow2 rescaling the blocks' max |r'| (bit pattern, atomicMax) with its own arrival counter: the last
// block to arrive takes the rank's max, leaves both at 0 for the next call and publishes the max.
// Without rescaling (pow2 0), the range events of the call so far (its chunks' launches): range_clipped
// and range_key, the largest (max |v| bits << 32 | scale bits) of the groups this rank quantized; the last
// block of the call's last launch counts them into the error record and leaves both at 0.
struct P2PControl {
  uint64_t epoch;
  uint32_t arrivals;
  uint32_t poisoned;
  uint32_t amax_bits;
  uint32_t amax_arrivals;
  int32_t pow2_k;  // the call's pow2 exponent, left by its first chunk's launch for the next ones
  uint32_t range_clipped;
  unsigned long long range_key;
  unsigned long long failure;  // the first failure: (epoch << 32) | code (p2p_all_reduce.cuh, rank_failed)
  uint32_t reserved[4];
};
static_assert(sizeof(P2PControl) == 64 && offsetof(P2PControl, range_key) == 32 && offsetof(P2PControl, failure) == 40,
              "P2PControl layout");

struct P2PAllReduceArgs {
  Layout layout;
  Contribution src;  // x and the state; src.update_state is ignored (update_local / update_output say)
  void* out;         // [numel] of x's dtype
  int32_t rank;
  int32_t bits;
  Quantizer quantizer;
  int32_t update_local;   // residual "local": the entry and the owner reduce update m1, m2
  int32_t update_output;  // residual "output": the dequantize updates m1, m2
  int32_t pow2;           // rescaling: 0 never, 1 always, 2 "auto" (algorithm.POW2_MODES); the max |r'|
                          // over the ranks is taken inside the launch
  QuantTable push_out;    // [j]: owner j's push slot for this rank (j != rank)
  QuantTable reduce_in;   // [s]: this rank's push slot for s (s != rank)
  QuantTable reduce_out;  // [d]: rank d's gather slot for this rank (every d, this rank's own included)
  QuantTable gathered;    // [o]: this rank's gather slot for owner o (every o)
  P2PFlags* flags[kMaxWorldSize];  // every rank's flag area, as this process maps it
  P2PControl* control;
  EchoP2PErrorRecord* error;  // device address of the mapped record (echo_p2p.h)
  // The staged transport's poison word (echo_p2p.h, EchoP2PControl::poisoned), or null: set at this rank's
  // first failure too, so that staged calls issued behind a failed launch (the descriptor gate in front of
  // every staged call, echo_ds/p2p/buffer.py) publish no flag and wait for none.
  uint32_t* staged_poisoned;
  uint64_t timeout_ns;
  int32_t num_blocks;
  uint32_t descriptor;  // this call's (see P2PFlags)
  // The groups [chunk_begin, chunk_begin + chunk_groups) of every segment: the whole segment where the
  // workspace holds the message, else one chunk of it per launch (P2PRuntime::call issues them).
  int64_t chunk_begin;
  int64_t chunk_groups;
  // One-shot (one_shot 1; small messages, one chunk): every rank reduces every segment itself. shot[d]: rank
  // d's one-shot region as this process maps it (parity 0; parity 1 follows at kWorld * shot_sender_bytes),
  // one sub-region of shot_sender_bytes per sender (p2p_all_reduce.cuh, ShotRegion). push_out, reduce_in,
  // reduce_out and gathered are not used.
  uint8_t* shot[kMaxWorldSize];
  int64_t shot_sender_bytes;
  int32_t one_shot;
};
void launch_p2p_all_reduce(const P2PAllReduceArgs& args, cudaStream_t stream);
// The same call without quantization (the 16-bit baseline): y = the fp32 sum in rank order rounded once to
// x's dtype; layout.group_size must be kPlainGroupSize (256); a.src.x, out, the slots' code pointers, the
// flags, control, error record, chunk and grid as for launch_p2p_all_reduce.
void launch_p2p_plain_all_reduce(const P2PAllReduceArgs& args, cudaStream_t stream);

// A zeroed control block on the current device, and its release.
P2PControl* p2p_alloc_control();
void p2p_free_control(P2PControl* control);
// Blocks of the one-launch kernel resident at once on the current device when nothing else runs: the
// blocks per SM its launch bounds guarantee times the SMs. The grid cap divides it among the ranks that
// share the device.
int p2p_resident_blocks();


// ---------------------------------------------------------------------------------------------------
// The staged pipeline's transport (p2p_transport.cu): puts that publish a flag after their data, flag
// writes with no data, waits that give up after a timeout, and the call's flag base. The memory they
// order (signal words, control block, error record) is laid out in echo_p2p.h, whose NOTE on flags
// states the protocol. Every pointer may be a peer's, mapped over CUDA IPC.
// ---------------------------------------------------------------------------------------------------
// Copies one put can carry: codes, scales and zeros of one tile for each of the P - 1 peers.
constexpr int kP2PMaxCopies = 3 * (kMaxWorldSize - 1);
constexpr int kP2PMaxFlags = kMaxWorldSize - 1;
// Launch lanes of the puts: one arrival counter each (EchoP2PControl::arrivals).
constexpr int kP2PNumLanes = 8;

// Copy byte ranges (local -> peers' buffers), then publish one flag per peer with the value
// control->base + stage_offset.
struct P2PPutArgs {
  const void* src[kP2PMaxCopies];
  void* dst[kP2PMaxCopies];
  uint64_t num_bytes[kP2PMaxCopies];
  uint32_t* flag[kP2PMaxFlags];  // peers' signal words (in their EchoP2PSignals)
  EchoP2PControl* control;       // this rank's
  uint32_t* local_progress;      // this rank's EchoP2PSignals::progress
  uint32_t num_copies;
  uint32_t num_flags;
  uint32_t stage_offset;
  uint32_t lane;  // which arrival counter (one per stream that launches puts)
};
void launch_p2p_put(const P2PPutArgs& args, cudaStream_t stream);

// A flag write with no data, for a stage whose kernel wrote its data into the peers' buffers itself
// (earlier on the same stream): value = control->base + stage_offset, or `value` when use_base is 0.
struct P2PSignalArgs {
  uint32_t* flag[kP2PMaxFlags];
  EchoP2PControl* control;
  uint32_t* local_progress;
  uint32_t num_flags;
  uint32_t stage_offset;
  uint32_t use_base;
  uint32_t value;
};
void launch_p2p_signal(const P2PSignalArgs& args, cudaStream_t stream);

// Spin until every flag equals control->base + stage_offset (or `value` when use_base is 0), or the
// timeout passes, or the host asks to abort; a failure fills the error record (rank, peer, stage, tile).
struct P2PWaitArgs {
  const uint32_t* flag[kP2PMaxFlags];  // this rank's own signal words
  uint32_t peer[kP2PMaxFlags];         // which peer writes each flag (for the error record)
  EchoP2PControl* control;
  EchoP2PErrorRecord* error;  // device address of the mapped record
  uint64_t timeout_ns;
  uint32_t num_flags;
  uint32_t stage_offset;
  uint32_t use_base;
  uint32_t value;
  uint32_t rank;
  uint32_t stage;  // kWait*
  uint32_t tile;
};
void launch_p2p_wait(const P2PWaitArgs& args, cudaStream_t stream);

// The first thing of every staged call, on the caller's stream: B(c) = 3c in control (echo_p2p.h).
void launch_p2p_begin_call(EchoP2PControl* control, cudaStream_t stream);

}  // namespace echo
