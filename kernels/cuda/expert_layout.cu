// Expert layout of a rank's received rows (local to the rank): one block per local expert counts
// its rows, then one block per expert places them in rank-layout order in its block (after the
// aligned blocks of the experts before it, or at a fixed stride in the padded layout).
#include "kernels/cuda/sync.cuh"
#include "kernels/cuda/warp.cuh"
#include "kernels/layout.h"

namespace jax_ep::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) count_kernel(ExpertLayoutArgs a) {
  const int e = blockIdx.x;
  int count = 0;
  for (int base = 0; base < a.rows; base += kThreads) {
    const int r = base + threadIdx.x;
    count += __syncthreads_count(
        r < a.rows && row_has_expert(a.topk_rows + int64_t(r) * a.num_topk, a.num_topk, e));
  }
  if (threadIdx.x == 0) a.expert_counts[e] = count;
}

__global__ void __launch_bounds__(kThreads) place_kernel(ExpertLayoutArgs a) {
  __shared__ int32_t warp_count[kThreads / 32];
  const int e = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int start, room;
  expert_block(a.expert_counts, e, a.alignment, a.block_rows, a.capacity, &start, &room);
  const int per_row = a.max_per_row();
  int placed = 0;
  for (int base = 0; base < a.rows; base += kThreads) {
    const int r = base + threadIdx.x;
    const int32_t* topk = a.topk_rows + int64_t(r) * a.num_topk;
    const bool has = r < a.rows && row_has_expert(topk, a.num_topk, e);
    const uint32_t ballot = __ballot_sync(~0u, has);
    if (lane == 0) warp_count[warp] = __popc(ballot);
    __syncthreads();
    int before = placed;
    for (int w = 0; w < warp; ++w) before += warp_count[w];
    int chunk = 0;
    for (int w = 0; w < kThreads / 32; ++w) chunk += warp_count[w];
    if (has) {
      const int pos = start + before + count_below(ballot, lane);
      if (pos < start + room) {
        a.expert_src[pos] = r;
        a.expert_of_row[pos] = e;
        a.expert_rows[int64_t(r) * per_row + distinct_experts_below(topk, a.num_topk, e)] = pos;
      }
    }
    placed += chunk;
    __syncthreads();
  }
  // Expert e's rows sit at [start, start + placed): those past its room dropped.
  const int kept = min(placed, room);
  if (threadIdx.x == 0) {
    a.tokens_per_expert[e] = kept;
    if (placed > kept) atomicAdd(a.num_dropped, placed - kept);
  }
}

}  // namespace

std::string expert_layout(cudaStream_t stream, const ExpertLayoutArgs& a) {
  const int El = a.experts_per_rank;
  JAX_EP_CUDA_TRY(cudaMemsetAsync(a.expert_src, 0xff, sizeof(int32_t) * a.capacity, stream));
  JAX_EP_CUDA_TRY(cudaMemsetAsync(a.expert_of_row, 0xff, sizeof(int32_t) * a.capacity, stream));
  JAX_EP_CUDA_TRY(cudaMemsetAsync(a.expert_rows, 0xff,
                                  sizeof(int32_t) * int64_t(a.rows) * a.max_per_row(), stream));
  JAX_EP_CUDA_TRY(cudaMemsetAsync(a.num_dropped, 0, sizeof(int32_t), stream));
  count_kernel<<<El, kThreads, 0, stream>>>(a);
  place_kernel<<<El, kThreads, 0, stream>>>(a);
  JAX_EP_CUDA_TRY(cudaGetLastError());
  return {};
}

}  // namespace jax_ep::cuda
