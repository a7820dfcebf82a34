// Stage 2, owner reduce: acc = sum over ranks r = 0 .. P-1 in that order of (own rs if r is the owner,
// else decode(copy of r)), fp32, ((t0 + t1) + t2) + ... (algorithm.ordered_sum); acc is quantized once
// and written to every destination of the table (its own gather buffer and/or its peers'). The own rs is
// formed here from x (and the state), exactly as the entry forms the segments it sends.
#include "owner_reduce.cuh"

namespace echo {

void launch_owner_reduce(const OwnerReduceArgs& a, cudaStream_t stream) {
  using namespace detail;
  ECHO_HOST_ASSERT(a.rank >= 0 && a.rank < a.layout.world_size, "rank out of range");
  ECHO_HOST_ASSERT(a.group_begin >= 0 && a.num_groups >= 0 &&
                       a.group_begin + a.num_groups <= a.layout.groups_per_segment,
                   "group range outside the segment");
  for (int r = 0; r < a.layout.world_size && r < kMaxWorldSize; ++r) {
    ECHO_HOST_ASSERT(r == a.rank || (a.in.codes[r] && a.in.scales[r] && a.in.zeros[r]),
                     "owner reduce needs the copy of every other rank");
  }
  check_contribution(a.src);
  if (a.num_groups == 0) return;
  if (is_uncompensated(a.src)) {  // owner_reduce_uncompensated.cu
    ECHO_DISPATCH_DTYPE(a.src.x_dtype, T, launch_owner_reduce_kernel<true, T>(a, stream));
  } else {  // owner_reduce_<dtype>.cu
    ECHO_DISPATCH_DTYPE(a.src.x_dtype, T, launch_owner_reduce_kernel<false, T>(a, stream));
  }
}

}  // namespace echo
