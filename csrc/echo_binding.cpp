// The torch-facing layer: every tensor is checked here (TORCH_CHECK) and turned into raw pointers for
// echo_api.cuh. Outputs are passed in (they may be views of a peer's memory), except the one-launch call's
// result (P2PRuntime::call allocates it, as a torch op would, on the caller's stream).
//
// The stream is passed in as its raw handle (torch.cuda.current_stream().cuda_stream), or, for
// P2PRuntime::call, taken from torch's device-generic stream registry; the caller makes the tensors' device
// current. Of torch's CUDA headers this file includes only ATen/cuda/EmptyTensor.h (y's allocation), which
// CPU wheels ship too, so it compiles against any torch build (CI compiles it against the CPU wheel); the
// extension links torch_cuda, as every CUDA build of it does.
//
// Tables of quantized segments are three lists of P tensors (codes uint8, scales fp16, zeros fp16); an
// entry with no elements stands for "none" (the rank's own segment, or a destination not written).
#include <torch/extension.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "echo_api.cuh"

namespace {

using echo::CompensatorCoeffs;
using echo::DType;
using echo::HadamardSpec;
using echo::Layout;
using echo::Quantizer;
using echo::QuantTable;

using OptTensor = std::optional<at::Tensor>;

cudaStream_t as_stream(int64_t stream) { return reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(stream)); }

bool present(const OptTensor& t) { return t.has_value() && t->defined(); }

void check_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), name, " is undefined");
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_aligned(const at::Tensor& t, const char* name, int64_t bytes) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0, name, " must be ", bytes,
              "-byte aligned (data_ptr ", t.data_ptr(), ")");
}

// One array of the compensator's state: `dtype`, at least `numel` elements, 16-byte aligned (null if absent).
void* opt_state_array(const OptTensor& t, const char* name, at::ScalarType dtype, int64_t numel) {
  if (!present(t)) return nullptr;
  check_tensor(*t, name);
  TORCH_CHECK(t->scalar_type() == dtype, name, " must be ", dtype, " (the compensator's state), got ", t->scalar_type());
  TORCH_CHECK(t->numel() >= numel, name, " has ", t->numel(), " elements, needs ", numel);
  check_aligned(*t, name, 16);
  return t->data_ptr();
}

// The stored format of a state (m1, m2, exponent) from its dtypes (echo_ds/compensator.py, "Storage"):
// bf16 m1, m2 and no exponents; int8 m1, m2 and int8 exponents; int4: uint8 m1 (both codes packed), no m2.
echo::StateFormat state_format(const OptTensor& m1, const OptTensor& m2, const OptTensor& exponent) {
  const char* expected = "the state is bfloat16 (m1, m2), int8 (m1, m2, exponent) or int4 (uint8 m1 holding both "
                         "averages' codes, exponent)";
  switch (m1->scalar_type()) {
    case at::kBFloat16:
      TORCH_CHECK(present(m2) && !present(exponent), expected);
      return echo::StateFormat::kBf16;
    case at::kChar:
      TORCH_CHECK(present(m2) && present(exponent), expected);
      return echo::StateFormat::kInt8;
    case at::kByte:
      TORCH_CHECK(!present(m2) && present(exponent), expected);
      return echo::StateFormat::kInt4;
    default: TORCH_CHECK(false, expected, "; got m1 ", m1->scalar_type());
  }
  return echo::StateFormat::kBf16;
}

DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
  return DType::kFloat32;
}

Quantizer quantizer_of(int64_t quantizer) {
  TORCH_CHECK(quantizer >= 0 && quantizer <= 3,
              "quantizer must be 0 (zero_aware), 1 (symmetric), 2 (naive) or 3 (zero_aware_int), got ", quantizer);
  return static_cast<Quantizer>(quantizer);
}

Layout make_layout(int64_t numel, int64_t world_size, int64_t group_size) {
  TORCH_CHECK(world_size >= 2 && world_size <= echo::kMaxWorldSize, "world_size must be in [2, ",
              echo::kMaxWorldSize, "], got ", world_size);
  TORCH_CHECK(group_size == 64 || group_size == 128 || group_size == 256,
              "the kernels support group_size 64, 128, 256, got ", group_size);
  Layout l;
  l.numel = numel;
  l.world_size = static_cast<int32_t>(world_size);
  l.group_size = static_cast<int32_t>(group_size);
  l.groups_per_segment = echo::groups_per_segment(numel, static_cast<int>(world_size), static_cast<int>(group_size));
  return l;
}

void check_bits(int64_t bits) { TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits); }

// `who` (the entry point) names the caller in the messages of the checks below.
void check_rank(int64_t rank, int64_t world_size, const char* who) {
  TORCH_CHECK(rank >= 0 && rank < world_size, who, ": rank ", rank, " outside [0, ", world_size, ")");
}

// The tile [begin, begin + count) of [0, total), count < 0 meaning "to the end": its count, checked.
int64_t tile_count(int64_t begin, int64_t count, int64_t total, const char* what, const char* who) {
  if (count < 0) count = total - begin;
  TORCH_CHECK(begin >= 0 && begin + count <= total, who, ": ", what, " [", begin, ", ", begin + count,
              ") outside [0, ", total, ")");
  return count;
}

// t has ref's dtype and numel.
void check_like(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name, const char* who) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type() && t.numel() == ref.numel(), who, ": ", name, " must have ",
              ref_name, "'s dtype and numel");
}

// A device scalar: a float32 tensor of at least 1 element.
float* scalar_f32(const at::Tensor& t, const char* name) {
  check_tensor(t, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() >= 1, name, " must be a float32 tensor of 1 element");
  return t.data_ptr<float>();
}

// Whether the quantizer's scale and zero-point share one 16-bit word (quant.PACKED_QUANTIZERS).
bool packed_params(Quantizer q) { return q == Quantizer::kZeroAwareInt; }

