// Stage 2, owner reduce: the uncompensated instantiations (no compensation, rotation or residual), in a
// translation unit of their own so that they build beside the full ones (owner_reduce.cuh).
#include "owner_reduce.cuh"

namespace echo {
namespace detail {
template void launch_owner_reduce_kernel<true>(const OwnerReduceArgs&, cudaStream_t);
}  // namespace detail
}  // namespace echo
