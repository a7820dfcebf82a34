// The one-launch kernel (internal to csrc/): nine translation units instantiate it, one per dtype and world
// size (p2p_all_reduce_<f32|f16|bf16>_p<2|4|8>.cu, six instantiations each), so that they build in parallel;
// p2p_all_reduce.cu holds the host entry points.
//
// The whole Echo all-reduce of one call in one launch, over peer memory (CUDA IPC): the two-shot shape of
// echo_api.cuh's three stages with the flags between them inside the kernel.
//
// Block b of every rank handles the same groups of every segment (items b, b + B, b + 2B, ... of
// kGroupsPerBlockItem groups each), so every cross-rank dependency is between the blocks of one index:
//
//   A. entry     rs of the P - 1 segments it sends -> codes straight into owner j's push slot for this rank;
//                then push[rank][b] = tag on every owner j.
//   B. reduce    wait push[s][b] == tag for every s != rank; the ordered fp32 sum of the owned segment's
//                groups (own rs unquantized), requantized once, into every rank's gather slot for this rank
//                (its own included); then gather[rank][b] = tag on every rank.
//   C. tail      wait gather[o][b] == tag for every o != rank; decode every segment's groups into y.
//
// tag = (epoch << 32) | descriptor (echo_api.cuh, P2PFlags): a peer whose flag holds this call's epoch
// with another descriptor made a different call, which every waiter that sees it reports.
//
// The arithmetic of each stage is the stage kernels' (push_quantize.cu, owner_reduce.cuh, dequantize.cu)
// through the same device functions, so the bits are the reference's. Slots are safe to reuse without
// more flags: a rank writes call n + 1's codes into owner j's push slot only after its own call n has
// decoded what j's block b gathered, which j's block b sent only after reading its push slot; and owner j
// writes a rank's gather slot for call n + 1 only after that rank's block b pushed call n + 1, i.e.
// after it decoded call n.
//
// The epoch lives in device memory (P2PControl): every block reads it at its start and the last block to
// finish raises it, so that a CUDA graph replay advances it like an eager call. Every wait is bounded by
// the global timer; a failed wait fills the mapped error record once and poisons the control block, after
// which every wait of every later call gives up at once (the host raises the named error).
#pragma once

#include <type_traits>

#include "echo_compensator.cuh"
#include "echo_contribution.cuh"
#include "echo_device.cuh"
#include "echo_quantizer.cuh"
#include "echo_rescale.cuh"
#include "echo_rotation.cuh"
#include "echo_sync.cuh"

