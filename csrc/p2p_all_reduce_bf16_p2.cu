// The one-launch kernels for __nv_bfloat16 x at P = 2 (p2p_all_reduce.cuh).
#define ECHO_P2P_INSTANTIATING
#include "p2p_all_reduce.cuh"

namespace echo::detail {
ECHO_P2P_KERNELS(, __nv_bfloat16, 2)
}  // namespace echo::detail
