// The peer-to-peer transport of Echo (section 4.2 and appendix C of the paper): the memory layout of
// the signal words, the per-rank control block, the error record and the launch parameters of the
// transport kernels. Plain C++ structs of fixed-width fields, so that the host compiler, nvcc and the
// Python mirror (echo_ds/p2p/layout.py, ctypes) all see the same bytes; every size and every
// offset the Python side relies on is pinned by a static_assert here and exported in echo_p2p_layout (echo_p2p_kernels.cu).
//
// Flags (NOTE: the invariants the whole protocol rests on):
//  * A flag is one aligned 32-bit word. It is never cleared and never written sub-word. Its owner's
//    peers write it with a system-scope release after the data it announces; its reader polls it with
//    system-scope acquire loads.
//  * Call c (1-based, counted on the device) has the flag base B(c) = 3c mod 2^32. The entry/push stage
//    publishes B + kStagePush, the gather stage B + kStageGather; B + kStageReduce is reserved (no stage
//    publishes it). Every put and signal also writes its value into the rank's own progress word. The
//    base lives in device memory (EchoP2PControl::base) and is raised by 3 by a kernel at the start of
//    every call, so a CUDA graph replay advances it like an eager call.
//  * A waiter is released when the flag EQUALS the value it expects. The protocol guarantees that a
//    slot holds either a value of an older call or exactly the expected one while its waiter looks (the
//    writer's next write to that slot depends, through the pipeline, on the waiter having finished), so
//    equality is what ">=" means here, and unlike a serial-number ">=" it cannot be released by a slot
//    left untouched for more than 2^31 calls.
#pragma once

#include <cstddef>
#include <cstdint>
#define ECHO_P2P_OFFSETOF(type, field) offsetof(type, field)

// Largest tensor-parallel group (the issue plans for P = 2, 4, 8).
constexpr int kEchoMaxWorld = 8;
// Largest number of tiles per segment; a schedule with more enlarges its tiles instead.
constexpr int kEchoMaxTiles = 64;
// Copies one put launch can carry: codes, scales and zeros of one tile for each of the P - 1 peers.
constexpr int kEchoMaxCopies = 3 * (kEchoMaxWorld - 1);
constexpr int kEchoMaxFlags = kEchoMaxWorld - 1;

// Stage offsets added to the call's flag base.
constexpr uint32_t kStagePush = 0;
constexpr uint32_t kStageReduce = 1;
constexpr uint32_t kStageGather = 2;
constexpr uint32_t kStagesPerCall = 3;

// Stage ids of the error record (what a waiter was waiting for).
constexpr uint32_t kWaitAmax = 0;    // the pow2 rescaling's max exchange, before push
constexpr uint32_t kWaitReduce = 1;  // the owner's reduce waits for its peers' pushes
constexpr uint32_t kWaitTail = 2;    // tail waits for the owners' gathers
constexpr uint32_t kWaitProbe = 3;   // the constructor's write-and-verify probe

constexpr uint32_t kErrorNone = 0;
constexpr uint32_t kErrorTimeout = 1;
constexpr uint32_t kErrorAborted = 2;