namespace echo {
namespace detail {

// The first failure of this rank: poison the control block (every later wait gives up at once) and fill
// the mapped error record, `code` last. Words of the record: the epoch as call; expected and seen are the
// epochs (timeout, abort) or the two descriptors (mismatch).
__device__ __forceinline__ void record_failure(const P2PAllReduceArgs& a, uint32_t code, int peer, uint32_t stage,
                                               uint64_t expected, uint64_t seen, uint64_t waited_ns) {
  const unsigned long long failure = ((expected >> 32) << 32) | code;  // the epoch waited for, the code
  if (atomicCAS(&a.control->failure, 0ull, failure) != 0ull) return;  // a failure is already recorded
  *reinterpret_cast<volatile uint32_t*>(&a.control->poisoned) = 1u;
  if (a.staged_poisoned != nullptr) atomicExch(a.staged_poisoned, 1u);
  const bool mismatch = code == kErrorMismatch;
  volatile EchoP2PErrorRecord* e = a.error;
  e->rank = static_cast<uint32_t>(a.rank);
  e->peer = static_cast<uint32_t>(peer);
  e->stage = stage;
  e->tile = blockIdx.x;
  e->call_index = static_cast<uint32_t>(expected >> 32);
  e->expected = static_cast<uint32_t>(mismatch ? expected : expected >> 32);
  e->seen = static_cast<uint32_t>(mismatch ? seen : seen >> 32);
  e->waited_ns = waited_ns;
  e->one_launch = 1;  // echo_ds/p2p/protocol.py, WaitFailure
  __threadfence_system();
  e->code = code;
  __threadfence_system();
}

// Spin until *flag == expected (true), or give up (false): at once when the flag holds this call's epoch
// with another descriptor (the peer made another call); after timeout_ns; at once when the host asked to
// abort or an earlier wait of this rank failed. `also` (or null): another flag of the same peer that a
// peer making another call may write instead (the pow2 max exchange: a peer calling without rescaling
// skips it and publishes its push flags), read with the slow checks; this call's epoch with another
// descriptor there is the same mismatch.
__device__ __forceinline__ bool wait_flag(const P2PAllReduceArgs& a, const uint64_t* flag, uint64_t expected,
                                          uint32_t stage, int peer, const uint64_t* also = nullptr) {
  uint64_t seen = ld_acquire_sys(flag);
  if (seen == expected) return true;
  const uint64_t start = global_timer_ns();
  uint32_t polls = 0;
  while (true) {
    if ((seen >> 32) == (expected >> 32)) {
      record_failure(a, kErrorMismatch, peer, stage, expected, seen, global_timer_ns() - start);
      return false;
    }
    // The slow checks (clock, abort word in host memory, poison) every 64 polls keep the loop on the flag.
    if ((++polls & 63) == 0) {
      if (also != nullptr) {
        const uint64_t other = ld_acquire_sys(also);
        if ((other >> 32) == (expected >> 32) && other != expected) {  // this call's epoch, another descriptor
          record_failure(a, kErrorMismatch, peer, stage, expected, other, global_timer_ns() - start);
          return false;
        }
      }
      const uint64_t waited = global_timer_ns() - start;
      const bool aborted = *reinterpret_cast<volatile uint32_t*>(&a.error->abort_request) != 0;
      const bool poisoned = *reinterpret_cast<volatile uint32_t*>(&a.control->poisoned) != 0;
      if (waited > a.timeout_ns || aborted || poisoned) {
        if (!poisoned) record_failure(a, aborted ? kErrorAborted : kErrorTimeout, peer, stage, expected, seen, waited);
        return false;
      }
    }
    seen = ld_acquire_sys(flag);
    if (seen == expected) return true;
  }
}

// Thread t < P, t != rank, waits for its peer's flag (flags[rank]->field[t][block]); then the block.
// NOTE: the acquire loads and the barrier order the peers' data before every thread's reads below.
template <int kWorld>
__device__ __forceinline__ void wait_peers(const P2PAllReduceArgs& a, uint64_t (*field)[kP2PMaxBlocks],
                                           uint64_t tag, uint32_t stage) {
  const int t = static_cast<int>(threadIdx.x);
  if (t < kWorld && t != a.rank) wait_flag(a, &field[t][blockIdx.x], tag, stage, t);
  __syncthreads();
}

// The end of every launch of the family: the last block to finish raises the epoch to this launch's (every
// block read it at its start), so that the next launch, eager or replayed from a graph, takes the next one.
// True on thread 0 of that last block, after every other block's writes to the control block.
__device__ __forceinline__ bool finish_launch(P2PControl* control, uint64_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t prev = atomicInc(&control->arrivals, gridDim.x - 1);  // wraps to 0 for the next launch
    if (prev == gridDim.x - 1) {
      *reinterpret_cast<volatile uint64_t*>(&control->epoch) = epoch;
      __threadfence();
      return true;
    }
  }
  return false;
}

// Range without rescaling (pow2 0; algorithm.range_flags, issue 35): the events of one group this rank
// quantized, into the block's shared words. clipped: a finite group has a value more than half a step
// beyond its grid's ends; key: the largest (max |v|, scale) pair, whose scale below fp16's smallest normal
// value makes the call's underflow. Called by all the group's lanes together, after quantize_group on v.
struct RangeWatch {
  unsigned long long key;
  uint32_t clipped;
};

// The start of every launch of the family (finish_launch is its end): thread 0 reads the control block's epoch
// into the block's shared word (this launch's is one above) and, kRange, clears the block's range words; then
// every thread takes the epoch and the tag this call's flags hold, (epoch << 32) | descriptor.
struct LaunchTag {
  uint64_t epoch, tag;
};
template <bool kRange>
__device__ __forceinline__ LaunchTag begin_launch(const P2PAllReduceArgs& a, uint64_t& epoch_shared, RangeWatch* range) {
  if (threadIdx.x == 0) {
    epoch_shared = *reinterpret_cast<volatile uint64_t*>(&a.control->epoch) + 1;
    if constexpr (kRange) *range = RangeWatch{0ull, 0u};
  }
  __syncthreads();
  const uint64_t epoch = epoch_shared;
  return {epoch, ((epoch & 0xffffffffu) << 32) | a.descriptor};
}

// This block's groups of a launch's chunk of G groups, item by item (kGroupsPerBlockItem groups each, the grid
// striding over the items): body(gi) for this thread's group gi of each item, while gi < G (whole groups skip
// together, so a group's lanes stay converged).
template <int kLanes, typename Body>
__device__ __forceinline__ void for_block_groups(int64_t G, Body&& body) {
  constexpr int kPerItem = kGroupsPerBlockItem<kLanes>;
  for (int64_t base = int64_t(blockIdx.x) * kPerItem; base < G; base += int64_t(gridDim.x) * kPerItem) {
    const int64_t gi = base + threadIdx.x / kLanes;
    if (gi < G) body(gi);
  }
}

template <int kBits, int kLanes>
__device__ __forceinline__ void watch_range(RangeWatch* w, const float (&v)[kElemsPerThread], const GroupParams& p,
                                            Quantizer quantizer, int lane) {
  float mn, mx;
  bool finite;
  group_stats<kLanes>(v, mn, mx, finite);
  if (lane != 0 || !finite) return;
  const float q_min = quantizer == Quantizer::kSymmetric ? 1.0f : 0.0f;
  const float half = f_mul(0.5f, p.scale);
  const float top = f_add(f_mul(f_sub(float((1 << kBits) - 1), p.zero), p.scale), half);
  const float bottom = f_sub(f_mul(f_sub(q_min, p.zero), p.scale), half);
  if (mx > top || mn < bottom) atomicOr(&w->clipped, 1u);
  const float amax = fmaxf(fabsf(mn), fabsf(mx));
  if (amax > 0.0f) {
    atomicMax(&w->key, (static_cast<unsigned long long>(__float_as_uint(amax)) << 32) | __float_as_uint(p.scale));
  }
}

// The block's range events into the control block (before finish_launch); the last block of the call's last
// launch counts the call into the mapped record's counters and leaves the control words at 0.
__device__ __forceinline__ void fold_range(const P2PAllReduceArgs& a, const RangeWatch& w) {
  if (w.clipped) atomicOr(&a.control->range_clipped, 1u);
  if (w.key) atomicMax(&a.control->range_key, w.key);
}
__device__ __forceinline__ void count_range(const P2PAllReduceArgs& a) {
  if (a.chunk_begin + a.chunk_groups < a.layout.groups_per_segment) return;  // chunks of the call follow
  volatile P2PControl* c = a.control;
  const unsigned long long key = c->range_key;
  const bool underflow = (key >> 32) != 0 && __uint_as_float(static_cast<uint32_t>(key)) < kFp16MinNormal;
  volatile EchoP2PErrorRecord* e = a.error;
  if (c->range_clipped) e->clipped_calls = e->clipped_calls + 1;
  if (underflow) e->underflow_calls = e->underflow_calls + 1;
  c->range_clipped = 0;
  c->range_key = 0;
}

// The end of a launch that may watch the range (pow2 0: the block's events fold into the control block; the last
// block to finish counts the call's), then finish_launch.
__device__ __forceinline__ void end_launch_watching(const P2PAllReduceArgs& a, const RangeWatch& range, uint64_t epoch,
                                                    bool watch) {
  if (watch) {
    __syncthreads();
    if (threadIdx.x == 0) fold_range(a, range);
  }
  if (finish_launch(a.control, epoch) && watch) count_range(a);
}

// -DECHO_P2P_SIGNAL_FENCE=0 builds the signal without the full system fence before the release store (the
// release alone, as vLLM's custom all-reduce signals), for comparison (benchmarks/RESULTS.md).
#ifndef ECHO_P2P_SIGNAL_FENCE
#define ECHO_P2P_SIGNAL_FENCE 1
#endif
constexpr bool kSignalFence = ECHO_P2P_SIGNAL_FENCE != 0;

// Whether a wait of this rank failed in a way that forbids publishing a flag of `tag`'s call: a timeout or an
// abort, in this call or an earlier one; a mismatch in an earlier one. Such a rank publishes no flag: what it
// would vouch for was computed from data it never received, and a peer that arrives late (stopped, then
// resumed) must time out on it rather than take it as the call's (a silent wrong result). A mismatch in
// this very call does not forbid it: the flag carries this rank's descriptor, so every peer that waits for
// it, having made the other call, names the mismatch too instead of timing out (and a peer that made the
// same call as this rank waits for the mismatching rank as well and fails there). Every later call of the
// rank fails at once anyway.
__device__ __forceinline__ bool rank_failed(const P2PAllReduceArgs& a, uint64_t tag) {
  const unsigned long long f = *reinterpret_cast<volatile unsigned long long*>(&a.control->failure);
  return f != 0ull && !((f & 0xffffffffull) == kErrorMismatch && (f >> 32) == (tag >> 32));
}

// After the block's data writes: thread t < P, t != rank, publishes flags[t]->field[rank][block] = tag,
// unless a wait of this rank failed (rank_failed).
// NOTE: the barrier orders every thread's writes before the fence of the publishing thread, whose
// cumulativity makes them visible system-wide before its release store.
template <int kWorld, bool kGather>
__device__ __forceinline__ void signal_peers(const P2PAllReduceArgs& a, uint64_t tag) {
  __syncthreads();
  const int t = static_cast<int>(threadIdx.x);
  if (t < kWorld && t != a.rank && !rank_failed(a, tag)) {
    if constexpr (kSignalFence) __threadfence_system();
    P2PFlags* f = a.flags[t];
    st_release_sys(kGather ? &f->gather[a.rank][blockIdx.x] : &f->push[a.rank][blockIdx.x], tag);
  }
}

// The call's pow2 exponent k (0 without rescaling), called by every block of a quantized launch (two-shot and
// one-shot) with the launch's tag.
template <typename T, int kWorld, int kLanes>
__device__ __forceinline__ int call_exponent(const P2PAllReduceArgs& a, uint64_t tag, int me, P2PControl* control,
                                             P2PFlags* mine) {
  __shared__ float amax_shared;
  // pow2 rescaling: the group's max |r'|, before any code is formed. Every block takes the max of its
  // share of this rank's tensor into control->amax_bits; the last block to arrive publishes the rank's max
  // to every rank (its own included); every block then waits for all P and takes their max.
  // NOTE: the grid is co-resident (the launcher's cap), so the blocks that wait for the last one to arrive
  // cannot keep it from running. The wait also orders the state: every block waits for its own rank's
  // max, published after the last block has read m1 and m2 for it, before any block updates them.
  // A chunk after the first (a message larger than the workspace) takes the exponent its call's first chunk
  // left in the control block: its max is over the whole message, before any state was updated.
  const float* pow2_amax = nullptr;
  const bool first_chunk = a.chunk_begin == 0;
  if (a.pow2 && first_chunk) {
    __shared__ unsigned warp_max[kThreadsPerBlock / kWarpSize];
    __shared__ int last_to_arrive;
    const int t = static_cast<int>(threadIdx.x);
    const unsigned block_best = block_amax_bits<T, kLanes>(a.src, a.layout, warp_max);
    if (t == 0) {
      atomicMax(&control->amax_bits, block_best);
      __threadfence();
      last_to_arrive = atomicInc(&control->amax_arrivals, gridDim.x - 1) == gridDim.x - 1;  // wraps to 0
    }
    __syncthreads();
    if (last_to_arrive) {
      if (t == 0) {
        __threadfence();
        warp_max[0] = atomicExch(&control->amax_bits, 0u);  // every block's max is in; 0 for the next call
      }
      __syncthreads();
      if (t < kWorld && !rank_failed(a, tag)) {
        a.flags[t]->amax[me] = __uint_as_float(warp_max[0]);
        __threadfence_system();
        st_release_sys(&a.flags[t]->amax_flag[me], tag);
      }
    }
    if (t == 0) {
      unsigned best = 0u;
      for (int s = 0; s < kWorld; ++s) {
        // A peer without rescaling never writes its max: its push flag names the other call.
        wait_flag(a, &mine->amax_flag[s], tag, kWaitAmax, s, s == me ? nullptr : &mine->push[s][blockIdx.x]);
        best = max(best, __float_as_uint(*reinterpret_cast<volatile float*>(&mine->amax[s])));
      }
      amax_shared = a.pow2 == 2 ? pow2_auto_gate(__uint_as_float(best)) : __uint_as_float(best);
    }
    __syncthreads();
    pow2_amax = &amax_shared;
  }
  const int k = first_chunk ? pow2_exponent(pow2_amax) : *reinterpret_cast<volatile int32_t*>(&control->pow2_k);
  if (first_chunk && blockIdx.x == 0 && threadIdx.x == 0) control->pow2_k = k;  // read by the next launches
  return k;
}

// A group this rank quantized as an owner or a sender (v: its values; codes, p: their quantization; e: its first
// element; m: the state words its contribution read): its range events without rescaling, and residual
// "local"'s update of the state.
template <int kBits, int kLanes>
__device__ __forceinline__ void note_quantized(const P2PAllReduceArgs& a, RangeWatch* range, bool watch,
                                               const float (&v)[kElemsPerThread], const Codes<kBits>& codes,
                                               const GroupParams& p, int64_t e, int lane, int k, const StateWords& m) {
  if (watch) watch_range<kBits, kLanes>(range, v, p, a.quantizer, lane);
  if (a.update_local) {
    float u[kElemsPerThread];
    local_residual<kBits>(codes, p, v, k, u);
    update_state<kLanes>(a.src, e, lane, m, u);
  }
}

// The tail of one group of a reduced segment, element e its first: decode (codes, p: the group as every rank
// receives it) into y, and residual "output"'s update (u = r' - s_hat / P, r' formed again as the entry formed
// it: dequantize.cu, kUpdate). A group of padding only updates its state (residual "output") and writes nothing.
template <typename T, int kWorld, int kBits, int kLanes>
__device__ __forceinline__ void tail_group(const P2PAllReduceArgs& a, int64_t e, int lane, int k, const Codes<kBits>& codes,
                                           const GroupParams& p) {
  const int64_t numel = a.layout.numel;
  const float down = exp2_int(-k);
  float v[kElemsPerThread];
  if (a.update_output) {
    float r[kElemsPerThread];
    StateWords m;
    contribution<T, kLanes>(a.src, e, lane, numel, /*k=*/0, r, m);
    decode<kBits>(codes, p.scale, p.zero, v);
    const float inv_world = __frcp_rn(static_cast<float>(kWorld));
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) {
      if (k != 0) v[i] = f_mul(v[i], down);
      r[i] = f_sub(r[i], f_mul(v[i], inv_world));
    }
    update_state<kLanes>(a.src, e, lane, m, r);
    if (e >= numel) return;  // padding: its state is updated, nothing is written
  } else {
    decode<kBits>(codes, p.scale, p.zero, v);
    if (k != 0) {
#pragma unroll
      for (int i = 0; i < kElemsPerThread; ++i) v[i] = f_mul(v[i], down);
    }
  }
  if (a.src.hadamard.enabled) unrotate<kLanes>(v, lane, a.src.hadamard);
  store_thread<T, kLanes>(static_cast<T*>(a.out), e, lane, numel, aligned16(a.out), v);
}

