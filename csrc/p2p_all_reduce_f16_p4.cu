// The one-launch kernels for __half x at P = 4 (p2p_all_reduce.cuh).
#define ECHO_P2P_INSTANTIATING
#include "p2p_all_reduce.cuh"

namespace echo::detail {
ECHO_P2P_KERNELS(, __half, 4)
}  // namespace echo::detail
