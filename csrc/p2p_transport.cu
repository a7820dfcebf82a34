// The staged pipeline's transport: the call's flag base, peer puts that publish a flag after their data,
// and waits that give up after a timeout (echo_api.cuh declares the launches, echo_p2p.h lays out the
// memory and states the flag protocol). The Echo stages themselves (quantize, reduce, dequantize) are
// not here; these kernels only move bytes and order them across GPUs.
#include "echo_api.cuh"
#include "echo_check.cuh"
#include "echo_sync.cuh"

namespace echo {
namespace {

static_assert(kEchoMaxWorld == kMaxWorldSize, "echo_p2p.h and echo_api.cuh size groups alike");
static_assert(sizeof(EchoP2PControl::arrivals) / sizeof(uint32_t) == kP2PNumLanes, "one arrival counter per lane");

// Put launches: bytes per block and threads per block. 512 threads x 16-byte vectors keep 8 KiB in
// flight per block; one block per 256 KiB of a tile keeps a 1 MiB tile on 4 blocks per peer and a
// whole segment's put well under the 132 SMs (placeholder until the multi-GPU measurement, issue 8).
constexpr int kPutThreads = 512;
constexpr uint64_t kPutBytesPerBlock = 256 * 1024;
constexpr uint64_t kPutMaxBlocks = 128;
// Signal and wait: one warp, a thread per flag.
constexpr int kFlagThreads = 32;
static_assert(kP2PMaxFlags <= kFlagThreads, "a thread per flag");

using detail::global_timer_ns;
using detail::ld_acquire_sys;
using detail::st_release_sys;

__device__ __forceinline__ uint32_t ld_volatile(const uint32_t* addr) {
  return *reinterpret_cast<const volatile uint32_t*>(addr);
}

// Copies num_bytes from src to dst with the widest access both addresses and the length allow.
// Threads of all blocks in `group` stride over the range.
__device__ void copy_range(const unsigned char* src, unsigned char* dst, uint64_t num_bytes,
                           uint64_t thread, uint64_t num_threads) {
  const uint64_t misalign = (reinterpret_cast<uint64_t>(src) | reinterpret_cast<uint64_t>(dst)) & 15;
  uint64_t done = 0;
  if (misalign == 0) {
    const uint64_t num_vec = num_bytes / 16;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (uint64_t i = thread; i < num_vec; i += num_threads) d[i] = s[i];
    done = num_vec * 16;
  } else if ((misalign & 3) == 0) {
    const uint64_t num_words = num_bytes / 4;
    const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    for (uint64_t i = thread; i < num_words; i += num_threads) d[i] = s[i];
    done = num_words * 4;
  }
  for (uint64_t i = done + thread; i < num_bytes; i += num_threads) dst[i] = src[i];
}

// One thread, first thing of every call on the caller's stream: B(c) = 3c. Graph replays run it too,
// so the base lives on the device and a replayed graph never re-uses a captured value (the frozen
// host counter of QuickReduce's graph bug).
__global__ void echo_p2p_begin_call_kernel(EchoP2PControl* control) {
  const uint32_t call = control->call_index + 1;
  control->call_index = call;
  control->base = call * kStagesPerCall;
}

// grid (num_blocks), block (threads): all copies, striped over the whole grid, then the last block to
// finish publishes every flag.
__global__ void echo_p2p_put_kernel(const P2PPutArgs p) {
  EchoP2PControl* control = p.control;
  const uint64_t thread = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t num_threads = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint32_t c = 0; c < p.num_copies; ++c) {
    copy_range(static_cast<const unsigned char*>(p.src[c]), static_cast<unsigned char*>(p.dst[c]), p.num_bytes[c],
               thread, num_threads);
  }
  if (p.num_flags == 0) return;
  __shared__ uint32_t is_last;
  // NOTE: each thread's peer writes are made visible system-wide before its block counts itself in:
  // __syncthreads orders them before thread 0's fence, whose cumulativity covers the whole block.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    // atomicInc wraps to 0 after gridDim.x arrivals, so the counter is back to 0 for the next launch on
    // this lane (launches of one lane are ordered by their stream).
    const uint32_t prev = atomicInc(&control->arrivals[p.lane], gridDim.x - 1);
    is_last = (prev == gridDim.x - 1);
  }
  __syncthreads();
  if (!is_last) return;
  // A rank whose wait failed publishes no flag (its data was formed from what it never received; a peer
  // that arrives late must time out, not take it: csrc/p2p_all_reduce.cuh, rank_failed).
  if (threadIdx.x < p.num_flags && ld_volatile(&control->poisoned) == 0) {
    // NOTE: the other blocks' data writes happen-before their fence and arrival; this block acquired
    // them through the atomic and the fence below, and the release store publishes them with the flag.
    __threadfence_system();
    const uint32_t value = control->base + p.stage_offset;
    st_release_sys(p.flag[threadIdx.x], value);
    if (threadIdx.x == 0 && p.local_progress) *reinterpret_cast<volatile uint32_t*>(p.local_progress) = value;
  }
}

// A flag write with no data: for a stage whose kernel wrote its data into the peers' buffers itself
// (earlier on this stream). One block of at least num_flags threads.
__global__ void echo_p2p_signal_kernel(const P2PSignalArgs p) {
  const EchoP2PControl* control = p.control;
  if (threadIdx.x < p.num_flags && ld_volatile(&control->poisoned) == 0) {  // as the put kernel
    // NOTE: the data was written by earlier kernels of this stream; they completed before this one
    // started, and the system fence orders their writes, as this thread observes them, before the flag.
    __threadfence_system();
    const uint32_t value = p.use_base ? control->base + p.stage_offset : p.value;
    st_release_sys(p.flag[threadIdx.x], value);
    if (threadIdx.x == 0 && p.local_progress) *reinterpret_cast<volatile uint32_t*>(p.local_progress) = value;
  }
}