// 256 threads at up to 128 registers: 2 blocks resident per SM, which the grid cap counts on
// (p2p_resident_blocks). At 3 (80 registers) ptxas spilled; the entry's prefetch needs the registers.
// -DECHO_FUSED_MIN_BLOCKS=n builds others for comparison (benchmarks/RESULTS.md).
#ifndef ECHO_FUSED_MIN_BLOCKS
#define ECHO_FUSED_MIN_BLOCKS 2
#endif
constexpr int kFusedMinBlocks = ECHO_FUSED_MIN_BLOCKS;

// -DECHO_P2P_TIMING_SKIP=m, for timing only (its results are wrong): the two-shot kernel skips the work of the
// phases in the mask m (1 the entry, 2 the owner reduce, 4 the tail) and keeps their flags and waits, so that a
// phase's share of a call's time is its difference from the shipped build (benchmarks/gpu_one_transport.sh,
// step "phases"). 0, the default, builds the kernel as if the switch did not exist.
#ifndef ECHO_P2P_TIMING_SKIP
#define ECHO_P2P_TIMING_SKIP 0
#endif
constexpr int kTimingSkip = ECHO_P2P_TIMING_SKIP;

template <typename T, int kWorld, int kBits, int kGroupSize>
__global__ void ECHO_KERNEL_BOUNDS(kFusedMinBlocks) p2p_all_reduce_kernel(const P2PAllReduceArgs a) {
  constexpr int kLanes = kGroupSize / kElemsPerThread;
  constexpr int kPerItem = kGroupsPerBlockItem<kLanes>;
  __shared__ uint64_t epoch_shared;
  __shared__ RangeWatch range;  // pow2 0: this block's range events
  const int me = a.rank;
  const int lane = static_cast<int>(threadIdx.x % kLanes);
  const int64_t seg_elems = a.layout.groups_per_segment * kGroupSize;
  // This launch's chunk: groups [chunk_begin, chunk_begin + G) of every segment. Slots are indexed by the
  // group within the chunk (gl), elements and state by the group within the segment (chunk_begin + gl).
  const int64_t G = a.chunk_groups;
  const int64_t numel = a.layout.numel;
  P2PControl* control = a.control;
  P2PFlags* mine = a.flags[me];

  const auto [epoch, tag] = begin_launch<true>(a, epoch_shared, &range);
  const bool watch = a.pow2 == 0;

  const int k = call_exponent<T, kWorld, kLanes>(a, tag, me, control, mine);

  // A. entry: the segments this rank sends. A thread's work is a sequence of units (item, sent segment);
  // for 16-bit x and a bf16 state (or none) the loads of unit q + 1 are issued before unit q is worked on
  // (two buffers, as push_quantize.cu does), so that one unit's loads are in flight while the thread computes.
  constexpr int kSent = kWorld - 1;
  // Unit q: this thread's group gi of the item, of sent segment j, whose first element is e.
  const auto unit = [&](int64_t q, int64_t& gi, int& j, int64_t& e) {  // false past the block's last unit
    const int64_t base = (int64_t(blockIdx.x) + (q / kSent) * int64_t(gridDim.x)) * kPerItem;
    if ((kTimingSkip & 1) || base >= G) return false;  // uniform over the block
    const int jj = static_cast<int>(q % kSent);
    gi = base + threadIdx.x / kLanes;
    j = jj < me ? jj : jj + 1;
    e = int64_t(j) * seg_elems + (a.chunk_begin + gi) * kGroupSize;
    return true;
  };
  const auto load_unit = [&](int64_t q, RawChunks<T>& r) {
    int64_t gi, e;
    int j;
    if (unit(q, gi, j, e) && gi < G) load_contribution_x<T, kLanes>(a.src, e, lane, numel, r);
  };
  // kAnyState: the update of every stored format, else of the bf16 state only (the loop that prefetches).
  const auto entry_work = [&](int64_t gi, int j, int64_t e, const RawChunks<T>& r, auto any_state) {
    float v[kElemsPerThread];
    StateWords m;
    contribution_from_raw<T, kLanes>(a.src, r, e, lane, k, v, m);
    Codes<kBits> codes;
    const GroupParams p = quantize_group<kBits, kLanes>(v, a.quantizer, lane, codes);
    store_packet_group<kBits, kLanes>(a.push_out, j, gi, lane, codes, p);
    if (watch) watch_range<kBits, kLanes>(&range, v, p, a.quantizer, lane);
    if (a.update_local) {
      float u[kElemsPerThread];
      local_residual<kBits>(codes, p, v, k, u);
      if constexpr (decltype(any_state)::value) {
        update_state<kLanes>(a.src, e, lane, m, u);
      } else {
        update_bf16_state<kLanes>(a.src, e, lane, m, u);
      }
    }
  };
  // The integer states' update beside the prefetched words spilled at the register cap: their entry takes
  // the loop without prefetch, as fp32 x does.
  const bool integer_state = a.src.m1 != nullptr && a.src.state != StateFormat::kBf16;
  bool entered = false;
  if constexpr (sizeof(T) == 2) {
    if (!integer_state) {
      // Works on unit q from r after issuing unit q + 1's loads into `next`; false past the last unit.
      const auto entry_step = [&](int64_t q, const RawChunks<T>& r, RawChunks<T>& next) {
        int64_t gi, e;
        int j;
        if (!unit(q, gi, j, e)) return false;
        load_unit(q + 1, next);
        if (gi < G) entry_work(gi, j, e, r, std::false_type{});  // whole groups skip together
        return true;
      };
      RawChunks<T> raw[2];
      load_unit(0, raw[0]);
#pragma unroll 1
      for (int64_t q = 0;; q += 2) {
        if (!entry_step(q, raw[0], raw[1]) || !entry_step(q + 1, raw[1], raw[0])) break;
      }
      entered = true;
    }
  }
  if (!entered) {  // fp32 x (twice the words per unit: two buffers would not fit the registers), integer states
    int64_t gi, e;
    int j;
#pragma unroll 1
    for (int64_t q = 0; unit(q, gi, j, e); ++q) {
      if (gi >= G) continue;
      RawChunks<T> r;
      load_contribution_x<T, kLanes>(a.src, e, lane, numel, r);
      entry_work(gi, j, e, r, std::true_type{});
    }
  }
  signal_peers<kWorld, false>(a, tag);

  // B. owner reduce of this block's groups of the owned segment, the sum in rank order.
  wait_peers<kWorld>(a, mine->push, tag, kWaitReduce);
  for (int64_t base = int64_t(blockIdx.x) * kPerItem; !(kTimingSkip & 2) && base < G;
       base += int64_t(gridDim.x) * kPerItem) {
    const int64_t gi = base + threadIdx.x / kLanes;
    if (gi >= G) continue;
    const int64_t own_e = int64_t(me) * seg_elems + (a.chunk_begin + gi) * kGroupSize;
    const int64_t code_offset = gi * kGroupCodeBytes<kBits, kLanes>;
    // 4-bit copies of up to 4 ranks are loaded before the own contribution is formed; otherwise (twice
    // the registers, or twice the copies: ptxas spilled) each at its turn in the sum.
    constexpr bool kPrefetch = kBits == 4 && kWorld <= 4;
    Codes<kBits> copies[kPrefetch ? kWorld : 1];
    uint16_t scale_bits[kPrefetch ? kWorld : 1], zero_bits[kPrefetch ? kWorld : 1];
    const auto load_copy = [&](int r, int slot) {
      copies[slot] = load_codes<kBits, kLanes>(a.reduce_in.codes[r] + code_offset, lane);
      load_param_bits(a.reduce_in, r, gi, scale_bits[slot], zero_bits[slot]);
    };
    if constexpr (kPrefetch) {
#pragma unroll
      for (int r = 0; r < kWorld; ++r) {
        if (r != me) load_copy(r, r);
      }
    }
    float own[kElemsPerThread];
    StateWords m;
    contribution<T, kLanes>(a.src, own_e, lane, numel, k, own, m);
    float acc[kElemsPerThread];
    sum_in_rank_order<kWorld>(acc, [&](int r, float (&t)[kElemsPerThread]) {
      if (r == me) {
#pragma unroll
        for (int i = 0; i < kElemsPerThread; ++i) t[i] = own[i];
      } else {
        const int slot = kPrefetch ? r : 0;
        if constexpr (!kPrefetch) load_copy(r, 0);
        const GroupParams p = table_params<kBits>(a.reduce_in, scale_bits[slot], zero_bits[slot]);
        decode<kBits>(copies[slot], p.scale, p.zero, t);
      }
    });
    Codes<kBits> codes;
    const GroupParams p = quantize_group<kBits, kLanes>(acc, a.quantizer, lane, codes);
#pragma unroll
    for (int d = 0; d < kWorld; ++d) store_packet_group<kBits, kLanes>(a.reduce_out, d, gi, lane, codes, p);
    note_quantized<kBits, kLanes>(a, &range, watch, acc, codes, p, own_e, lane, k, m);
  }
  signal_peers<kWorld, true>(a, tag);

  // C. tail: every segment's reduced codes -> y (and residual "output"'s update).
  wait_peers<kWorld>(a, mine->gather, tag, kWaitTail);
  for (int64_t base = int64_t(blockIdx.x) * kPerItem; !(kTimingSkip & 4) && base < G;
       base += int64_t(gridDim.x) * kPerItem) {
    const int64_t gi = base + threadIdx.x / kLanes;
    if (gi >= G) continue;
    const int64_t code_offset = gi * kGroupCodeBytes<kBits, kLanes>;
    const auto tail_segment = [&](int seg, const Codes<kBits>& codes, uint16_t scale_bits, uint16_t zero_bits) {
      tail_group<T, kWorld, kBits, kLanes>(a, int64_t(seg) * seg_elems + (a.chunk_begin + gi) * kGroupSize, lane, k,
                                           codes, table_params<kBits>(a.gathered, scale_bits, zero_bits));
    };
    // A segment whose group is all padding is skipped (residual "output" still updates its state).
    const auto wanted = [&](int seg) {
      return a.update_output || int64_t(seg) * seg_elems + (a.chunk_begin + gi) * kGroupSize < numel;
    };
    if constexpr (kBits == 4 && kWorld <= 4) {
      // The codes of every segment are loaded before any is decoded.
      Codes<kBits> gathered[kWorld];
      uint16_t scale_bits[kWorld], zero_bits[kWorld];
#pragma unroll
      for (int seg = 0; seg < kWorld; ++seg) {
        if (!wanted(seg)) continue;
        gathered[seg] = load_codes<kBits, kLanes>(a.gathered.codes[seg] + code_offset, lane);
        load_param_bits(a.gathered, seg, gi, scale_bits[seg], zero_bits[seg]);
      }
#pragma unroll
      for (int seg = 0; seg < kWorld; ++seg) {
        if (wanted(seg)) tail_segment(seg, gathered[seg], scale_bits[seg], zero_bits[seg]);
      }
    } else {  // 8-bit codes or 8 segments (ptxas spilled): one segment at a time
#pragma unroll 1
      for (int seg = 0; seg < kWorld; ++seg) {
        if (!wanted(seg)) continue;
        uint16_t scale_bits, zero_bits;
        load_param_bits(a.gathered, seg, gi, scale_bits, zero_bits);
        tail_segment(seg, load_codes<kBits, kLanes>(a.gathered.codes[seg] + code_offset, lane), scale_bits, zero_bits);
      }
    }
  }

  end_launch_watching(a, range, epoch, watch);
}

