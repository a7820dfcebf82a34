// Stage 1, entry (push): x -> r' = rotate(x) + c -> rs = r' 2^k -> codes of the non-owned segments. The
// correction, the rotation and the statistics live in registers only; x' is never written (paper, section
// 5.3). The owned segment is not touched: the owner reduce forms its rs from the same inputs. With residual
// "local" the state read for c is updated in the same pass from the codes' rounding error (8 bytes per
// element: 4 read, 4 written), so no residual array and no separate update pass exist.
#include "echo_compensator.cuh"
#include "echo_contribution.cuh"
#include "echo_device.cuh"
#include "echo_quantizer.cuh"
#include "echo_rescale.cuh"

namespace echo {
namespace {

using namespace detail;

// Two instantiations per configuration: the uncompensated entry (no compensation or rotation) and the full
// one (64 registers). Sharing one instantiation held the uncompensated entry at the full one's registers.
//
// Groups per thread of the uncompensated entry with 16-bit x (ECHO_ENTRY_ITEMS, 1 to 8): a thread works
// through its groups in order and issues the loads of x for the next group before it works on the current
// one (two buffers), so that one group's loads are in flight while the thread computes. With few
// instructions left the uncompensated entry waits on its loads (ncu: a third of the stall samples on the
// first use of x), and 2 measured 5-6% faster than 1 from 256 MB up (benchmarks/runs/2026-12-03.md, 16:12 UTC).
// Occupancy decides the rest: two items at 40 registers (6 blocks per SM) measured 90.8% of copy at
// 256 MB against 83.5% at 48 registers (5 blocks); 4 or 8 items, which need 64 registers (4 blocks; at 5
// they spill), 72-73%; one item (32 registers, 8 blocks) 87.1% (benchmarks/runs/2026-12-03_entry_*).
// -DECHO_ENTRY_ITEMS=N and -DECHO_ENTRY_MIN_BLOCKS=B build others for comparison.
#ifndef ECHO_ENTRY_ITEMS
#define ECHO_ENTRY_ITEMS 2
#endif
static_assert(ECHO_ENTRY_ITEMS >= 1 && ECHO_ENTRY_ITEMS <= 8, "ECHO_ENTRY_ITEMS is 1 to 8");
template <typename T, bool kUncompensated>
constexpr int kEntryItems = (kUncompensated && sizeof(T) == 2) ? ECHO_ENTRY_ITEMS : 1;

// Blocks per SM the uncompensated 16-bit entry is built for (__launch_bounds__): 6 caps it at 40 registers,
// which two items fit without spilling because quantize_uncompensated_group converts x only after the
// parameters.
#ifndef ECHO_ENTRY_MIN_BLOCKS
#define ECHO_ENTRY_MIN_BLOCKS (ECHO_ENTRY_ITEMS == 2 ? 6 : 4)
#endif
template <typename T, bool kUncompensated>
constexpr int entry_min_blocks() { return kEntryItems<T, kUncompensated> >= 2 ? ECHO_ENTRY_MIN_BLOCKS : 4; }

template <typename T, int kBits, int kGroupSize, bool kUncompensated>
__global__ void ECHO_KERNEL_BOUNDS((entry_min_blocks<T, kUncompensated>())) push_quantize_kernel(const PushQuantizeArgs a) {
  constexpr int kLanes = kGroupSize / kElemsPerThread;
  constexpr int kItems = kEntryItems<T, kUncompensated>;
  int lane;
  const int64_t first = group_in_row<kLanes, kItems>(lane);  // groups of a sent segment; their lanes share them
  if (first >= a.num_groups) return;                         // whole groups leave together
  const int row = static_cast<int>(blockIdx.y);              // rows are the P - 1 sent segments
  const int seg = row < a.rank ? row : row + 1;
  const int64_t seg_first = int64_t(seg) * a.layout.groups_per_segment * kGroupSize + a.group_begin * kGroupSize;

  // Item it's words of x are in raw[it % 2]; item it + 1's loads are issued before item it is worked on.
  // A loop of two items per trip rather than a full unroll keeps the code of a kernel at two items' size.
  RawChunks<T> raw[2];
  const auto load_item = [&](int it, RawChunks<T>& r) {
    const int64_t item = first + it * kGroupsPerBlockItem<kLanes>;
    if (it < kItems && item < a.num_groups) {
      load_contribution_x<T, kLanes>(a.src, seg_first + item * kGroupSize, lane, a.layout.numel, r);
    }
  };
  load_item(0, raw[0]);
  const int k = pow2_exponent(a.pow2_amax);
  // Works on item it from r after issuing item it + 1's loads into `next`; false past the last item.
  const auto step = [&](int it, const RawChunks<T>& r, RawChunks<T>& next) {
    const int64_t item = first + it * kGroupsPerBlockItem<kLanes>;
    if (it >= kItems || item >= a.num_groups) return false;
    load_item(it + 1, next);
    const int64_t gi = a.group_begin + item;
    const int64_t e = seg_first + item * kGroupSize;  // the group's first element (padded tensor)
    float v[kElemsPerThread];
    Codes<kBits> codes;
    GroupParams p;
    StateWords m;
    if constexpr (kUncompensated && sizeof(T) == 2) {
      p = quantize_uncompensated_group<T, kBits, kLanes>(a.src, r, e, lane, k, a.quantizer, v, codes);
    } else {
      contribution_from_raw<T, kLanes, kUncompensated>(a.src, r, e, lane, k, v, m);
      p = quantize_group<kBits, kLanes>(v, a.quantizer, lane, codes);
    }
    store_packet_group<kBits, kLanes>(a.out, seg, gi, lane, codes, p);
    if (!kUncompensated && a.src.update_state) {
      // residual "local" of the sent segments: the rounding error this rank added to rs.
      float u[kElemsPerThread];
      local_residual<kBits>(codes, p, v, k, u);
      update_state<kLanes>(a.src, e, lane, m, u);
    }
    return true;
  };
#pragma unroll 1
  for (int it = 0; it < kItems; it += 2) {
    if (!step(it, raw[0], raw[1]) || !step(it + 1, raw[1], raw[0])) break;
  }
}

}  // namespace

void launch_push_quantize(const PushQuantizeArgs& a, cudaStream_t stream) {
  ECHO_HOST_ASSERT(a.layout.world_size >= 2 && a.layout.world_size <= kMaxWorldSize, "world size out of range");
  ECHO_HOST_ASSERT(a.rank >= 0 && a.rank < a.layout.world_size, "rank out of range");
  ECHO_HOST_ASSERT(a.group_begin >= 0 && a.num_groups >= 0 &&
                       a.group_begin + a.num_groups <= a.layout.groups_per_segment,
                   "group range outside the segment");
  check_contribution(a.src);
  if (a.num_groups == 0) return;
  ECHO_DISPATCH_WORLD_SIZE(a.layout.world_size, kWorld, (void)kWorld);  // raises for unsupported P
  ECHO_DISPATCH_DTYPE(a.src.x_dtype, T, ECHO_DISPATCH_BITS(a.bits, kBits, ECHO_DISPATCH_GROUP_SIZE(a.layout.group_size, kGroup, {
    constexpr int kLanes = kGroup / kElemsPerThread;
    const int rows = a.layout.world_size - 1;
    if (is_uncompensated(a.src)) {
      const dim3 grid = grid_of_rows<kLanes, kEntryItems<T, true>>(a.num_groups, rows);
      push_quantize_kernel<T, kBits, kGroup, true><<<grid, kThreadsPerBlock, 0, stream>>>(a);
    } else {
      const dim3 grid = grid_of_rows<kLanes, kEntryItems<T, false>>(a.num_groups, rows);
      push_quantize_kernel<T, kBits, kGroup, false><<<grid, kThreadsPerBlock, 0, stream>>>(a);
    }
    ECHO_CHECK(cudaGetLastError());
  })));
}

}  // namespace echo
