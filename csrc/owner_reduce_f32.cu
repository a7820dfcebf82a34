// Stage 2, owner reduce: the compensated instantiations for float x (owner_reduce.cuh).
#define ECHO_OWNER_REDUCE_INSTANTIATING
#include "owner_reduce.cuh"

namespace echo::detail {
ECHO_OWNER_REDUCE_KERNELS(, false, float)
}  // namespace echo::detail