// The signal words of one rank, written by its peers (the third of the 3P + 1 table entries).
struct EchoP2PSignals {
  uint32_t push[kEchoMaxWorld][kEchoMaxTiles];    // [src][tile]: src's codes of tile for me arrived
  uint32_t gather[kEchoMaxWorld][kEchoMaxTiles];  // [owner][tile]: owner's reduced codes arrived
  uint32_t amax_flag[kEchoMaxWorld];              // [src]: src's amax (pow2 rescaling) arrived
  float amax[kEchoMaxWorld];                      // [src]
  uint32_t probe[kEchoMaxWorld][4];               // [src]: the constructor's write-and-verify words
  uint32_t progress;                              // last value this rank published (diagnostics)
  uint32_t reserved[31];
};
static_assert(sizeof(EchoP2PSignals) == 4096 + 32 + 32 + 128 + 128, "EchoP2PSignals size");
static_assert(ECHO_P2P_OFFSETOF(EchoP2PSignals, gather) == 2048, "EchoP2PSignals::gather");
static_assert(ECHO_P2P_OFFSETOF(EchoP2PSignals, amax_flag) == 4096, "EchoP2PSignals::amax_flag");
static_assert(ECHO_P2P_OFFSETOF(EchoP2PSignals, amax) == 4128, "EchoP2PSignals::amax");
static_assert(ECHO_P2P_OFFSETOF(EchoP2PSignals, probe) == 4160, "EchoP2PSignals::probe");
static_assert(ECHO_P2P_OFFSETOF(EchoP2PSignals, progress) == 4288, "EchoP2PSignals::progress");

// Per-rank control block in local device memory (the "+1" of the table: the flag base).
struct EchoP2PControl {
  uint32_t base;        // flag base of the current call, B(c) = 3c mod 2^32
  uint32_t call_index;  // c: calls begun on this rank (graph replays included)
  uint32_t poisoned;    // set once a wait timed out or was aborted: later waits return at once
  uint32_t reserved0;
  uint32_t arrivals[8];  // last-block-done counters of the put kernels, one per launch lane
  uint32_t reserved[20];
};
static_assert(sizeof(EchoP2PControl) == 128, "EchoP2PControl size");
static_assert(ECHO_P2P_OFFSETOF(EchoP2PControl, arrivals) == 16, "EchoP2PControl::arrivals");

// Written by the device into mapped pinned host memory; the host reads it without synchronising.
// The first wait that fails fills it; `code` is written last, after a system fence.
struct EchoP2PErrorRecord {
  uint32_t code;  // kError*
  uint32_t rank;
  uint32_t peer;
  uint32_t stage;  // kWait*
  uint32_t tile;
  uint32_t call_index;
  uint32_t expected;
  uint32_t seen;
  uint64_t waited_ns;
  uint32_t abort_request;  // written by the host: every wait gives up at once (close, exit)
  uint32_t reserved[5];
};
static_assert(sizeof(EchoP2PErrorRecord) == 64, "EchoP2PErrorRecord size");
static_assert(ECHO_P2P_OFFSETOF(EchoP2PErrorRecord, waited_ns) == 32, "EchoP2PErrorRecord::waited_ns");
static_assert(ECHO_P2P_OFFSETOF(EchoP2PErrorRecord, abort_request) == 40, "EchoP2PErrorRecord::abort");

// The fixed address table of a group, 3P + 1 entries (appendix C): the P code buffers, the P
// parameter buffers, the P signal arrays and this rank's flag base. Peers' entries are the addresses
// at which this process mapped their memory.
struct EchoP2PTable {
  uint64_t codes[kEchoMaxWorld];
  uint64_t params[kEchoMaxWorld];
  uint64_t signals[kEchoMaxWorld];
  uint64_t flag_base;
  uint64_t reserved[7];
};
static_assert(sizeof(EchoP2PTable) == 256, "EchoP2PTable size");
static_assert(ECHO_P2P_OFFSETOF(EchoP2PTable, flag_base) == 192, "EchoP2PTable::flag_base");

// echo_p2p_put_kernel: copy byte ranges (local -> peers' buffers), then publish one flag per peer.
struct EchoP2PPutParams {
  uint64_t src[kEchoMaxCopies];
  uint64_t dst[kEchoMaxCopies];
  uint64_t num_bytes[kEchoMaxCopies];
  uint64_t flag[kEchoMaxFlags];  // peers' signal words (in their EchoP2PSignals)
  uint64_t control;              // this rank's EchoP2PControl
  uint64_t local_progress;       // this rank's EchoP2PSignals::progress
  uint32_t num_copies;
  uint32_t num_flags;
  uint32_t stage_offset;  // published value = control->base + stage_offset
  uint32_t lane;          // which arrival counter (one per stream that launches puts)
};
static_assert(sizeof(EchoP2PPutParams) == 3 * 8 * kEchoMaxCopies + 8 * kEchoMaxFlags + 16 + 16,
              "EchoP2PPutParams size");
