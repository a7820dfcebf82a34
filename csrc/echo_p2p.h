// The peer-to-peer transport of Echo (section 4.2 and appendix C of the paper): the memory layout of the
// signal words, the per-rank control block and the error record of the staged pipeline's transport
// (p2p_transport.cu; its launches are declared in echo_api.cuh). Plain C++ structs of fixed-width fields,
// so that the host compiler and nvcc see the same bytes; every size and offset the Python side relies on
// is pinned by a static_assert here and exported by ECHO_P2P_LAYOUT_LIST below.
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

// Largest tensor-parallel group (the issue plans for P = 2, 4, 8).
constexpr int kEchoMaxWorld = 8;
// Largest number of tiles per segment; a schedule with more enlarges its tiles instead.
constexpr int kEchoMaxTiles = 64;

// Stage offsets added to the call's flag base.
constexpr uint32_t kStagePush = 0;
constexpr uint32_t kStageReduce = 1;
constexpr uint32_t kStageGather = 2;
constexpr uint32_t kStagesPerCall = 3;

// Stage ids of the error record (what a waiter was waiting for), and its codes: the staged transport's and the
// one-launch kernels' (echo_ds/p2p/protocol.py holds the same table; tests/test_facts.py compares them).
constexpr uint32_t kWaitAmax = 0;    // the pow2 rescaling's max exchange, before push
constexpr uint32_t kWaitReduce = 1;  // the owner's reduce waits for its peers' pushes
constexpr uint32_t kWaitTail = 2;    // tail waits for the owners' gathers
constexpr uint32_t kWaitProbe = 3;   // the constructor's write-and-verify probe

constexpr uint32_t kErrorNone = 0;
constexpr uint32_t kErrorTimeout = 1;
constexpr uint32_t kErrorAborted = 2;
constexpr uint32_t kErrorMismatch = 3;  // the one launch: a peer's flag of this call carries another call descriptor

// The signal words of one rank, written by its peers.
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
static_assert(offsetof(EchoP2PSignals, gather) == 2048, "EchoP2PSignals::gather");
static_assert(offsetof(EchoP2PSignals, amax_flag) == 4096, "EchoP2PSignals::amax_flag");
static_assert(offsetof(EchoP2PSignals, amax) == 4128, "EchoP2PSignals::amax");
static_assert(offsetof(EchoP2PSignals, probe) == 4160, "EchoP2PSignals::probe");
static_assert(offsetof(EchoP2PSignals, progress) == 4288, "EchoP2PSignals::progress");

// Per-rank control block in local device memory: the flag base.
struct EchoP2PControl {
  uint32_t base;        // flag base of the current call, B(c) = 3c mod 2^32
  uint32_t call_index;  // c: calls begun on this rank (graph replays included)
  uint32_t poisoned;    // set once a wait timed out or was aborted: later waits return at once
  uint32_t reserved0;
  uint32_t arrivals[8];  // last-block-done counters of the put kernels, one per launch lane
  uint32_t reserved[20];
};
static_assert(sizeof(EchoP2PControl) == 128, "EchoP2PControl size");
static_assert(offsetof(EchoP2PControl, arrivals) == 16, "EchoP2PControl::arrivals");

// Written by the device into mapped pinned host memory; the host reads it without synchronising. The one
// error record of both transports: the staged transport's waits (p2p_transport.cu) and the one-launch kernels
// (p2p_all_reduce.cuh) fill it; echo_ds/p2p/layout.py reads it through the offsets exported below. The first
// wait that fails fills it; `code` is written last, after a system fence. The range counters are the
// one-launch call's (calls without rescaling whose groups this rank quantized were clipped, or whose largest
// group's scale was below fp16's smallest normal value: algorithm.range_flags); only the device writes them
// and the host reads them whenever it likes (they only grow).
struct EchoP2PErrorRecord {
  uint32_t code;  // kError*
  uint32_t rank;
  uint32_t peer;
  uint32_t stage;       // kWait*
  uint32_t tile;        // the tile (staged) or the block (one launch)
  uint32_t call_index;  // the call (staged); the low 32 bits of the epoch (one launch)
  uint32_t expected;    // the flag value waited for (one launch: the epoch; kErrorMismatch: this rank's descriptor)
  uint32_t seen;        // the value the flag held (one launch: the epoch; kErrorMismatch: the peer's descriptor)
  uint64_t waited_ns;
  uint32_t abort_request;  // written by the host: every wait gives up at once (close, exit)
  uint32_t one_launch;     // 1: written by the one-launch kernel (its flags hold call numbers, tile is a block)
  uint32_t clipped_calls;
  uint32_t underflow_calls;
  uint32_t reserved[2];
};
static_assert(sizeof(EchoP2PErrorRecord) == 64, "EchoP2PErrorRecord size");
static_assert(offsetof(EchoP2PErrorRecord, waited_ns) == 32, "EchoP2PErrorRecord::waited_ns");
static_assert(offsetof(EchoP2PErrorRecord, abort_request) == 40, "EchoP2PErrorRecord::abort");

// What the host needs of this layout, as (name, value): the extension exports it (echo_ds.ops'
// p2p_transport_layout(): the CUDA transport reads the control block and the error record at these
// offsets, and EchoBuffer checks echo_ds/p2p/layout.py against it), and tests/test_kernels_compile.py
// prints it with the host compiler.
#define ECHO_P2P_LAYOUT_LIST(X)                                            \
  X("signals_bytes", sizeof(EchoP2PSignals))                               \
  X("signals.push", offsetof(EchoP2PSignals, push))                        \
  X("signals.gather", offsetof(EchoP2PSignals, gather))                    \
  X("signals.amax_flag", offsetof(EchoP2PSignals, amax_flag))              \
  X("signals.amax", offsetof(EchoP2PSignals, amax))                        \
  X("signals.probe", offsetof(EchoP2PSignals, probe))                      \
  X("signals.progress", offsetof(EchoP2PSignals, progress))                \
  X("signals.reserved", offsetof(EchoP2PSignals, reserved))                \
  X("max_world", kEchoMaxWorld)                                            \
  X("max_tiles", kEchoMaxTiles)                                            \
  X("control_bytes", sizeof(EchoP2PControl))                               \
  X("control.call_index", offsetof(EchoP2PControl, call_index))            \
  X("control.poisoned", offsetof(EchoP2PControl, poisoned))                \
  X("error_bytes", sizeof(EchoP2PErrorRecord))                             \
  X("error.code", offsetof(EchoP2PErrorRecord, code))                      \
  X("error.rank", offsetof(EchoP2PErrorRecord, rank))                      \
  X("error.peer", offsetof(EchoP2PErrorRecord, peer))                      \
  X("error.stage", offsetof(EchoP2PErrorRecord, stage))                    \
  X("error.tile", offsetof(EchoP2PErrorRecord, tile))                      \
  X("error.call_index", offsetof(EchoP2PErrorRecord, call_index))          \
  X("error.expected", offsetof(EchoP2PErrorRecord, expected))              \
  X("error.seen", offsetof(EchoP2PErrorRecord, seen))                      \
  X("error.waited_ns", offsetof(EchoP2PErrorRecord, waited_ns))            \
  X("error.abort_request", offsetof(EchoP2PErrorRecord, abort_request))    \
  X("error.one_launch", offsetof(EchoP2PErrorRecord, one_launch))          \
  X("error.clipped_calls", offsetof(EchoP2PErrorRecord, clipped_calls))    \
  X("error.underflow_calls", offsetof(EchoP2PErrorRecord, underflow_calls))