// Table of P entries, each with room for groups [0, G) of one segment; an entry with no elements is null.
// The scales and zeros keep room for the fp16 pair whatever the quantizer (a packed one uses the scales).
QuantTable make_table(const std::vector<at::Tensor>& codes, const std::vector<at::Tensor>& scales,
                      const std::vector<at::Tensor>& zeros, const Layout& l, int64_t bits, Quantizer quantizer,
                      const char* name) {
  const int P = l.world_size;
  TORCH_CHECK(static_cast<int>(codes.size()) == P && static_cast<int>(scales.size()) == P &&
                  static_cast<int>(zeros.size()) == P,
              name, ": codes, scales and zeros must be lists of world_size = ", P, " tensors");
  QuantTable t{};
  t.packed = packed_params(quantizer) ? 1 : 0;
  const int64_t code_bytes = l.groups_per_segment * echo::code_bytes_per_group(l.group_size, static_cast<int>(bits));
  for (int j = 0; j < P; ++j) {
    const bool empty = !codes[j].defined() || codes[j].numel() == 0;
    if (empty) continue;
    check_tensor(codes[j], name);
    check_tensor(scales[j], name);
    check_tensor(zeros[j], name);
    TORCH_CHECK(codes[j].scalar_type() == at::kByte, name, "[", j, "] codes must be uint8");
    TORCH_CHECK(scales[j].scalar_type() == at::kHalf && zeros[j].scalar_type() == at::kHalf, name, "[", j,
                "] scales and zeros must be float16");
    TORCH_CHECK(codes[j].numel() >= code_bytes, name, "[", j, "] codes has ", codes[j].numel(), " bytes, needs ",
                code_bytes);
    TORCH_CHECK(scales[j].numel() >= l.groups_per_segment && zeros[j].numel() >= l.groups_per_segment, name, "[",
                j, "] scales/zeros need ", l.groups_per_segment, " elements");
    check_aligned(codes[j], name, 16);
    t.codes[j] = codes[j].data_ptr<uint8_t>();
    t.scales[j] = reinterpret_cast<uint16_t*>(scales[j].data_ptr<at::Half>());
    t.zeros[j] = reinterpret_cast<uint16_t*>(zeros[j].data_ptr<at::Half>());
  }
  return t;
}

// Entries [begin, end) of t but `except` (-1: none) are present.
void check_entries(const QuantTable& t, int64_t begin, int64_t end, int64_t except, const char* entry,
                   const char* who) {
  for (int64_t j = begin; j < end; ++j) TORCH_CHECK(j == except || t.codes[j] != nullptr, who, ": no ", entry, " ", j);
}

HadamardSpec make_hadamard(const std::vector<int64_t>& sign_words, double norm, int64_t group_size) {
  HadamardSpec h{};
  h.enabled = sign_words.empty() ? 0 : 1;
  h.norm = static_cast<float>(norm);
  if (h.enabled) {
    TORCH_CHECK(static_cast<int64_t>(sign_words.size()) == group_size / 32, "hadamard sign words: need ",
                group_size / 32, " 32-bit words, got ", sign_words.size());
    for (size_t i = 0; i < sign_words.size(); ++i) h.sign_bits[i] = static_cast<uint32_t>(sign_words[i]);
  }
  return h;
}

CompensatorCoeffs make_coeffs(const std::vector<double>& c) {
  CompensatorCoeffs k{};
  if (c.empty()) return k;
  TORCH_CHECK(c.size() == 7, "coeffs: gain, blend, 1-blend, slow_decay, 1-slow, fast_decay, 1-fast (7 values)");
  // The values are fp32 already (Compensator rounds them), so these conversions are exact.
  k.gain = static_cast<float>(c[0]);
  k.blend = static_cast<float>(c[1]);
  k.one_minus_blend = static_cast<float>(c[2]);
  k.slow_decay = static_cast<float>(c[3]);
  k.one_minus_slow = static_cast<float>(c[4]);
  k.fast_decay = static_cast<float>(c[5]);
  k.one_minus_fast = static_cast<float>(c[6]);
  return k;
}

const float* opt_scalar(const OptTensor& t, const char* name) { return present(t) ? scalar_f32(*t, name) : nullptr; }

// The state (m1, m2, exponent), in any stored format (state_format), into s: checked against the layout l of
// the call (every array covers the padded message); absent m1: no state.
void bind_state(echo::Contribution& s, const OptTensor& m1, const OptTensor& m2, const OptTensor& exponent,
                const Layout& l) {
  s.m1 = s.m2 = nullptr;
  s.exponent = nullptr;
  if (!present(m1)) return;
  const int64_t padded = echo::padded_numel(l);
  s.state = state_format(m1, m2, exponent);
  const at::ScalarType dtype = m1->scalar_type();
  s.m1 = opt_state_array(m1, "m1", dtype, padded);
  s.m2 = opt_state_array(m2, "m2", dtype, padded);
  const int64_t span = padded * m1->element_size();
  const auto* a = static_cast<const char*>(s.m1);
  const auto* b = static_cast<const char*>(s.m2);
  TORCH_CHECK(b == nullptr || a + span <= b || b + span <= a, "m1 and m2 must not overlap");
  if (present(exponent)) {
    check_tensor(*exponent, "exponent");
    TORCH_CHECK(exponent->scalar_type() == at::kChar, "exponent must be int8, got ", exponent->scalar_type());
    TORCH_CHECK(exponent->numel() >= padded / l.group_size, "exponent has ", exponent->numel(),
                " elements, needs one per group: ", padded / l.group_size);
    s.exponent = exponent->data_ptr<int8_t>();
  }
}

// r' = rotate(x) + c of this rank (echo::Contribution); x is checked by the caller and l is its layout.
// update_state: the stage folds its residual into the state in place. The state (m1, m2, exponent) is in any
// stored format (state_format).
echo::Contribution make_contribution(const at::Tensor& x, const OptTensor& m1, const OptTensor& m2,
                                     const OptTensor& exponent, bool update_state, const std::vector<double>& coeffs,
                                     const std::vector<int64_t>& hadamard_signs, double hadamard_norm,
                                     const Layout& l) {
  TORCH_CHECK(present(m1) || (!present(m2) && !present(exponent)), "m2 and exponent come with m1");
  TORCH_CHECK(!present(m1) || !coeffs.empty(), "compensating from the state needs coeffs");
  TORCH_CHECK(!update_state || present(m1), "update_state needs the state (m1, m2)");
  echo::Contribution s{};
  s.x = x.data_ptr();
  s.x_dtype = dtype_of(x, "x");
  s.update_state = update_state ? 1 : 0;
  bind_state(s, m1, m2, exponent, l);
  s.coeffs = make_coeffs(coeffs);
  s.hadamard = make_hadamard(hadamard_signs, hadamard_norm, l.group_size);
  return s;
}

