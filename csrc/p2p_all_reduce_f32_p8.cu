// The one-launch kernels for float x at P = 8 (p2p_all_reduce.cuh).
#define ECHO_P2P_INSTANTIATING
#include "p2p_all_reduce.cuh"

namespace echo::detail {
ECHO_P2P_KERNELS(, float, 8)
}  // namespace echo::detail