static_assert(ECHO_P2P_OFFSETOF(EchoP2PPutParams, flag) == 504, "EchoP2PPutParams::flag");
static_assert(ECHO_P2P_OFFSETOF(EchoP2PPutParams, num_copies) == 576, "EchoP2PPutParams::num_copies");

// echo_p2p_wait_kernel: spin until every flag equals control->base + stage_offset (or `value` when
// use_base is 0), or the timeout passes.
struct EchoP2PWaitParams {
  uint64_t flag[kEchoMaxFlags];  // this rank's own signal words
  uint32_t peer[kEchoMaxFlags];  // which peer writes each flag (for the error record)
  uint32_t pad0;
  uint64_t control;
  uint64_t error;  // device address of the mapped EchoP2PErrorRecord
  uint64_t timeout_ns;
  uint32_t num_flags;
  uint32_t stage_offset;
  uint32_t use_base;
  uint32_t value;
  uint32_t rank;
  uint32_t stage;  // kWait*
  uint32_t tile;
  uint32_t pad1;
};
static_assert(sizeof(EchoP2PWaitParams) == 56 + 32 + 24 + 32, "EchoP2PWaitParams size");
static_assert(ECHO_P2P_OFFSETOF(EchoP2PWaitParams, control) == 88, "EchoP2PWaitParams::control");
static_assert(ECHO_P2P_OFFSETOF(EchoP2PWaitParams, num_flags) == 112, "EchoP2PWaitParams::num_flags");

// echo_p2p_begin_call_kernel / echo_p2p_signal_kernel (a flag write with no data, for stages whose
// data a kernel already wrote straight into the peers' buffers).
struct EchoP2PSignalParams {
  uint64_t flag[kEchoMaxFlags];
  uint64_t control;
  uint64_t local_progress;
  uint32_t num_flags;
  uint32_t stage_offset;
  uint32_t use_base;
  uint32_t value;
};
static_assert(sizeof(EchoP2PSignalParams) == 56 + 16 + 16, "EchoP2PSignalParams size");

// Sizes and offsets, in this order, as the kernels' image exports them (echo_p2p_layout) and the
// Python mirror checks them at load time.
#define ECHO_P2P_LAYOUT_LIST(X)                          \
  X(sizeof(EchoP2PSignals))                              \
  X(ECHO_P2P_OFFSETOF(EchoP2PSignals, gather))           \
  X(ECHO_P2P_OFFSETOF(EchoP2PSignals, amax_flag))        \
  X(ECHO_P2P_OFFSETOF(EchoP2PSignals, amax))             \
  X(ECHO_P2P_OFFSETOF(EchoP2PSignals, probe))            \
  X(ECHO_P2P_OFFSETOF(EchoP2PSignals, progress))         \
  X(sizeof(EchoP2PControl))                              \
  X(sizeof(EchoP2PErrorRecord))                          \
  X(ECHO_P2P_OFFSETOF(EchoP2PErrorRecord, abort_request)) \
  X(sizeof(EchoP2PTable))                                \
  X(sizeof(EchoP2PPutParams))                            \
  X(ECHO_P2P_OFFSETOF(EchoP2PPutParams, num_copies))     \
  X(sizeof(EchoP2PWaitParams))                           \
  X(ECHO_P2P_OFFSETOF(EchoP2PWaitParams, num_flags))     \
  X(sizeof(EchoP2PSignalParams))                         \
  X(kEchoMaxWorld)                                       \
  X(kEchoMaxTiles)                                       \
  X(kEchoMaxCopies)