void push_quantize(const at::Tensor& x, const OptTensor& m1, const OptTensor& m2, const OptTensor& exponent,
                   const std::vector<at::Tensor>& codes, const std::vector<at::Tensor>& scales,
                   const std::vector<at::Tensor>& zeros, bool update_state, const OptTensor& pow2_amax,
                   int64_t rank, int64_t world_size, int64_t group_size, int64_t bits, int64_t quantizer,
                   const std::vector<int64_t>& hadamard_signs, double hadamard_norm,
                   const std::vector<double>& coeffs, int64_t group_begin, int64_t num_groups, int64_t stream) {
  check_tensor(x, "x");
  check_bits(bits);
  echo::PushQuantizeArgs a{};
  a.layout = make_layout(x.numel(), world_size, group_size);
  check_rank(rank, world_size, "push_quantize");
  num_groups =
      tile_count(group_begin, num_groups, a.layout.groups_per_segment, "the segment's groups", "push_quantize");
  a.src = make_contribution(x, m1, m2, exponent, update_state, coeffs, hadamard_signs, hadamard_norm, a.layout);
  a.rank = static_cast<int32_t>(rank);
  a.bits = static_cast<int32_t>(bits);
  a.quantizer = quantizer_of(quantizer);
  a.group_begin = group_begin;
  a.num_groups = num_groups;
  a.pow2_amax = opt_scalar(pow2_amax, "pow2_amax");
  a.out = make_table(codes, scales, zeros, a.layout, bits, a.quantizer, "push_quantize out");
  check_entries(a.out, 0, world_size, rank, "destination for segment", "push_quantize");
  echo::launch_push_quantize(a, as_stream(stream));
}

void owner_reduce(const at::Tensor& x, const OptTensor& m1, const OptTensor& m2, const OptTensor& exponent,
                  const std::vector<at::Tensor>& in_codes, const std::vector<at::Tensor>& in_scales,
                  const std::vector<at::Tensor>& in_zeros, const std::vector<at::Tensor>& out_codes,
                  const std::vector<at::Tensor>& out_scales, const std::vector<at::Tensor>& out_zeros,
                  bool update_state, const OptTensor& pow2_amax, int64_t rank, int64_t world_size,
                  int64_t group_size, int64_t bits, int64_t quantizer, const std::vector<int64_t>& hadamard_signs,
                  double hadamard_norm, const std::vector<double>& coeffs, int64_t group_begin, int64_t num_groups,
                  int64_t stream) {
  check_tensor(x, "x");
  check_bits(bits);
  echo::OwnerReduceArgs a{};
  a.layout = make_layout(x.numel(), world_size, group_size);
  check_rank(rank, world_size, "owner_reduce");
  num_groups =
      tile_count(group_begin, num_groups, a.layout.groups_per_segment, "the segment's groups", "owner_reduce");
  a.src = make_contribution(x, m1, m2, exponent, update_state, coeffs, hadamard_signs, hadamard_norm, a.layout);
  a.rank = static_cast<int32_t>(rank);
  a.bits = static_cast<int32_t>(bits);
  a.quantizer = quantizer_of(quantizer);
  a.group_begin = group_begin;
  a.num_groups = num_groups;
  a.in = make_table(in_codes, in_scales, in_zeros, a.layout, bits, a.quantizer, "owner_reduce in");
  check_entries(a.in, 0, world_size, rank, "copy from rank", "owner_reduce");
  a.out = make_table(out_codes, out_scales, out_zeros, a.layout, bits, a.quantizer, "owner_reduce out");
  a.pow2_amax = opt_scalar(pow2_amax, "pow2_amax");
  echo::launch_owner_reduce(a, as_stream(stream));
}

void dequantize(const at::Tensor& out, const std::vector<at::Tensor>& codes, const std::vector<at::Tensor>& scales,
                const std::vector<at::Tensor>& zeros, const OptTensor& pow2_amax, int64_t world_size,
                int64_t group_size, int64_t bits, int64_t quantizer, const std::vector<int64_t>& hadamard_signs,
                double hadamard_norm,
                int64_t segment_begin, int64_t num_segments, int64_t group_begin, int64_t num_groups,
                const OptTensor& x, const OptTensor& m1, const OptTensor& m2, const OptTensor& exponent,
                const std::vector<double>& coeffs,
                int64_t stream) {
  check_tensor(out, "out");
  check_bits(bits);
  echo::DequantizeArgs a{};
  a.layout = make_layout(out.numel(), world_size, group_size);
  num_segments = tile_count(segment_begin, num_segments, world_size, "segments", "dequantize");
  num_groups =
      tile_count(group_begin, num_groups, a.layout.groups_per_segment, "the segment's groups", "dequantize");
  a.out = out.data_ptr();
  a.out_dtype = dtype_of(out, "out");
  a.bits = static_cast<int32_t>(bits);
  a.segment_begin = static_cast<int32_t>(segment_begin);
  a.num_segments = static_cast<int32_t>(num_segments);
  a.group_begin = group_begin;
  a.num_groups = num_groups;
  a.in = make_table(codes, scales, zeros, a.layout, bits, quantizer_of(quantizer), "dequantize in");
  check_entries(a.in, segment_begin, segment_begin + num_segments, -1, "codes for segment", "dequantize");
  // residual "output": the update of the decoded segments' state, from this rank's x as the entry had it.
  TORCH_CHECK(present(x) == present(m1), "dequantize: the update needs x and the state (m1, m2) together");
  if (present(x)) {
    check_tensor(*x, "x");
    check_like(*x, "x", out, "out", "dequantize");
    a.src = make_contribution(*x, m1, m2, exponent, true, coeffs, hadamard_signs, hadamard_norm, a.layout);
  } else {
    a.src.hadamard = make_hadamard(hadamard_signs, hadamard_norm, group_size);
  }
  a.pow2_amax = opt_scalar(pow2_amax, "pow2_amax");
  echo::launch_dequantize(a, as_stream(stream));
}

void pow2_amax(const at::Tensor& x, const at::Tensor& amax_out, const OptTensor& m1, const OptTensor& m2,
               const OptTensor& exponent,
               int64_t world_size, int64_t group_size,
               const std::vector<int64_t>& hadamard_signs, double hadamard_norm, const std::vector<double>& coeffs, int64_t stream) {
  check_tensor(x, "x");
  echo::Pow2AmaxArgs a{};
  a.layout = make_layout(x.numel(), world_size, group_size);
  a.src = make_contribution(x, m1, m2, exponent, false, coeffs, hadamard_signs, hadamard_norm, a.layout);
  a.amax_out = scalar_f32(amax_out, "amax_out");
  echo::launch_pow2_amax(a, as_stream(stream));
}

