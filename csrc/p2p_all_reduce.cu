// The one-launch p2p all-reduce, host side: checks, the dispatch over dtype and world size, and the control
// block (the kernels and their protocol: p2p_all_reduce.cuh; their instantiations: p2p_all_reduce_*_p*.cu).
#include "p2p_all_reduce.cuh"

namespace echo {

namespace {
// What every launch of the family needs: world size, rank, grid, chunk, control block, error record, flags.
void check_launch(const P2PAllReduceArgs& a) {
  const int P = a.layout.world_size;
  ECHO_HOST_ASSERT(P == 2 || P == 4 || P == 8, "the one-launch transport is built for 2, 4, 8 ranks");
  ECHO_HOST_ASSERT(a.rank >= 0 && a.rank < P, "rank out of range");
  ECHO_HOST_ASSERT(a.num_blocks >= 1 && a.num_blocks <= kP2PMaxBlocks, "num_blocks out of range");
  ECHO_HOST_ASSERT(a.chunk_begin >= 0 && a.chunk_groups >= 1 &&
                       a.chunk_begin + a.chunk_groups <= a.layout.groups_per_segment,
                   "the chunk must be a non-empty range of the segment's groups");
  ECHO_HOST_ASSERT(a.control != nullptr && a.error != nullptr, "control block and error record are required");
  for (int j = 0; j < P; ++j) ECHO_HOST_ASSERT(a.flags[j] != nullptr, "every rank's flag area is required");
}
}  // namespace

void launch_p2p_all_reduce(const P2PAllReduceArgs& a, cudaStream_t stream) {
  check_launch(a);
  detail::check_contribution(a.src);
  ECHO_HOST_ASSERT(!(a.update_local && a.update_output), "one residual per call");
  ECHO_HOST_ASSERT(!(a.update_local || a.update_output) || a.src.m1 != nullptr, "updating needs the state");
  if (a.one_shot) {  // 16-bit x at P = 2 and 4, one launch for the whole message (p2p_all_reduce.cuh)
    const int P = a.layout.world_size;
    ECHO_HOST_ASSERT(P == 2 || P == 4, "the one-shot kernel is built for 2 and 4 ranks");
    ECHO_HOST_ASSERT(a.chunk_begin == 0 && a.chunk_groups == a.layout.groups_per_segment,
                     "a one-shot call is one launch for the whole message");
    for (int d = 0; d < P; ++d) ECHO_HOST_ASSERT(a.shot[d] != nullptr, "every rank's one-shot region is required");
    switch (a.src.x_dtype) {
      case DType::kFloat16:
        if (P == 2) detail::launch_p2p_one_shot_kernel<__half, 2>(a, stream);
        else detail::launch_p2p_one_shot_kernel<__half, 4>(a, stream);
        break;
      case DType::kBFloat16:
        if (P == 2) detail::launch_p2p_one_shot_kernel<__nv_bfloat16, 2>(a, stream);
        else detail::launch_p2p_one_shot_kernel<__nv_bfloat16, 4>(a, stream);
        break;
      default: ECHO_HOST_ASSERT(false, "the one-shot kernel takes 16-bit x");
    }
    return;
  }
  ECHO_DISPATCH_DTYPE(a.src.x_dtype, T, ECHO_DISPATCH_WORLD_SIZE(a.layout.world_size, kWorld,
                      detail::launch_p2p_all_reduce_kernel<T, kWorld>(a, stream)));
}

void launch_p2p_plain_all_reduce(const P2PAllReduceArgs& a, cudaStream_t stream) {
  check_launch(a);
  ECHO_HOST_ASSERT(a.layout.group_size == detail::kPlainGroupSize, "the plain call's groups are kPlainGroupSize");
  ECHO_DISPATCH_DTYPE(a.src.x_dtype, T, ECHO_DISPATCH_WORLD_SIZE(a.layout.world_size, kWorld,
                      detail::launch_p2p_plain_all_reduce_kernel<T, kWorld>(a, stream)));
}

P2PControl* p2p_alloc_control() {
  P2PControl* c = nullptr;
  ECHO_CHECK(cudaMalloc(&c, sizeof(P2PControl)));
  ECHO_CHECK(cudaMemset(c, 0, sizeof(P2PControl)));
  ECHO_CHECK(cudaDeviceSynchronize());
  return c;
}

void p2p_free_control(P2PControl* control) {
  if (control != nullptr) ECHO_CHECK(cudaFree(control));
}

int p2p_resident_blocks() {
  int device = 0, num_sms = 0;
  ECHO_CHECK(cudaGetDevice(&device));
  ECHO_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  return detail::kFusedMinBlocks * num_sms;
}

}  // namespace echo