// One block of 32 threads; thread i < num_flags polls flag i. Gives up after timeout_ns (then fills the
// error record once per rank and poisons the control block so that every later wait returns at once),
// or at once when the host asked to abort or an earlier wait failed.
//
// Why a kernel and not cuStreamWaitValue32: measured with two ranks on one GPU under MPS (benchmarks/RESULTS.md,
// "P2P transport", "Flag round trip"), the memops hand a flag over faster than signal + wait kernels, in a
// CUDA graph and host-launched. They are still not used, because a memop wait can neither time out (a dead peer would hang the
// survivor's stream for good; here the wait ends after timeout_ns with an error naming rank, peer, stage
// and call) nor take its value from device memory (a captured graph would replay the captured value, and
// re-arming every wait node per replay costs host work; here the value comes from control->base). The
// way to beat both is to poll inside the consumer kernels themselves (no launch at all): docs/p2p.md.
__global__ void echo_p2p_wait_kernel(const P2PWaitArgs p) {
  EchoP2PControl* control = p.control;
  EchoP2PErrorRecord* error = p.error;
  const uint32_t expected = p.use_base ? control->base + p.stage_offset : p.value;
  const uint32_t i = threadIdx.x;
  if (i < p.num_flags) {
    const uint32_t* flag = p.flag[i];
    const uint64_t start = global_timer_ns();
    uint32_t seen = ld_acquire_sys(flag);
    uint32_t polls = 0;
    while (seen != expected) {
      // The slow checks (clock, abort word in host memory, poison) every 64 polls keep the poll loop on
      // the flag's cache line; 64 polls of an L2-resident word take well under a microsecond.
      if ((++polls & 63) == 0) {
        const uint64_t waited = global_timer_ns() - start;
        const bool aborted = ld_volatile(&error->abort_request) != 0;
        const bool poisoned = ld_volatile(&control->poisoned) != 0;
        if (waited > p.timeout_ns || aborted || poisoned) {
          if (!poisoned && atomicCAS(&control->poisoned, 0u, 1u) == 0u) {
            volatile EchoP2PErrorRecord* e = error;
            e->rank = p.rank;
            e->peer = p.peer[i];
            e->stage = p.stage;
            e->tile = p.tile;
            e->call_index = control->call_index;
            e->expected = expected;
            e->seen = seen;
            e->waited_ns = waited;
            __threadfence_system();
            e->code = aborted ? kErrorAborted : kErrorTimeout;
            __threadfence_system();
          }
          break;
        }
      }
      seen = ld_acquire_sys(flag);
    }
  }
  // NOTE: the acquire loads above order the peers' data before everything this stream runs next
  // (the next kernel starts only after this block has exited).
  __syncthreads();
}

}  // namespace

void launch_p2p_begin_call(EchoP2PControl* control, cudaStream_t stream) {
  ECHO_HOST_ASSERT(control != nullptr, "the control block is required");
  echo_p2p_begin_call_kernel<<<1, 1, 0, stream>>>(control);
  ECHO_CHECK(cudaGetLastError());
}

void launch_p2p_put(const P2PPutArgs& a, cudaStream_t stream) {
  ECHO_HOST_ASSERT(a.control != nullptr, "the control block is required");
  ECHO_HOST_ASSERT(a.num_copies <= static_cast<uint32_t>(kP2PMaxCopies) &&
                       a.num_flags <= static_cast<uint32_t>(kP2PMaxFlags) && a.lane < static_cast<uint32_t>(kP2PNumLanes),
                   "a put carries at most kP2PMaxCopies copies and kP2PMaxFlags flags on one of kP2PNumLanes lanes");
  uint64_t total = 0;
  for (uint32_t c = 0; c < a.num_copies; ++c) total += a.num_bytes[c];
  const uint64_t wanted = (total + kPutBytesPerBlock - 1) / kPutBytesPerBlock;
  const uint64_t blocks = wanted < 1 ? 1 : (wanted > kPutMaxBlocks ? kPutMaxBlocks : wanted);
  echo_p2p_put_kernel<<<static_cast<unsigned>(blocks), kPutThreads, 0, stream>>>(a);
  ECHO_CHECK(cudaGetLastError());
}

void launch_p2p_signal(const P2PSignalArgs& a, cudaStream_t stream) {
  ECHO_HOST_ASSERT(a.control != nullptr, "the control block is required");
  ECHO_HOST_ASSERT(a.num_flags <= static_cast<uint32_t>(kP2PMaxFlags), "a signal writes at most kP2PMaxFlags flags");
  echo_p2p_signal_kernel<<<1, kFlagThreads, 0, stream>>>(a);
  ECHO_CHECK(cudaGetLastError());
}

void launch_p2p_wait(const P2PWaitArgs& a, cudaStream_t stream) {
  ECHO_HOST_ASSERT(a.control != nullptr && a.error != nullptr, "the control block and error record are required");
  ECHO_HOST_ASSERT(a.num_flags <= static_cast<uint32_t>(kP2PMaxFlags), "a wait polls at most kP2PMaxFlags flags");
  echo_p2p_wait_kernel<<<1, kFlagThreads, 0, stream>>>(a);
  ECHO_CHECK(cudaGetLastError());
}

}  // namespace echo