// The one-launch p2p all-reduce of a group (p2p_all_reduce.cu): every rank's workspace as this process
// maps it, this rank's control block, the error record; a call's plan is built once (plan), then each call
// is one binding call (call) and one launch (the pow2 max is taken inside it), one launch per chunk where the
// message is larger than the workspace. EchoBuffer (echo_ds/p2p/buffer.py) does the handshake and owns the memory the addresses point
// to; this object owns only its control block. staged_poisoned: the staged transport's poison word (0:
// none), which this rank's first failure sets too (echo_api.cuh, P2PAllReduceArgs).
class P2PRuntime {
 public:
  P2PRuntime(int64_t rank, int64_t world_size, const std::vector<int64_t>& codes, const std::vector<int64_t>& params,
             const std::vector<int64_t>& flags, int64_t code_half_bytes, int64_t param_half_bytes,
             int64_t error_record, int64_t error_record_host, int64_t timeout_ns, int64_t max_blocks,
             int64_t staged_poisoned, int64_t device, const std::vector<int64_t>& shot, int64_t shot_sender_bytes)
      : rank_(rank), world_size_(world_size), code_half_(code_half_bytes), param_half_(param_half_bytes),
        timeout_ns_(timeout_ns), device_(static_cast<c10::DeviceIndex>(device)) {
    TORCH_CHECK(world_size == 2 || world_size == 4 || world_size == 8,
                "P2PRuntime: the one-launch transport is built for 2, 4 or 8 ranks, got ", world_size);
    check_rank(rank, world_size, "P2PRuntime");
    TORCH_CHECK(static_cast<int64_t>(codes.size()) == world_size && static_cast<int64_t>(params.size()) == world_size &&
                    static_cast<int64_t>(flags.size()) == world_size,
                "P2PRuntime: codes, params and flags need one address per rank");
    for (int64_t j = 0; j < world_size; ++j) {
      TORCH_CHECK(codes[j] % 256 == 0 && params[j] % 256 == 0 && flags[j] % 256 == 0 && codes[j] && params[j] && flags[j],
                  "P2PRuntime: rank ", j, "'s buffers must be non-null and 256-byte aligned");
      codes_[j] = reinterpret_cast<uint8_t*>(codes[j]);
      params_[j] = reinterpret_cast<uint8_t*>(params[j]);
      flags_[j] = reinterpret_cast<echo::P2PFlags*>(flags[j]);
    }
    TORCH_CHECK(error_record != 0 && error_record_host != 0,
                "P2PRuntime: the error record is required (its device and host addresses)");
    TORCH_CHECK(timeout_ns > 0, "P2PRuntime: timeout_ns must be positive");
    TORCH_CHECK(max_blocks >= 1 && max_blocks <= echo::kP2PMaxBlocks, "P2PRuntime: max_blocks must be in [1, ",
                echo::kP2PMaxBlocks, "], got ", max_blocks);
    error_ = reinterpret_cast<EchoP2PErrorRecord*>(error_record);
    error_host_ = reinterpret_cast<const volatile EchoP2PErrorRecord*>(error_record_host);
    TORCH_CHECK(staged_poisoned % 4 == 0, "P2PRuntime: staged_poisoned must be 0 or a 4-byte aligned address");
    staged_poisoned_ = reinterpret_cast<uint32_t*>(staged_poisoned);
    max_blocks_ = max_blocks;
    // The one-shot regions (empty: none): every rank's, 2 parities x P senders x shot_sender_bytes each.
    TORCH_CHECK(shot.empty() || (static_cast<int64_t>(shot.size()) == world_size && shot_sender_bytes > 0 &&
                                 shot_sender_bytes % 256 == 0),
                "P2PRuntime: the one-shot regions need one address per rank and a positive, 256-aligned size");
    for (size_t j = 0; j < shot.size(); ++j) {
      TORCH_CHECK(shot[j] != 0 && shot[j] % 256 == 0, "P2PRuntime: rank ", j, "'s one-shot region must be 256-byte aligned");
      shot_[j] = reinterpret_cast<uint8_t*>(shot[j]);
    }
    shot_sender_bytes_ = shot.empty() ? 0 : shot_sender_bytes;
    control_ = echo::p2p_alloc_control();
  }
  ~P2PRuntime() {
    try {
      close();
    } catch (...) {  // a destructor must not throw (after a device fault cudaFree reports the sticky error)
    }
  }
  P2PRuntime(const P2PRuntime&) = delete;
  P2PRuntime& operator=(const P2PRuntime&) = delete;

  void close() {
    if (control_ != nullptr) {
      echo::p2p_free_control(control_);
      control_ = nullptr;
    }
  }

  // The plan of calls like (x, m1, m2, exponent) with these arguments (issue 31, "plans built once"): the
  // layout, the chunks, the slot tables, the flags, the Hadamard table, the coefficients and the descriptor,
  // checked and built here once; call() binds a call's tensors to it. Returns its index. residual: 0 none (no
  // state), 1 "local", 2 "output"; (m1, m2, exponent) the state in its stored format (bind_state), padded
  // length, when residual != 0.
  int64_t plan(const at::Tensor& x, const OptTensor& m1, const OptTensor& m2, const OptTensor& exponent,
               const std::vector<double>& coeffs, int64_t residual, int64_t pow2, int64_t group_size, int64_t bits,
               int64_t quantizer, const std::vector<int64_t>& hadamard_signs, double hadamard_norm,
               int64_t descriptor, bool one_shot) {
    TORCH_CHECK(control_ != nullptr, "P2PRuntime: closed");
    TORCH_CHECK(descriptor >= 0 && descriptor <= 0xffffffffLL, "descriptor must be a 32-bit value");
    check_tensor(x, "x");
    TORCH_CHECK(x.get_device() == device_, "P2PRuntime: x is on cuda:", x.get_device(), ", the runtime on cuda:",
                static_cast<int>(device_));
    TORCH_CHECK(residual >= 0 && residual <= 2, "residual must be 0 (none), 1 (local) or 2 (output)");
    TORCH_CHECK(pow2 >= 0 && pow2 <= 2, "pow2 must be 0 (never), 1 (always) or 2 (auto)");
    TORCH_CHECK((residual != 0) == present(m1), "the state (m1, m2) comes with a residual, and only then");
    check_bits(bits);
    Plan p{};
    echo::P2PAllReduceArgs& a = p.args;
    a.layout = make_layout(x.numel(), world_size_, group_size);
    a.src = make_contribution(x, m1, m2, exponent, false, coeffs, hadamard_signs, hadamard_norm, a.layout);
    a.rank = static_cast<int32_t>(rank_);
    a.bits = static_cast<int32_t>(bits);
    a.quantizer = quantizer_of(quantizer);
    a.update_local = residual == 1;
    a.update_output = residual == 2;
    a.pow2 = static_cast<int32_t>(pow2);
    a.descriptor = static_cast<uint32_t>(descriptor);
    const int64_t group_code_bytes = echo::code_bytes_per_group(static_cast<int>(group_size), static_cast<int>(bits));
    p.chunk_groups = prepare_chunks(a, group_code_bytes);
    if (one_shot) {  // the whole message in one launch, through the one-shot regions (p2p_all_reduce.cuh)
      const int64_t G = a.layout.groups_per_segment;
      TORCH_CHECK(shot_sender_bytes_ > 0 && (world_size_ == 2 || world_size_ == 4) && x.element_size() == 2,
                  "P2PRuntime: the one-shot call needs the one-shot regions, 2 or 4 ranks and 16-bit x");
      const int64_t need = shot_sender_need(G, group_code_bytes, group_size);
      TORCH_CHECK(need <= shot_sender_bytes_, "P2PRuntime: the message does not fit the one-shot region (", need,
                  " bytes a sender, ", shot_sender_bytes_, " held)");
      a.one_shot = 1;
      a.shot_sender_bytes = shot_sender_bytes_;
      for (int64_t j = 0; j < world_size_; ++j) a.shot[j] = shot_[j];
      // One block per SM (kOneShotMinBlocks) where the two-shot kernel's cap counts two: half the cap.
      a.num_blocks = std::min<int32_t>(blocks_for(G, group_size), static_cast<int32_t>(std::max<int64_t>(1, max_blocks_ / 2)));
      p.chunk_groups = G;
    }
    p.numel = x.numel();
    p.dtype = x.scalar_type();
    p.state = residual != 0;
    if (p.state) {
      p.state_dtype = m1->scalar_type();
      p.with_m2 = present(m2);
      p.with_exponent = present(exponent);
      p.padded = echo::padded_numel(a.layout);
      p.exponent_numel = p.padded / a.layout.group_size;
    }
    plans_.push_back(p);
    return static_cast<int64_t>(plans_.size()) - 1;
  }

