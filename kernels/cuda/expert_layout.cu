// Expert layouts of a rank's received rows (local to the rank).
// Packed (expert_layout): one block per local expert counts its rows, then one block per expert
// places them in rank-layout order after the aligned blocks of the experts before it.
// Padded (expert_padded): a block per rank-level row finds each of its experts' row (the rows
// before it in its chunk of kExpertChunkRows holding that expert, plus the counts of the earlier
// chunks, which a first kernel counts when there are several) and copies the row there; a block
// per expert counts its rows and marks its padding in the maps.
#include "kernels/cuda/rows.cuh"
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
}

// The distinct local expert of slot k of a row, or -1 (no local expert, or named by a slot before).
__device__ int32_t distinct_expert(const int32_t* topk, int k, int experts_per_rank) {
  const int32_t e = topk[k];
  return e >= 0 && e < experts_per_rank && !row_has_expert(topk, k, e) ? e : -1;
}

// Ids [k0, k0 + 8) of a row of K (-1 past K), loaded together: a loop that stops at the first
// match would make each load wait for the one before.
constexpr int kIdsAtOnce = 8;
__device__ void load_ids(const int32_t* ids, int K, int k0, int32_t (&v)[kIdsAtOnce]) {
#pragma unroll
  for (int i = 0; i < kIdsAtOnce; ++i) v[i] = k0 + i < K ? ids[k0 + i] : -1;
}

// Bit i of the result: a row of K ids holds experts[i] (i < n; the experts >= 0).
__device__ uint32_t holds_experts(const int32_t* ids, int K, const int32_t* experts, int n) {
  uint32_t holds = 0;
  for (int k0 = 0; k0 < K; k0 += kIdsAtOnce) {
    int32_t v[kIdsAtOnce];
    load_ids(ids, K, k0, v);
    for (int i = 0; i < n; ++i) {
      bool hit = false;
#pragma unroll
      for (int j = 0; j < kIdsAtOnce; ++j) hit |= v[j] == experts[i];
      holds |= uint32_t(hit && experts[i] >= 0) << i;
    }
  }
  return holds;
}

