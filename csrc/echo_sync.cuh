// The memory-ordering primitives of the p2p protocols, one definition for every kernel that uses them: the
// one-launch kernels' 64-bit epoch|descriptor words (p2p_all_reduce.cuh) and the staged transport's 32-bit
// flags (p2p_transport.cu). A release store at system scope orders this thread's earlier writes, peer
// writes included, before the flag a thread on another GPU polls; an acquire load at system scope orders
// the poller's later reads after it. The waits time out by the global timer (nanoseconds, shared by the
// GPUs of a node closely enough for a timeout of seconds).
#pragma once

#include <cstdint>

namespace echo {
namespace detail {

__device__ __forceinline__ void st_release_sys(uint32_t* addr, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys(uint64_t* addr, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* addr) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* addr) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace detail
}  // namespace echo