  // y = the Echo all-reduce of x over the group by plan `index` (same bits as echo_ds.reference), on the
  // current stream of x's device. None, with nothing launched, where the Python side must act first: the
  // runtime is closed; a wait of this group has failed (the error record holds a code); for a call without
  // rescaling, the kernels counted range events the host has not folded yet (set_range_seen); or x or the
  // state are not as plan() saw them (dtype, size, device, contiguity, stored format: a compensator's state
  // not allocated yet, or reallocated). No exception on the fast path: the caller raises the named error.
  py::object call(int64_t index, const at::Tensor& x, const OptTensor& m1, const OptTensor& m2,
                  const OptTensor& exponent) {
    if (control_ == nullptr || index < 0 || index >= static_cast<int64_t>(plans_.size()) || error_host_->code != 0) {
      return py::none();
    }
    const Plan& p = plans_[index];
    if (p.args.pow2 == 0 && (error_host_->clipped_calls != seen_clipped_ || error_host_->underflow_calls != seen_underflow_)) {
      return py::none();
    }
    if (!(x.is_cuda() && x.get_device() == device_ && x.is_contiguous() && x.scalar_type() == p.dtype &&
          x.numel() == p.numel)) {
      return py::none();
    }
    echo::P2PAllReduceArgs a = p.args;
    a.src.x = x.data_ptr();
    if (p.state) {
      a.src.m1 = state_array(m1, p.state_dtype, p.padded);
      a.src.m2 = p.with_m2 ? state_array(m2, p.state_dtype, p.padded) : nullptr;
      a.src.exponent = p.with_exponent ? static_cast<int8_t*>(state_array(exponent, at::kChar, p.exponent_numel, 1))
                                       : nullptr;
      if (a.src.m1 == nullptr || (p.with_m2 && (a.src.m2 == nullptr || a.src.m2 == a.src.m1)) ||
          (p.with_exponent && a.src.exponent == nullptr) || (!p.with_m2 && present(m2)) ||
          (!p.with_exponent && present(exponent))) {
        return py::none();
      }
    } else if (present(m1) || present(m2) || present(exponent)) {
      return py::none();
    }
    // y from the CUDA allocator directly (the tensor at::empty_like makes, without the dispatcher's part of
    // its host time: benchmarks/RESULTS.md, "One transport", 2026-12-07).
    at::Tensor y = at::detail::empty_cuda(x.sizes(), x.scalar_type(), x.device(), std::nullopt);
    a.out = y.data_ptr();
    const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(x.device());
    launch_prepared(a, p.chunk_groups, echo::launch_p2p_all_reduce, static_cast<cudaStream_t>(stream.native_handle()));
    return py::cast(y);
  }

  // The range counters of the error record that the host has folded (call() returns None while they differ).
  void set_range_seen(int64_t clipped, int64_t underflow) {
    seen_clipped_ = static_cast<uint32_t>(clipped);
    seen_underflow_ = static_cast<uint32_t>(underflow);
  }

  // Forget every plan (the Python side's cache was cleared: their indices are no longer held).
  void clear_plans() { plans_.clear(); }

  // y = the sum of x over the group without quantization (the 16-bit baseline: the fp32 sum in rank order,
  // rounded once to x's dtype; echo_api.cuh, launch_p2p_plain_all_reduce), through the same protocol.
  void plain_all_reduce(const at::Tensor& x, const at::Tensor& y, int64_t descriptor, int64_t stream) {
    TORCH_CHECK(control_ != nullptr, "P2PRuntime: closed");
    TORCH_CHECK(descriptor >= 0 && descriptor <= 0xffffffffLL, "descriptor must be a 32-bit value");
    check_tensor(x, "x");
    check_tensor(y, "y");
    check_like(y, "y", x, "x", "P2PRuntime");
    echo::P2PAllReduceArgs a{};
    a.layout = make_layout(x.numel(), world_size_, kPlainGroupSize);
    a.src.x = x.data_ptr();
    a.src.x_dtype = dtype_of(x, "x");
    a.out = y.data_ptr();
    a.rank = static_cast<int32_t>(rank_);
    a.descriptor = static_cast<uint32_t>(descriptor);
    const int64_t chunk_groups = prepare_chunks(a, kPlainGroupSize * static_cast<int64_t>(x.element_size()));
    launch_prepared(a, chunk_groups, echo::launch_p2p_plain_all_reduce, as_stream(stream));
  }

  int64_t max_blocks() const { return max_blocks_; }

 private:
  static constexpr int64_t kPlainGroupSize = 256;  // echo::detail::kPlainGroupSize (the launcher checks it)

