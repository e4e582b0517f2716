// Expert layout of a rank's received rows (local to the rank): one block per local expert counts
// its rows, then one block per expert places them in rank-layout order in its block (after the
// aligned blocks of the experts before it, or at a fixed stride in the padded layout). In the
// padded layout the rows themselves are then copied to their places (place_rows).
#include "kernels/cuda/sync.cuh"
#include "kernels/cuda/warp.cuh"
#include "kernels/layout.h"

namespace jax_ep::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) count_kernel(ExpertLayoutArgs args) {
  const int e = blockIdx.x;
  int count = 0;
  for (int base = 0; base < args.rows; base += kThreads) {
    const int r = base + threadIdx.x;
    count += __syncthreads_count(
        r < args.rows &&
        row_has_expert(args.topk_rows + int64_t(r) * args.num_topk, args.num_topk, e));
  }
  if (threadIdx.x == 0) args.expert_counts[e] = count;
}

__global__ void __launch_bounds__(kThreads) place_kernel(ExpertLayoutArgs args) {
  __shared__ int32_t warp_count[kThreads / 32];
  const int e = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int start, room;
  expert_block(args.expert_counts, e, args.alignment, args.block_rows, args.capacity, &start,
               &room);
  const int per_row = args.max_per_row();
  int placed = 0;
  for (int base = 0; base < args.rows; base += kThreads) {
    const int r = base + threadIdx.x;
    const int32_t* topk = args.topk_rows + int64_t(r) * args.num_topk;
    const bool has = r < args.rows && row_has_expert(topk, args.num_topk, e);
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
        args.expert_src[pos] = r;
        args.expert_of_row[pos] = e;
        args.expert_rows[int64_t(r) * per_row + distinct_experts_below(topk, args.num_topk, e)] =
            pos;
      }
    }
    placed += chunk;
    __syncthreads();
  }
  // Expert e's rows sit at [start, start + placed): those past its room dropped.
  const int kept = min(placed, room);
  if (threadIdx.x == 0) {
    args.tokens_per_expert[e] = kept;
    if (placed > kept) atomicAdd(args.num_dropped, placed - kept);
  }
  if (args.block_rows > 0)  // the padded layout: the rest of the expert's own block is padding
    for (int pos = start + kept + threadIdx.x; pos < start + room; pos += kThreads)
      args.expert_src[pos] = args.expert_of_row[pos] = -1;
}

// Block r copies rank-layout row r to each of its expert rows, 16 bytes a thread where the rows
// allow it. Positions come from expert_layout (below out_rows); others are skipped.
template <class Word>
__global__ void __launch_bounds__(kThreads) copy_rows_kernel(PlaceRowsArgs args) {
  const int r = blockIdx.x;
  const int64_t words = args.row_bytes / int64_t(sizeof(Word));
  const Word* src = reinterpret_cast<const Word*>(args.src + r * args.row_bytes);
  for (int m = 0; m < args.per_row; ++m) {
    const int32_t pos = args.expert_rows[int64_t(r) * args.per_row + m];
    if (pos < 0 || pos >= args.out_rows) continue;
    Word* dst = reinterpret_cast<Word*>(args.out + pos * args.row_bytes);
    for (int64_t i = threadIdx.x; i < words; i += kThreads) dst[i] = src[i];
  }
}

}  // namespace

std::string place_rows(cudaStream_t stream, const PlaceRowsArgs& args) {
  if (args.rows == 0 || args.row_bytes == 0) return {};
  const bool wide = args.row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(args.src) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(args.out) % 16 == 0;
  if (wide)
    copy_rows_kernel<int4><<<args.rows, kThreads, 0, stream>>>(args);
  else
    copy_rows_kernel<uint8_t><<<args.rows, kThreads, 0, stream>>>(args);
  JAX_EP_CUDA_TRY(cudaGetLastError());
  return {};
}

std::string expert_layout(cudaStream_t stream, const ExpertLayoutArgs& args) {
  const int El = args.experts_per_rank;
  const bool padded = args.block_rows > 0;  // fixed blocks: no counts, each pads its own
  if (!padded) {
    JAX_EP_CUDA_TRY(
        cudaMemsetAsync(args.expert_src, 0xff, sizeof(int32_t) * args.capacity, stream));
    JAX_EP_CUDA_TRY(
        cudaMemsetAsync(args.expert_of_row, 0xff, sizeof(int32_t) * args.capacity, stream));
  }
  JAX_EP_CUDA_TRY(cudaMemsetAsync(
      args.expert_rows, 0xff, sizeof(int32_t) * int64_t(args.rows) * args.max_per_row(), stream));
  JAX_EP_CUDA_TRY(cudaMemsetAsync(args.num_dropped, 0, sizeof(int32_t), stream));
  if (!padded) count_kernel<<<El, kThreads, 0, stream>>>(args);
  place_kernel<<<El, kThreads, 0, stream>>>(args);
  JAX_EP_CUDA_TRY(cudaGetLastError());
  return {};
}

}  // namespace jax_ep::cuda
