// The one-launch kernels for float x at P = 2 (p2p_all_reduce.cuh).
#define ECHO_P2P_INSTANTIATING
#include "p2p_all_reduce.cuh"

namespace echo::detail {
ECHO_P2P_KERNELS(, float, 2)
}  // namespace echo::detail