  // The slots, flags and grid of a call whose groups take group_code_bytes each in a slot, into a; returns the
  // groups of one chunk (launch_prepared). The slots hold chunk_groups groups of every segment: all G where the workspace holds the
  // message (one launch), else the most it holds, one launch per chunk, on the same stream, each a call of
  // the protocol (its own epoch; slots reused as by back-to-back calls). Inside one launch a chunk loop
  // kept the kernel's values live across it and spilled at 128 registers (docs/p2p.md, "One launch per
  // call").
  int64_t prepare_chunks(echo::P2PAllReduceArgs& a, int64_t group_code_bytes) const {
    const int64_t G = a.layout.groups_per_segment;
    const int64_t code_room = code_half_ / world_size_ / 256 * 256;  // one slot's bytes, 256-aligned
    const int64_t param_room = param_half_ / world_size_ / 256 * 256;
    const int64_t chunk_groups = std::min({G, code_room / group_code_bytes, param_room / 4});
    TORCH_CHECK(chunk_groups >= 1, "P2PRuntime: the workspace holds no group of ", a.layout.group_size,
                " elements (", group_code_bytes, " bytes in a slot)");
    const int64_t code_stride = round_up(chunk_groups * group_code_bytes, 256);
    const int64_t param_stride = round_up(4 * chunk_groups, 256);
    const auto slot = [&](echo::QuantTable& t, int idx, int owner, int64_t index, bool gather) {
      uint8_t* c = codes_[owner] + (gather ? code_half_ : 0) + index * code_stride;
      uint8_t* p = params_[owner] + (gather ? param_half_ : 0) + index * param_stride;
      t.codes[idx] = c;
      t.scales[idx] = reinterpret_cast<uint16_t*>(p);
      t.zeros[idx] = reinterpret_cast<uint16_t*>(p + 2 * chunk_groups);
      t.packed = packed_params(a.quantizer) ? 1 : 0;
    };
    const int me = static_cast<int>(rank_);
    for (int j = 0; j < world_size_; ++j) {
      if (j != me) slot(a.push_out, j, j, me, false);   // owner j's push slot for me
      if (j != me) slot(a.reduce_in, j, me, j, false);  // my push slot for sender j
      slot(a.reduce_out, j, j, me, true);                // rank j's gather slot for me
      slot(a.gathered, j, me, j, true);                  // my gather slot for owner j
      a.flags[j] = flags_[j];
    }
    a.control = control_;
    a.error = error_;
    a.staged_poisoned = staged_poisoned_;
    a.timeout_ns = static_cast<uint64_t>(timeout_ns_);
    a.num_blocks = blocks_for(chunk_groups, a.layout.group_size);
    return chunk_groups;
  }

  // The grid of a launch over `groups` groups of every segment: one block item is 4096 / g groups (256 threads,
  // g / 16 lanes a group), at most max_blocks_ blocks.
  int32_t blocks_for(int64_t groups, int64_t group_size) const {
    const int64_t per_block = 4096 / group_size;
    const int64_t wanted = (groups + per_block - 1) / per_block;
    return static_cast<int32_t>(wanted < max_blocks_ ? wanted : max_blocks_);
  }

  // Bytes of one sender's one-shot region for G groups a segment (p2p_all_reduce.cuh, ShotRegion): P code slots,
  // the parameters, the own contribution in fp32.
  int64_t shot_sender_need(int64_t G, int64_t group_code_bytes, int64_t group_size) const {
    return world_size_ * round_up(G * group_code_bytes, 256) + round_up(4 * world_size_ * G, 256) + G * group_size * 4;
  }

  // The launches of a prepared call, one per chunk of chunk_groups groups, on `stream`.
  template <typename Launch>
  static void launch_prepared(echo::P2PAllReduceArgs& a, int64_t chunk_groups, Launch launch, cudaStream_t stream) {
    const int64_t G = a.layout.groups_per_segment;
    for (int64_t begin = 0; begin < G; begin += chunk_groups) {
      a.chunk_begin = begin;
      a.chunk_groups = std::min(chunk_groups, G - begin);
      launch(a, stream);
    }
  }

  static int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

  // What plan() fixed of a call: its arguments but x, the state and y.
  struct Plan {
    echo::P2PAllReduceArgs args;
    int64_t chunk_groups;
    int64_t numel;
    at::ScalarType dtype;
    bool state;  // the state's stored format, as bind_state checked it (residual != 0):
    at::ScalarType state_dtype;
    bool with_m2, with_exponent;
    int64_t padded, exponent_numel;
  };

  // One state array as plan() checked its kind (bind_state): on the runtime's device, contiguous, of `dtype`,
  // at least `numel` elements, `align`-byte aligned; else null.
  void* state_array(const OptTensor& t, at::ScalarType dtype, int64_t numel, int64_t align = 16) const {
    if (!present(t) || !t->is_cuda() || t->get_device() != device_ || !t->is_contiguous() || t->scalar_type() != dtype ||
        t->numel() < numel) {
      return nullptr;
    }
    void* data = t->data_ptr();
    return reinterpret_cast<uintptr_t>(data) % align == 0 ? data : nullptr;
  }

  int64_t rank_, world_size_, code_half_, param_half_, timeout_ns_, max_blocks_ = 1;
  c10::DeviceIndex device_ = 0;
  std::vector<Plan> plans_;
  const volatile EchoP2PErrorRecord* error_host_ = nullptr;  // the record's host mapping (its words, no sync)
  uint32_t seen_clipped_ = 0, seen_underflow_ = 0;
  uint8_t* shot_[echo::kMaxWorldSize] = {};
  int64_t shot_sender_bytes_ = 0;
  uint8_t* codes_[echo::kMaxWorldSize] = {};
  uint8_t* params_[echo::kMaxWorldSize] = {};
  echo::P2PFlags* flags_[echo::kMaxWorldSize] = {};
  EchoP2PErrorRecord* error_ = nullptr;
  uint32_t* staged_poisoned_ = nullptr;
  echo::P2PControl* control_ = nullptr;
};

}  // namespace

