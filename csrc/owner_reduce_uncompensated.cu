// Stage 2, owner reduce: the uncompensated instantiations (no compensation, rotation or residual), in a
// translation unit of their own so that they build beside the compensated ones (owner_reduce.cuh).
#define ECHO_OWNER_REDUCE_INSTANTIATING
#include "owner_reduce.cuh"

namespace echo::detail {
ECHO_OWNER_REDUCE_KERNELS(, true, float)
ECHO_OWNER_REDUCE_KERNELS(, true, __half)
ECHO_OWNER_REDUCE_KERNELS(, true, __nv_bfloat16)
}  // namespace echo::detail