// ---------------------------------------------------------------------------------------------------
// One-shot (small messages): every rank receives every sender's codes of every segment but the sender's own,
// and each sender's own contribution (its segment, the owner's term of the sum) in fp32; every rank then
// reduces every segment itself, exactly as its owner does in the two-shot kernel (same terms, same order,
// same requantization), and decodes it: the same bits with one exchange instead of two.
//
// Rank d's one-shot region (P2PAllReduceArgs::shot[d]) holds, per parity (epoch & 1), one sub-region of
// shot_sender_bytes per sender r:
//   codes   kWorld slots of code_slot = round256(G gcb) bytes: segment j's group gi at j code_slot + gi gcb
//   params  round256(4 kWorld G) bytes: the scales [kWorld G] (index j G + gi), then the zero-points
//   own     [G g] fp32, thread-major: the kElemsPerThread values of lane l of group gi at (gi kLanes + l) 16
// (P2PRuntime::plan computes the same sizes, shot_sender_need, to check that a call fits.) A region is
// written again two calls later: by then every peer has finished the call that read it (its push flag of
// the call in between says it started that one). Two-shot calls never touch these regions, nor one-shot
// calls the two-shot slots. A one-shot call is one launch (the whole message, chunk_begin 0).
struct ShotRegion {
  uint8_t* codes;
  uint16_t* scales;
  uint16_t* zeros;
  float* own;
  int64_t code_slot;
  int64_t groups;
};