// =====================================================================================================
// The staged pipeline's transport (p2p_transport.cu)
// =====================================================================================================
// One object per prepared launch: CudaTransport (echo_ds/p2p/transport.py) builds them once per
// schedule from plain addresses, so that a launch is one binding call and Python mirrors no struct. The
// addresses point into memory that the EchoBuffer owns (its workspace, its peers' mappings, its control
// block and mapped error record): an object must not be launched after that buffer's close().
namespace {

template <typename T>
T* address(int64_t a) {
  return reinterpret_cast<T*>(static_cast<intptr_t>(a));
}

uint32_t u32(int64_t v, const char* name, const char* who) {
  TORCH_CHECK(v >= 0 && v <= 0xffffffffLL, who, ": ", name, " must be a 32-bit value, got ", v);
  return static_cast<uint32_t>(v);
}

EchoP2PControl* control_block(int64_t control, const char* who) {
  TORCH_CHECK(control != 0 && control % 4 == 0, who, ": the control block is required");
  return address<EchoP2PControl>(control);
}

// flags (addresses of 32-bit words) -> out; their number.
template <typename Word>
uint32_t fill_flags(Word* (&out)[echo::kP2PMaxFlags], const std::vector<int64_t>& flags, const char* who) {
  TORCH_CHECK(flags.size() <= static_cast<size_t>(echo::kP2PMaxFlags), who, ": at most ", echo::kP2PMaxFlags,
              " flags, got ", flags.size());
  for (size_t i = 0; i < flags.size(); ++i) {
    TORCH_CHECK(flags[i] != 0 && flags[i] % 4 == 0, who, ": flag ", i, " is not an aligned 32-bit word");
    out[i] = address<Word>(flags[i]);
  }
  return static_cast<uint32_t>(flags.size());
}

// copies: (dst, src, num_bytes); flags: the peers' signal words, published (control->base + stage_offset)
// by the last block once every copy has landed.
class P2PPut {
 public:
  P2PPut(const std::vector<std::tuple<int64_t, int64_t, int64_t>>& copies, const std::vector<int64_t>& flags,
         int64_t control, int64_t local_progress, int64_t stage_offset, int64_t lane) {
    TORCH_CHECK(copies.size() <= static_cast<size_t>(echo::kP2PMaxCopies), "P2PPut: at most ", echo::kP2PMaxCopies,
                " copies, got ", copies.size());
    for (size_t i = 0; i < copies.size(); ++i) {
      const auto [dst, src, num_bytes] = copies[i];
      TORCH_CHECK(num_bytes >= 0 && (num_bytes == 0 || (dst != 0 && src != 0)), "P2PPut: copy ", i,
                  " needs a source and a destination");
      a_.dst[i] = address<void>(dst);
      a_.src[i] = address<const void>(src);
      a_.num_bytes[i] = static_cast<uint64_t>(num_bytes);
    }
    a_.num_copies = static_cast<uint32_t>(copies.size());
    a_.num_flags = fill_flags(a_.flag, flags, "P2PPut");
    a_.control = control_block(control, "P2PPut");
    a_.local_progress = address<uint32_t>(local_progress);
    a_.stage_offset = u32(stage_offset, "stage_offset", "P2PPut");
    TORCH_CHECK(lane >= 0 && lane < echo::kP2PNumLanes, "P2PPut: lane must be in [0, ", echo::kP2PNumLanes, "), got ",
                lane);
    a_.lane = static_cast<uint32_t>(lane);
  }
  void launch(int64_t stream) const { echo::launch_p2p_put(a_, as_stream(stream)); }

 private:
  echo::P2PPutArgs a_{};
};

// flags: the peers' signal words, written (control->base + stage_offset, or `value`) after the stream's
// earlier work.
class P2PSignal {
 public:
  P2PSignal(const std::vector<int64_t>& flags, int64_t control, int64_t local_progress, int64_t stage_offset,
            std::optional<int64_t> value) {
    a_.num_flags = fill_flags(a_.flag, flags, "P2PSignal");
    a_.control = control_block(control, "P2PSignal");
    a_.local_progress = address<uint32_t>(local_progress);
    a_.stage_offset = u32(stage_offset, "stage_offset", "P2PSignal");
    a_.use_base = value.has_value() ? 0 : 1;
    a_.value = value.has_value() ? u32(*value, "value", "P2PSignal") : 0;
  }
  void launch(int64_t stream) const { echo::launch_p2p_signal(a_, as_stream(stream)); }

 private:
  echo::P2PSignalArgs a_{};
};

// flags: this rank's own signal words, peers[i] the rank that writes flags[i]; the stream waits until
// each holds control->base + stage_offset (or `value`), or timeout_ns passes.
class P2PWait {
 public:
  P2PWait(const std::vector<int64_t>& flags, const std::vector<int64_t>& peers, int64_t control, int64_t error_record,
          int64_t timeout_ns, int64_t stage_offset, std::optional<int64_t> value, int64_t rank, int64_t stage,
          int64_t tile) {
    TORCH_CHECK(peers.size() == flags.size(), "P2PWait: one peer per flag");
    a_.num_flags = fill_flags(a_.flag, flags, "P2PWait");
    for (size_t i = 0; i < peers.size(); ++i) a_.peer[i] = u32(peers[i], "peer", "P2PWait");
    a_.control = control_block(control, "P2PWait");
    TORCH_CHECK(error_record != 0, "P2PWait: the error record is required");
    a_.error = address<EchoP2PErrorRecord>(error_record);
    TORCH_CHECK(timeout_ns > 0, "P2PWait: timeout_ns must be positive");
    a_.timeout_ns = static_cast<uint64_t>(timeout_ns);
    a_.stage_offset = u32(stage_offset, "stage_offset", "P2PWait");
    a_.use_base = value.has_value() ? 0 : 1;
    a_.value = value.has_value() ? u32(*value, "value", "P2PWait") : 0;
    a_.rank = u32(rank, "rank", "P2PWait");
    a_.stage = u32(stage, "stage", "P2PWait");
    a_.tile = u32(tile, "tile", "P2PWait");
  }
  void launch(int64_t stream) const { echo::launch_p2p_wait(a_, as_stream(stream)); }