// Block c (every chunk but the last): the rows of chunk c holding each local expert.
__global__ void __launch_bounds__(kThreads) count_chunks_kernel(ExpertPaddedArgs args) {
  extern __shared__ int32_t chunk_count[];  // [E_l]
  const int El = args.experts_per_rank, K = args.num_topk;
  for (int e = threadIdx.x; e < El; e += kThreads) chunk_count[e] = 0;
  __syncthreads();
  const int64_t begin = int64_t(blockIdx.x) * kExpertChunkRows * K;
  for (int64_t i = begin + threadIdx.x; i < begin + int64_t(kExpertChunkRows) * K; i += kThreads) {
    const int32_t e = distinct_expert(args.topk_rows + i / K * K, int(i % K), El);
    if (e >= 0) atomicAdd(&chunk_count[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < El; e += kThreads)
    args.chunk_counts[int64_t(blockIdx.x) * El + e] = chunk_count[e];
}

// 16-byte words of a row, held by a block's threads a stage at a time (thread t: words
// first + t + i * kThreads): a row is loaded once and stored to each of its experts' rows, the
// first stage loaded while the block finds those rows.
constexpr int kStageWords = 4;  // per thread: 16 KB rows in one stage
struct RowStage {
  int4 word[kStageWords];

  __device__ void load(const uint8_t* row, int64_t words, int64_t first) {
#pragma unroll
    for (int i = 0; i < kStageWords; ++i) {
      const int64_t w = first + threadIdx.x + i * kThreads;
      if (w < words) word[i] = reinterpret_cast<const int4*>(row)[w];
    }
  }
  __device__ void store(uint8_t* row, int64_t words, int64_t first) const {
#pragma unroll
    for (int i = 0; i < kStageWords; ++i) {
      const int64_t w = first + threadIdx.x + i * kThreads;
      if (w < words) reinterpret_cast<int4*>(row)[w] = word[i];
    }
  }
};
constexpr int64_t kStageBytes = int64_t(16) * kStageWords * kThreads;

// Copies `bytes` of src to each row `dst_rows[i] * bytes` of dst (i < n, those >= 0); `staged`:
// the first stage, already loaded when the row is 16-byte aligned (else bytes one by one).
__device__ void copy_to_rows(uint8_t* dst, const uint8_t* src, int64_t bytes, bool aligned,
                             const RowStage& staged, const int64_t* dst_rows, int n) {
  if (!aligned) {
    for (int i = threadIdx.x / 32; i < n; i += kThreads / 32)
      if (dst_rows[i] >= 0) copy_bytes(dst + dst_rows[i] * bytes, src, 0, bytes);
    return;
  }
  const int64_t words = bytes / 16;
  for (int64_t first = 0; first < words; first += kStageBytes / 16) {
    RowStage stage = staged;
    if (first > 0) stage.load(src, words, first);
    for (int i = 0; i < n; ++i)
      if (dst_rows[i] >= 0) stage.store(dst + dst_rows[i] * bytes, words, first);
  }
}

__device__ bool aligned16(const void* a, const void* b, int64_t bytes) {
  return (reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) | uint64_t(bytes)) % 16 ==
         0;
}

// Rank-level row r to the rows of its experts. Slots are taken 32 at a time: every thread tests
// rows of r's chunk before r against the slots' experts, warps count the hits per slot and warp
// w finds the rows of slots w, w + kWarps, ...; then the block stores the row (and its scales)
// there.
__device__ void place_padded_row(const ExpertPaddedArgs& args, int r) {
  constexpr int kWarps = kThreads / 32;
  __shared__ int32_t slot_expert[32], rows_before[32];
  __shared__ int64_t slot_row[32];  // the slot's expert row, or -1
  extern __shared__ int32_t own[];  // [K] the row's ids, then [K] its weights
  const int El = args.experts_per_rank, K = args.num_topk, C = args.capacity;
  const int M = args.max_per_row(), lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* own_weights = reinterpret_cast<float*>(own + K);
  for (int k = threadIdx.x; k < K; k += kThreads) {
    own[k] = args.topk_rows[int64_t(r) * K + k];
    own_weights[k] = args.weight_rows[int64_t(r) * K + k];
  }
  const uint8_t* x = args.x_rows + r * args.x_row_bytes;
  const uint8_t* scales = args.scale_rows + r * args.scale_row_bytes;
  const bool x_aligned = aligned16(x, args.x_out, args.x_row_bytes);
  const bool scales_aligned = aligned16(scales, args.scales_out, args.scale_row_bytes);
  RowStage x_stage, scale_stage;  // loaded while the block finds the rows
  if (x_aligned) x_stage.load(x, args.x_row_bytes / 16, 0);
  if (scales_aligned) scale_stage.load(scales, args.scale_row_bytes / 16, 0);
  const int chunk = r / kExpertChunkRows;
  int distinct = 0;
  __syncthreads();  // own
  for (int k0 = 0; k0 < K; k0 += 32) {
    const int n = min(32, K - k0);
    if (threadIdx.x < n) {
      slot_expert[threadIdx.x] = distinct_expert(own, k0 + threadIdx.x, El);
      rows_before[threadIdx.x] = 0;
    }
    __syncthreads();
    for (int base = chunk * kExpertChunkRows; base < r; base += kThreads) {
      const int q = base + threadIdx.x;
      uint32_t holds = 0;  // bit i: row q holds slot k0 + i's expert
      if (q < r) holds = holds_experts(args.topk_rows + int64_t(q) * K, K, slot_expert, n);
      for (int i = 0; i < n; ++i) {
        const int hits = __popc(__ballot_sync(~0u, holds >> i & 1u));
        if (lane == 0 && hits) atomicAdd(&rows_before[i], hits);
      }
    }
    __syncthreads();
    for (int i = 0; i < n; ++i) distinct += slot_expert[i] >= 0;
    for (int i = warp; i < n; i += kWarps) {
      const int32_t e = slot_expert[i];
      int earlier = 0;  // rows of the chunks before r's holding e
      for (int c = lane; e >= 0 && c < chunk; c += 32)
        earlier += args.chunk_counts[int64_t(c) * El + e];
      const int pos = warp_sum(earlier) + rows_before[i];
      const int64_t at = e >= 0 && pos < C ? int64_t(e) * C + pos : -1;  // -1: none, or dropped
      if (lane != 0) continue;
      slot_row[i] = at;
      if (e < 0) continue;
      args.expert_rows[int64_t(r) * M + distinct_experts_below(own, K, e)] = int32_t(at);
      if (at < 0) continue;
      args.expert_src[at] = r;
      args.expert_of_row[at] = e;
      float weight = 0.f;
      for (int k = 0; k < K; ++k)
        if (own[k] == e) weight += own_weights[k];
      args.weights_out[at] = weight;
    }
    __syncthreads();
    copy_to_rows(args.x_out, x, args.x_row_bytes, x_aligned, x_stage, slot_row, n);
    copy_to_rows(args.scales_out, scales, args.scale_row_bytes, scales_aligned, scale_stage,
                 slot_row, n);
    __syncthreads();  // the slots' arrays are taken again
  }
  for (int m = distinct + threadIdx.x; m < M; m += kThreads)
    args.expert_rows[int64_t(r) * M + m] = -1;
}

// Expert e: its rows before the capacity (the earlier chunks' counts plus the last chunk's rows
// holding it), those kept, and -1 / 0 in the maps past them.
__device__ void finish_padded_expert(const ExpertPaddedArgs& args, int e) {
  __shared__ int32_t total;
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  const int last = args.chunks() - 1, K = args.num_topk;
  int count = 0;
  for (int c = threadIdx.x; c < last; c += kThreads)
    count += args.chunk_counts[int64_t(c) * args.experts_per_rank + e];
  for (int q = last * kExpertChunkRows + threadIdx.x; q < args.rows; q += kThreads)
    count += holds_experts(args.topk_rows + int64_t(q) * K, K, &e, 1);
  if (count) atomicAdd(&total, count);
  __syncthreads();
  const int kept = min(total, args.capacity);
  if (threadIdx.x == 0) {
    args.tokens_per_expert[e] = kept;
    args.expert_counts[e] = total;
  }
  for (int pos = kept + threadIdx.x; pos < args.capacity; pos += kThreads) {
    const int64_t at = int64_t(e) * args.capacity + pos;
    args.expert_src[at] = args.expert_of_row[at] = -1;
    args.weights_out[at] = 0.f;
  }
}

// Blocks [0, rows): a rank-level row each; blocks [rows, rows + E_l): an expert each.
__global__ void __launch_bounds__(kThreads) padded_kernel(ExpertPaddedArgs args) {
  if (int(blockIdx.x) < args.rows)
    place_padded_row(args, blockIdx.x);
  else
    finish_padded_expert(args, blockIdx.x - args.rows);
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
  JAX_EP_CUDA_TRY(cudaMemsetAsync(args.expert_src, 0xff, sizeof(int32_t) * args.capacity, stream));
  JAX_EP_CUDA_TRY(
      cudaMemsetAsync(args.expert_of_row, 0xff, sizeof(int32_t) * args.capacity, stream));
  JAX_EP_CUDA_TRY(cudaMemsetAsync(
      args.expert_rows, 0xff, sizeof(int32_t) * int64_t(args.rows) * args.max_per_row(), stream));
  JAX_EP_CUDA_TRY(cudaMemsetAsync(args.num_dropped, 0, sizeof(int32_t), stream));
  count_kernel<<<El, kThreads, 0, stream>>>(args);
  place_kernel<<<El, kThreads, 0, stream>>>(args);
  JAX_EP_CUDA_TRY(cudaGetLastError());
  return {};
}

std::string expert_padded(cudaStream_t stream, const ExpertPaddedArgs& args) {
  const int El = args.experts_per_rank;
  const size_t chunk_smem = sizeof(int32_t) * El;
  if (args.chunks() > 1) {
    if (chunk_smem > 48 * 1024)
      return "jax_ep: the expert_padded layout on GPUs takes at most 12288 local experts";
    count_chunks_kernel<<<args.chunks() - 1, kThreads, chunk_smem, stream>>>(args);
  }
  const size_t row_smem = 2 * sizeof(int32_t) * args.num_topk;  // a row's ids and weights
  padded_kernel<<<args.rows + El, kThreads, row_smem, stream>>>(args);
  JAX_EP_CUDA_TRY(cudaGetLastError());
  return {};
}

}  // namespace jax_ep::cuda