__device__ __forceinline__ int64_t round_up256(int64_t v) { return (v + 255) / 256 * 256; }

template <int kWorld, int kBits, int kLanes>
__device__ __forceinline__ ShotRegion shot_region(const P2PAllReduceArgs& a, int d, int sender, uint64_t epoch) {
  const int64_t G = a.chunk_groups;
  ShotRegion r;
  r.code_slot = round_up256(G * kGroupCodeBytes<kBits, kLanes>);
  r.groups = G;
  uint8_t* base = a.shot[d] + (int64_t(epoch & 1) * kWorld + sender) * a.shot_sender_bytes;
  r.codes = base;
  r.scales = reinterpret_cast<uint16_t*>(base + kWorld * r.code_slot);
  r.zeros = r.scales + kWorld * G;
  r.own = reinterpret_cast<float*>(base + kWorld * r.code_slot + round_up256(4 * kWorld * G));
  return r;
}

// Group gi of segment j in a one-shot region, as store_packet_group and load_packet_group write and read a slot.
template <int kBits, int kLanes>
__device__ __forceinline__ void store_shot_group(const ShotRegion& r, int j, int64_t gi, int lane, bool packed,
                                                 const Codes<kBits>& codes, const GroupParams& p) {
  store_codes<kBits, kLanes>(r.codes + j * r.code_slot + gi * kGroupCodeBytes<kBits, kLanes>, lane, codes);
  if (lane == 0) {
    const int64_t i = j * r.groups + gi;
    if (packed) {
      r.scales[i] = pack_params<kBits>(p);
    } else {
      r.scales[i] = p.scale_bits;
      r.zeros[i] = p.zero_bits;
    }
  }
}
template <int kBits, int kLanes>
__device__ __forceinline__ Codes<kBits> load_shot_group(const ShotRegion& r, int j, int64_t gi, int lane, bool packed,
                                                        GroupParams& p) {
  const int64_t i = j * r.groups + gi;
  const uint16_t scale_bits = r.scales[i];
  p = packed ? params_from_word<kBits>(scale_bits) : params_from_bits(scale_bits, r.zeros[i]);
  return load_codes<kBits, kLanes>(r.codes + j * r.code_slot + gi * kGroupCodeBytes<kBits, kLanes>, lane);
}