 private:
  echo::P2PWaitArgs a_{};
};

void p2p_begin_call(int64_t control, int64_t stream) {
  echo::launch_p2p_begin_call(control_block(control, "p2p_begin_call"), as_stream(stream));
}

// echo_p2p.h's ECHO_P2P_LAYOUT_LIST as {name: value}.
pybind11::dict p2p_transport_layout() {
  pybind11::dict layout;
#define ECHO_P2P_LAYOUT_ITEM(name, value) layout[name] = static_cast<int64_t>(value);
  ECHO_P2P_LAYOUT_LIST(ECHO_P2P_LAYOUT_ITEM)
#undef ECHO_P2P_LAYOUT_ITEM
  return layout;
}

void bind_p2p_transport(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<P2PPut>(m, "P2PPut")
      .def(py::init<const std::vector<std::tuple<int64_t, int64_t, int64_t>>&, const std::vector<int64_t>&, int64_t,
                    int64_t, int64_t, int64_t>(),
           py::arg("copies"), py::arg("flags"), py::arg("control"), py::arg("local_progress"), py::arg("stage_offset"),
           py::arg("lane"))
      .def("launch", &P2PPut::launch, py::arg("stream"));
  py::class_<P2PSignal>(m, "P2PSignal")
      .def(py::init<const std::vector<int64_t>&, int64_t, int64_t, int64_t, std::optional<int64_t>>(), py::arg("flags"),
           py::arg("control"), py::arg("local_progress"), py::arg("stage_offset"), py::arg("value"))
      .def("launch", &P2PSignal::launch, py::arg("stream"));
  py::class_<P2PWait>(m, "P2PWait")
      .def(py::init<const std::vector<int64_t>&, const std::vector<int64_t>&, int64_t, int64_t, int64_t, int64_t,
                    std::optional<int64_t>, int64_t, int64_t, int64_t>(),
           py::arg("flags"), py::arg("peers"), py::arg("control"), py::arg("error_record"), py::arg("timeout_ns"),
           py::arg("stage_offset"), py::arg("value"), py::arg("rank"), py::arg("stage"), py::arg("tile"))
      .def("launch", &P2PWait::launch, py::arg("stream"));
  m.def("p2p_begin_call", &p2p_begin_call, py::arg("control"), py::arg("stream"));
  m.def("p2p_transport_layout", &p2p_transport_layout);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "Echo CUDA kernels (echo_ds.ops): entry, owner reduce, dequantize (the compensator's update fused), pow2 amax";
  m.def("push_quantize", &push_quantize, py::arg("x"), py::arg("m1"), py::arg("m2"), py::arg("exponent"),
        py::arg("codes"), py::arg("scales"), py::arg("zeros"), py::arg("update_state"), py::arg("pow2_amax"),
        py::arg("rank"), py::arg("world_size"), py::arg("group_size"), py::arg("bits"), py::arg("quantizer"),
        py::arg("hadamard_signs"), py::arg("hadamard_norm"), py::arg("coeffs"), py::arg("group_begin"),
        py::arg("num_groups"), py::arg("stream"));
  m.def("owner_reduce", &owner_reduce, py::arg("x"), py::arg("m1"), py::arg("m2"), py::arg("exponent"),
        py::arg("in_codes"), py::arg("in_scales"), py::arg("in_zeros"), py::arg("out_codes"), py::arg("out_scales"),
        py::arg("out_zeros"), py::arg("update_state"), py::arg("pow2_amax"), py::arg("rank"), py::arg("world_size"),
        py::arg("group_size"), py::arg("bits"), py::arg("quantizer"), py::arg("hadamard_signs"),
        py::arg("hadamard_norm"), py::arg("coeffs"), py::arg("group_begin"), py::arg("num_groups"),
        py::arg("stream"));
  m.def("dequantize", &dequantize, py::arg("out"), py::arg("codes"), py::arg("scales"), py::arg("zeros"),
        py::arg("pow2_amax"), py::arg("world_size"), py::arg("group_size"), py::arg("bits"), py::arg("quantizer"),
        py::arg("hadamard_signs"), py::arg("hadamard_norm"), py::arg("segment_begin"), py::arg("num_segments"),
        py::arg("group_begin"), py::arg("num_groups"), py::arg("x"), py::arg("m1"), py::arg("m2"),
        py::arg("exponent"), py::arg("coeffs"),
        py::arg("stream"));
  m.def("pow2_amax", &pow2_amax, py::arg("x"), py::arg("amax_out"), py::arg("m1"), py::arg("m2"), py::arg("exponent"),
        py::arg("world_size"), py::arg("group_size"), py::arg("hadamard_signs"),
        py::arg("hadamard_norm"), py::arg("coeffs"), py::arg("stream"));
  py::class_<P2PRuntime>(m, "P2PRuntime")
      .def(py::init<int64_t, int64_t, const std::vector<int64_t>&, const std::vector<int64_t>&,
                    const std::vector<int64_t>&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                    int64_t, const std::vector<int64_t>&, int64_t>(),
           py::arg("rank"), py::arg("world_size"), py::arg("codes"), py::arg("params"), py::arg("flags"),
           py::arg("code_half_bytes"), py::arg("param_half_bytes"), py::arg("error_record"),
           py::arg("error_record_host"), py::arg("timeout_ns"), py::arg("max_blocks"), py::arg("staged_poisoned"),
           py::arg("device"), py::arg("shot") = std::vector<int64_t>{}, py::arg("shot_sender_bytes") = 0)
      .def("plan", &P2PRuntime::plan, py::arg("x"), py::arg("m1"), py::arg("m2"), py::arg("exponent"),
           py::arg("coeffs"), py::arg("residual"), py::arg("pow2"), py::arg("group_size"), py::arg("bits"),
           py::arg("quantizer"), py::arg("hadamard_signs"), py::arg("hadamard_norm"), py::arg("descriptor"),
           py::arg("one_shot") = false)
      // Two names rather than optional arguments: a call without state converts no None (pybind's share of
      // the host time, RESULTS.md "One transport", 2026-12-07).
      .def("call", [](P2PRuntime& r, int64_t plan, const at::Tensor& x) {
             return r.call(plan, x, std::nullopt, std::nullopt, std::nullopt);
           }, py::arg("plan"), py::arg("x"))
      .def("call_compensated", &P2PRuntime::call, py::arg("plan"), py::arg("x"), py::arg("m1"), py::arg("m2"),
           py::arg("exponent"))
      .def("set_range_seen", &P2PRuntime::set_range_seen, py::arg("clipped"), py::arg("underflow"))
      .def("clear_plans", &P2PRuntime::clear_plans)
      .def("plain_all_reduce", &P2PRuntime::plain_all_reduce, py::arg("x"), py::arg("y"), py::arg("descriptor"),
           py::arg("stream"))
      .def("close", &P2PRuntime::close)
      .def_property_readonly("max_blocks", &P2PRuntime::max_blocks);
  m.def("p2p_resident_blocks", &echo::p2p_resident_blocks);
  m.attr("kP2PFlagsBytes") = static_cast<int64_t>(sizeof(echo::P2PFlags));
  m.attr("kP2PMaxBlocks") = echo::kP2PMaxBlocks;
  m.attr("kMaxWorldSize") = echo::kMaxWorldSize;
  m.attr("kMinGroupSize") = echo::kMinGroupSize;
  m.attr("kMaxGroupSize") = echo::kMaxGroupSize;
  bind_p2p_transport(m);
}
