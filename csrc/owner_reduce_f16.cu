// Stage 2, owner reduce: the compensated instantiations for __half x (owner_reduce.cuh).
#define ECHO_OWNER_REDUCE_INSTANTIATING
#include "owner_reduce.cuh"

namespace echo::detail {
ECHO_OWNER_REDUCE_KERNELS(, false, __half)
}  // namespace echo::detail