// The parameters a receiver reads back for p (table_params of what store_packet_group wrote).
template <int kBits>
__device__ __forceinline__ GroupParams stored_params(const GroupParams& p, bool packed) {
  return packed ? params_from_word<kBits>(pack_params<kBits>(p)) : params_from_bits(p.scale_bits, p.zero_bits);
}

// One block per SM at up to 255 registers: at two (128 registers, as the two-shot kernel) ptxas spilled. Its grids
// are small (the messages are), and P2PRuntime gives it half the two-shot grid cap, so that the co-resident
// blocks of every rank still fit (kOneShotMinBlocks).
constexpr int kOneShotMinBlocks = 1;

template <typename T, int kWorld, int kBits, int kGroupSize>
__global__ void ECHO_KERNEL_BOUNDS(kOneShotMinBlocks) p2p_one_shot_kernel(const P2PAllReduceArgs a) {
  constexpr int kLanes = kGroupSize / kElemsPerThread;
  constexpr int kPerItem = kGroupsPerBlockItem<kLanes>;
  __shared__ uint64_t epoch_shared;
  __shared__ RangeWatch range;  // pow2 0: this block's range events
  const int me = a.rank;
  const int lane = static_cast<int>(threadIdx.x % kLanes);
  const int64_t seg_elems = a.layout.groups_per_segment * kGroupSize;
  const int64_t G = a.chunk_groups;  // the whole segment (chunk_begin 0)
  const int64_t numel = a.layout.numel;
  P2PControl* control = a.control;
  P2PFlags* mine = a.flags[me];

  const auto [epoch, tag] = begin_launch<true>(a, epoch_shared, &range);
  const bool watch = a.pow2 == 0;
  const bool packed = a.push_out.packed != 0;  // the parameters' format (P2PRuntime sets it in every table)
  const int k = call_exponent<T, kWorld, kLanes>(a, tag, me, control, mine);

  // A. this block's groups of every segment: a sent segment's quantized into every rank's region for this
  // sender (its own included: it reduces that segment too), the own segment's in fp32 into every peer's.
  for (int64_t base = int64_t(blockIdx.x) * kPerItem; base < G; base += int64_t(gridDim.x) * kPerItem) {
    const int64_t gi = base + threadIdx.x / kLanes;
    if (gi >= G) continue;
#pragma unroll 1
    for (int j = 0; j < kWorld; ++j) {
      const int64_t e = int64_t(j) * seg_elems + gi * kGroupSize;
      float v[kElemsPerThread];
      StateWords m;
      contribution<T, kLanes>(a.src, e, lane, numel, k, v, m);
      if (j == me) {
#pragma unroll 1
        for (int d = 0; d < kWorld; ++d) {
          if (d == me) continue;
          float4* dst = reinterpret_cast<float4*>(shot_region<kWorld, kBits, kLanes>(a, d, me, epoch).own +
                                                  (gi * kLanes + lane) * kElemsPerThread);
#pragma unroll
          for (int i = 0; i < kElemsPerThread / 4; ++i) {
            dst[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
          }
        }
        continue;
      }
      Codes<kBits> codes;
      const GroupParams p = quantize_group<kBits, kLanes>(v, a.quantizer, lane, codes);
#pragma unroll 1
      for (int d = 0; d < kWorld; ++d) {
        store_shot_group<kBits, kLanes>(shot_region<kWorld, kBits, kLanes>(a, d, me, epoch), j, gi, lane, packed, codes,
                                        p);
      }
      note_quantized<kBits, kLanes>(a, &range, watch, v, codes, p, e, lane, k, m);
    }
  }
  signal_peers<kWorld, false>(a, tag);
  wait_peers<kWorld>(a, mine->push, tag, kWaitReduce);

  // B + C. this block's groups of every segment: the ordered fp32 sum (the owner's term from its fp32 copy,
  // or formed here for this rank's own segment), requantized once, then decoded into y at once.
  for (int64_t base = int64_t(blockIdx.x) * kPerItem; base < G; base += int64_t(gridDim.x) * kPerItem) {
    const int64_t gi = base + threadIdx.x / kLanes;
    if (gi >= G) continue;
#pragma unroll 1
    for (int s = 0; s < kWorld; ++s) {
      const int64_t e = int64_t(s) * seg_elems + gi * kGroupSize;
      float acc[kElemsPerThread];  // the owner's term
      StateWords m;  // this rank's state words of the group, where it owns s (residual "local" updates them)
      if (s == me) {
        contribution<T, kLanes>(a.src, e, lane, numel, k, acc, m);
      } else {
        const float4* own = reinterpret_cast<const float4*>(shot_region<kWorld, kBits, kLanes>(a, me, s, epoch).own +
                                                            (gi * kLanes + lane) * kElemsPerThread);
#pragma unroll
        for (int i = 0; i < kElemsPerThread / 4; ++i) {
          const float4 w = own[i];
          acc[4 * i] = w.x;
          acc[4 * i + 1] = w.y;
          acc[4 * i + 2] = w.z;
          acc[4 * i + 3] = w.w;
        }
      }
      // The sum ((t_0 + t_1) + ...) + t_{P-1} in rank order, t_s the owner's term, the others decoded from their
      // codes.
      float sum[kElemsPerThread];
      sum_in_rank_order<kWorld>(sum, [&](int r, float (&t)[kElemsPerThread]) {
        if (r == s) {
#pragma unroll
          for (int i = 0; i < kElemsPerThread; ++i) t[i] = acc[i];
        } else {
          GroupParams p;
          const Codes<kBits> copy =
              load_shot_group<kBits, kLanes>(shot_region<kWorld, kBits, kLanes>(a, me, r, epoch), s, gi, lane, packed, p);
          decode<kBits>(copy, p.scale, p.zero, t);
        }
      });
      Codes<kBits> codes;
      const GroupParams p = quantize_group<kBits, kLanes>(sum, a.quantizer, lane, codes);
      if (s == me) note_quantized<kBits, kLanes>(a, &range, watch, sum, codes, p, e, lane, k, m);  // the owner's share
      if (a.update_output || e < numel) tail_group<T, kWorld, kBits, kLanes>(a, e, lane, k, codes, stored_params<kBits>(p, packed));
    }
  }

  end_launch_watching(a, range, epoch, watch);
}

// The same call without quantization (a custom all-reduce like vLLM's two-shot one): the in-run 16-bit
// baseline of the benchmarks, through the same flags, epochs, control block, error record and chunks. The
// slots hold x's own words; the owner sums the P copies of its segment in fp32 in rank order (its own
// from x) and rounds once to T (saturated, nearest even, as echo_ds.algorithm.from_segments rounds), which
// every rank then copies out: y = T(((x_0 + x_1) + ...) + x_{P-1}), bit-identical on every rank. Groups of
// kPlainGroupSize elements only shape the work and the slots (nothing is quantized); a.push_out,
// reduce_in, reduce_out and gathered give the slots' code pointers as raw bytes.
constexpr int kPlainGroupSize = 256;

template <typename T, int kWorld>
__global__ void ECHO_KERNEL_BOUNDS(kFusedMinBlocks) p2p_plain_all_reduce_kernel(const P2PAllReduceArgs a) {
  constexpr int kLanes = kPlainGroupSize / kElemsPerThread;
  constexpr int64_t kSlotBound = INT64_MAX;  // slots hold whole groups: no element of a slot is padding
  __shared__ uint64_t epoch_shared;
  const int me = a.rank;
  const int lane = static_cast<int>(threadIdx.x % kLanes);
  const int64_t seg_elems = a.layout.groups_per_segment * kPlainGroupSize;
  const int64_t G = a.chunk_groups;
  const int64_t numel = a.layout.numel;
  const T* x = static_cast<const T*>(a.src.x);
  const bool x_vec = aligned16(a.src.x);
  const auto slot = [](uint8_t* codes) { return reinterpret_cast<T*>(codes); };
  const auto element = [&](int seg, int64_t gl) { return int64_t(seg) * seg_elems + (a.chunk_begin + gl) * kPlainGroupSize; };

  const auto [epoch, tag] = begin_launch<false>(a, epoch_shared, nullptr);  // no range words: no range events
  P2PFlags* mine = a.flags[me];

  // A. entry: the segments this rank sends, x's words into each owner's push slot.
  for_block_groups<kLanes>(G, [&](int64_t gl) {
#pragma unroll 1
    for (int j = 0; j < kWorld; ++j) {
      if (j == me) continue;
      float v[kElemsPerThread];
      load_thread<T, kLanes>(x, element(j, gl), lane, numel, x_vec, v);
      store_thread<T, kLanes>(slot(a.push_out.codes[j]), gl * kPlainGroupSize, lane, kSlotBound, true, v);
    }
  });
  signal_peers<kWorld, false>(a, tag);

  // B. owner reduce: the fp32 sum in rank order, rounded once, into every rank's gather slot.
  wait_peers<kWorld>(a, mine->push, tag, kWaitReduce);
  for_block_groups<kLanes>(G, [&](int64_t gl) {
    float acc[kElemsPerThread];
    sum_in_rank_order<kWorld>(acc, [&](int r, float (&t)[kElemsPerThread]) {
      if (r == me) {
        load_thread<T, kLanes>(x, element(me, gl), lane, numel, x_vec, t);
      } else {
        load_thread<T, kLanes>(slot(a.reduce_in.codes[r]), gl * kPlainGroupSize, lane, kSlotBound, true, t);
      }
    });
#pragma unroll
    for (int d = 0; d < kWorld; ++d) {
      store_thread<T, kLanes>(slot(a.reduce_out.codes[d]), gl * kPlainGroupSize, lane, kSlotBound, true, acc);
    }
  });
  signal_peers<kWorld, true>(a, tag);

  // C. tail: every segment's sum into y.
  wait_peers<kWorld>(a, mine->gather, tag, kWaitTail);
  const bool y_vec = aligned16(a.out);
  for_block_groups<kLanes>(G, [&](int64_t gl) {
#pragma unroll 1
    for (int seg = 0; seg < kWorld; ++seg) {
      const int64_t e = element(seg, gl);
      if (e >= numel) continue;
      float v[kElemsPerThread];
      load_thread<T, kLanes>(slot(a.gathered.codes[seg]), gl * kPlainGroupSize, lane, kSlotBound, true, v);
      store_thread<T, kLanes>(static_cast<T*>(a.out), e, lane, numel, y_vec, v);
    }
  });

  finish_launch(a.control, epoch);
}

template <typename T, int kWorld>
void launch_p2p_plain_all_reduce_kernel(const P2PAllReduceArgs& a, cudaStream_t stream) {
  p2p_plain_all_reduce_kernel<T, kWorld><<<a.num_blocks, kThreadsPerBlock, 0, stream>>>(a);
  ECHO_CHECK(cudaGetLastError());
}

// Launches the instantiation of (T, kWorld) for the configuration of a (the host checks are the caller's).
template <typename T, int kWorld>
void launch_p2p_all_reduce_kernel(const P2PAllReduceArgs& a, cudaStream_t stream) {
  ECHO_DISPATCH_BITS(a.bits, kBits, ECHO_DISPATCH_GROUP_SIZE(a.layout.group_size, kGroup, {
    p2p_all_reduce_kernel<T, kWorld, kBits, kGroup><<<a.num_blocks, kThreadsPerBlock, 0, stream>>>(a);
    ECHO_CHECK(cudaGetLastError());
  }));
}

// Launches the one-shot instantiation of (T, kWorld) for the configuration of a (16-bit x only).
template <typename T, int kWorld>
void launch_p2p_one_shot_kernel(const P2PAllReduceArgs& a, cudaStream_t stream) {
  ECHO_DISPATCH_BITS(a.bits, kBits, ECHO_DISPATCH_GROUP_SIZE(a.layout.group_size, kGroup, {
    p2p_one_shot_kernel<T, kWorld, kBits, kGroup><<<a.num_blocks, kThreadsPerBlock, 0, stream>>>(a);
    ECHO_CHECK(cudaGetLastError());
  }));
}

// One translation unit per (dtype, world size) instantiates both kernels (p2p_all_reduce_<dtype>_p<P>.cu),
// so that the nine build in parallel: `extern` here, `template` there.
#define ECHO_P2P_KERNELS(kind, T, P)                                                        \
  kind template void launch_p2p_all_reduce_kernel<T, P>(const P2PAllReduceArgs&, cudaStream_t); \
  kind template void launch_p2p_plain_all_reduce_kernel<T, P>(const P2PAllReduceArgs&, cudaStream_t);
#define ECHO_P2P_EXTERN_KERNELS(T) \
  ECHO_P2P_KERNELS(extern, T, 2) ECHO_P2P_KERNELS(extern, T, 4) ECHO_P2P_KERNELS(extern, T, 8)
// The one-shot kernels, for 16-bit x at P = 2 and 4 only (at P = 8 ptxas spilled at 128 registers; those calls
// take the two-shot kernel), in units of their own (p2p_one_shot_<f16|bf16>_p<P>.cu).
#define ECHO_P2P_ONE_SHOT_KERNELS(kind, T, P) \
  kind template void launch_p2p_one_shot_kernel<T, P>(const P2PAllReduceArgs&, cudaStream_t);
#define ECHO_P2P_EXTERN_ONE_SHOT_KERNELS(T) ECHO_P2P_ONE_SHOT_KERNELS(extern, T, 2) ECHO_P2P_ONE_SHOT_KERNELS(extern, T, 4)
#ifndef ECHO_P2P_INSTANTIATING
ECHO_P2P_EXTERN_KERNELS(float)
ECHO_P2P_EXTERN_KERNELS(__half)
ECHO_P2P_EXTERN_KERNELS(__nv_bfloat16)
ECHO_P2P_EXTERN_ONE_SHOT_KERNELS(__half)
ECHO_P2P_EXTERN_ONE_SHOT_KERNELS(__nv_bfloat16)
#endif

}  // namespace detail
}  // namespace echo
