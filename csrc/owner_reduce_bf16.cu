// Stage 2, owner reduce: the compensated instantiations for __nv_bfloat16 x (owner_reduce.cuh).
#define ECHO_OWNER_REDUCE_INSTANTIATING
#include "owner_reduce.cuh"

namespace echo::detail {
ECHO_OWNER_REDUCE_KERNELS(, false, __nv_bfloat16)
}  // namespace echo::detail
