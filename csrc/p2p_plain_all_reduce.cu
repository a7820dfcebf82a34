// The unquantized one-launch kernels (the 16-bit baseline of the same family) for every dtype and world size
// (p2p_all_reduce.cuh).
#define ECHO_P2P_INSTANTIATING
#include "p2p_all_reduce.cuh"

namespace echo::detail {
ECHO_P2P_PLAIN_KERNELS(, float, 2) ECHO_P2P_PLAIN_KERNELS(, float, 4) ECHO_P2P_PLAIN_KERNELS(, float, 8)
ECHO_P2P_PLAIN_KERNELS(, __half, 2) ECHO_P2P_PLAIN_KERNELS(, __half, 4) ECHO_P2P_PLAIN_KERNELS(, __half, 8)
ECHO_P2P_PLAIN_KERNELS(, __nv_bfloat16, 2) ECHO_P2P_PLAIN_KERNELS(, __nv_bfloat16, 4)
ECHO_P2P_PLAIN_KERNELS(, __nv_bfloat16, 8)
}  // namespace echo::detail
