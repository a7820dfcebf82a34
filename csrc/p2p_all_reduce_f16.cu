// The one-launch kernel for __half x (p2p_all_reduce.cuh).
#include "p2p_all_reduce.cuh"

namespace echo {
namespace detail {
template void launch_p2p_all_reduce_kernel<__half>(const P2PAllReduceArgs&, cudaStream_t);
template void launch_p2p_plain_all_reduce_kernel<__half>(const P2PAllReduceArgs&, cudaStream_t);
}  // namespace detail
}  // namespace echo
