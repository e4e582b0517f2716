// Expert layouts of a rank's received rows (local to the rank).
// Packed (expert_layout): one block per local expert counts its rows, then one block per expert
// places them in rank-layout order after the aligned blocks of the experts before it.
// Padded (expert_padded): a block per rank-level row finds each of its experts' row (the rows
// before it in its chunk of kExpertChunkRows holding that expert, plus the counts of the earlier
// chunks, which a first kernel counts when there are several) and copies the row there; a block
// per kExpertsPerBlock experts counts their rows and marks their padding in the maps.
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

// Ids [k0, k0 + 8) of a row of K (-1 past K), loaded together: a loop that stops at the first
// match would make each load wait for the one before.
constexpr int kIdsAtOnce = 8;
__device__ void load_ids(const int32_t* ids, int K, int k0, int32_t (&v)[kIdsAtOnce]) {
#pragma unroll
  for (int i = 0; i < kIdsAtOnce; ++i) v[i] = k0 + i < K ? ids[k0 + i] : -1;
}

// The same ids, each kept where it lies in [lo, hi) and its slot names it first in the row (the
// slots before it in these eight compared in registers, those of earlier eights read again),
// else -1: a row's distinct experts in the range, each once.
__device__ void load_distinct_ids(const int32_t* ids, int K, int k0, int32_t lo, int32_t hi,
                                  int32_t (&v)[kIdsAtOnce]) {
  int32_t id[kIdsAtOnce];
  load_ids(ids, K, k0, id);
#pragma unroll
  for (int i = 0; i < kIdsAtOnce; ++i) {
    bool first = id[i] >= lo && id[i] < hi;
#pragma unroll
    for (int j = 0; j < i; ++j) first &= id[j] != id[i];
    v[i] = first && !row_has_expert(ids, k0, id[i]) ? id[i] : -1;
  }
}

// Bit i of the result: ids v (kIdsAtOnce of them) hold experts[i] (i < n; the experts >= 0).
__device__ uint32_t holds_experts(const int32_t (&v)[kIdsAtOnce], const int32_t* experts, int n) {
  uint32_t holds = 0;
  for (int i = 0; i < n; ++i) {
    bool hit = false;
#pragma unroll
    for (int j = 0; j < kIdsAtOnce; ++j) hit |= v[j] == experts[i];
    holds |= uint32_t(hit && experts[i] >= 0) << i;
  }
  return holds;
}

// The same for a row of K ids, from its id k_begin on.
__device__ uint32_t holds_experts(const int32_t* ids, int K, const int32_t* experts, int n,
                                  int k_begin = 0) {
  uint32_t holds = 0;
  for (int k0 = k_begin; k0 < K; k0 += kIdsAtOnce) {
    int32_t v[kIdsAtOnce];
    load_ids(ids, K, k0, v);
    holds |= holds_experts(v, experts, n);
  }
  return holds;
}

// The rows of every chunk but the last holding each local expert, added into chunk_counts
// (zeroed before): a thread per row, a block per kRowsPerCountBlock rows of a chunk, so that even a
// few chunks spread over many SMs.
constexpr int kRowsPerCountBlock = 128;
static_assert(kExpertChunkRows % kRowsPerCountBlock == 0, "a chunk is whole count blocks");
__global__ void __launch_bounds__(kRowsPerCountBlock) count_chunks_kernel(ExpertPaddedArgs args) {
  extern __shared__ int32_t block_count[];  // [E_l]
  const int El = args.experts_per_rank, K = args.num_topk;
  const int chunk = blockIdx.x / (kExpertChunkRows / kRowsPerCountBlock);
  for (int e = threadIdx.x; e < El; e += kRowsPerCountBlock) block_count[e] = 0;
  __syncthreads();
  const int64_t row = int64_t(blockIdx.x) * kRowsPerCountBlock + threadIdx.x;
  for (int k0 = 0; k0 < K; k0 += kIdsAtOnce) {
    int32_t v[kIdsAtOnce];
    load_distinct_ids(args.topk_rows + row * K, K, k0, 0, El, v);
#pragma unroll
    for (int i = 0; i < kIdsAtOnce; ++i)
      if (v[i] >= 0) atomicAdd(&block_count[v[i]], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < El; e += kRowsPerCountBlock)
    if (block_count[e]) atomicAdd(&args.chunk_counts[int64_t(chunk) * El + e], block_count[e]);
}

// The padded placement's blocks: small, so that a wave holds every row's block and each
// expert's (a block's time is mostly the latency of its loads).
constexpr int kPaddedThreads = 128;
constexpr int kPaddedWarps = kPaddedThreads / 32;

// 16-byte words of a row, held by a block's threads kWords at a time (thread t: words
// first + t + i * kPaddedThreads): a row is loaded once and stored to each of its experts' rows,
// the first stage loaded while the block finds those rows.
template <int kWords>
struct RowStage {
  static constexpr int64_t kStageWords = int64_t(kWords) * kPaddedThreads;
  int4 word[kWords];

  __device__ void load(const uint8_t* row, int64_t words, int64_t first) {
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      const int64_t w = first + threadIdx.x + i * kPaddedThreads;
      if (w < words) word[i] = reinterpret_cast<const int4*>(row)[w];
    }
  }
  __device__ void store(uint8_t* row, int64_t words, int64_t first) const {
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      const int64_t w = first + threadIdx.x + i * kPaddedThreads;
      if (w < words) reinterpret_cast<int4*>(row)[w] = word[i];
    }
  }
};
using XStage = RowStage<8>;      // 16 KB of a row per stage
using ScaleStage = RowStage<1>;  // 512 scales per stage

// Copies `bytes` of src to each row `lane_row * bytes` of dst that lanes i < n of the warp hold
// (those >= 0); `staged`: the first stage, already loaded when the row is 16-byte aligned (else
// bytes one by one).
template <int kWords>
__device__ void copy_to_rows(uint8_t* dst, const uint8_t* src, int64_t bytes, bool aligned,
                             const RowStage<kWords>& staged, int64_t lane_row, int n) {
  if (!aligned) {
    for (int i = threadIdx.x / 32; i < n; i += kPaddedWarps) {
      const int64_t row = __shfl_sync(~0u, lane_row, i);
      if (row >= 0) copy_bytes(dst + row * bytes, src, 0, bytes);
    }
    return;
  }
  const int64_t words = bytes / 16;
  for (int64_t first = 0; first < words; first += RowStage<kWords>::kStageWords) {
    RowStage<kWords> stage = staged;
    if (first > 0) stage.load(src, words, first);
    for (int i = 0; i < n; ++i) {
      const int64_t row = __shfl_sync(~0u, lane_row, i);
      if (row >= 0) stage.store(dst + row * bytes, words, first);
    }
  }
}

__device__ bool aligned16(const void* a, const void* b, int64_t bytes) {
  return (reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) | uint64_t(bytes)) % 16 ==
         0;
}

// Slot k0 + lane of a row of K ids, as every warp holds it (lane = the slot): its expert if the
// slot names it first (else -1), that expert's weight (the sum over the row's slots naming it)
// and column in expert_rows (the row's distinct experts below it). Within a group of 32 slots
// the lanes compare by shuffles; only rows of more than 32 slots read the other groups' ids.
struct PaddedSlot {
  int32_t expert;
  float weight;
  int column;
};
__device__ PaddedSlot padded_slot(const int32_t* ids, const float* weights, int K, int k0, int El) {
  const int lane = threadIdx.x % 32, k = k0 + lane, n = min(32, K - k0);
  const int32_t id = k < K ? ids[k] : -1;
  const float w = k < K ? weights[k] : 0.f;
  // The slot names its id first in the whole row: first in this group, in no group before.
  const bool leads = __ffs(__match_any_sync(~0u, id)) - 1 == lane && !row_has_expert(ids, k0, id);
  PaddedSlot slot{id >= 0 && id < El && leads ? id : -1, 0.f, 0};
  for (int j = 0; j < n; ++j) {  // this group
    const int32_t other = __shfl_sync(~0u, id, j);
    const float other_w = __shfl_sync(~0u, w, j);
    const bool other_leads = __shfl_sync(~0u, leads, j);
    slot.weight += other == slot.expert ? other_w : 0.f;
    slot.column += other >= 0 && other < slot.expert && other_leads;
  }
  for (int j = 0; j < K; ++j) {  // the other groups (none when K <= 32)
    if (j == k0) j += 32;
    if (j >= K) break;
    const int32_t other = ids[j];
    slot.weight += other == slot.expert ? weights[j] : 0.f;
    slot.column += other >= 0 && other < slot.expert && !row_has_expert(ids, j, other);
  }
  return slot;
}

// Rank-level row r to the rows of its experts, 32 slots at a time: every thread tests rows of
// r's chunk before r against the slots' experts and warps count the hits per slot; then lane i
// of every warp adds the counts for slot i (warp 0 writes the maps and weight) and the block
// stores the row (and its scales) there. The loads that need nothing else (the row's first
// stage, its ids, the ids of the scan's first pass) are issued first, together.
__device__ void place_padded_row(const ExpertPaddedArgs& args, int r) {
  __shared__ int32_t slot_expert[kPaddedWarps][32], warp_hits[kPaddedWarps][32];
  const int El = args.experts_per_rank, K = args.num_topk, C = args.capacity;
  const int M = args.max_per_row(), lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int32_t* ids = args.topk_rows + int64_t(r) * K;
  const float* weights = args.weight_rows + int64_t(r) * K;
  const uint8_t* x = args.x_rows + r * args.x_row_bytes;
  const uint8_t* scales = args.scale_rows + r * args.scale_row_bytes;
  const bool x_aligned = aligned16(x, args.x_out, args.x_row_bytes);
  const bool scales_aligned = aligned16(scales, args.scales_out, args.scale_row_bytes);
  XStage x_stage;
  ScaleStage scale_stage;
  if (x_aligned) x_stage.load(x, args.x_row_bytes / 16, 0);
  if (scales_aligned) scale_stage.load(scales, args.scale_row_bytes / 16, 0);
  const int chunk_begin = r / kExpertChunkRows * kExpertChunkRows;
  const int q0 = chunk_begin + threadIdx.x;  // this thread's row in the scan's first pass
  int32_t q0_ids[kIdsAtOnce];
  load_ids(args.topk_rows + int64_t(q0) * K, q0 < r ? K : 0, 0, q0_ids);
  int distinct = 0;
  for (int k0 = 0; k0 < K; k0 += 32) {
    const int n = min(32, K - k0);
    const PaddedSlot slot = padded_slot(ids, weights, K, k0, El);
    distinct += __popc(__ballot_sync(~0u, slot.expert >= 0));
    slot_expert[warp][lane] = slot.expert;  // each warp its own copy: no block barrier
    __syncwarp();
    const int32_t* experts = slot_expert[warp];
    int hits = 0;  // lane i: this warp's rows holding slot i's expert
    for (int base = chunk_begin; base < r; base += kPaddedThreads) {
      const int q = base + threadIdx.x;
      uint32_t holds = 0;  // bit i: row q holds slot i's expert
      if (q < r) {
        const int32_t* q_ids = args.topk_rows + int64_t(q) * K;
        holds = base == chunk_begin ? holds_experts(q0_ids, experts, n) |
                                          holds_experts(q_ids, K, experts, n, kIdsAtOnce)
                                    : holds_experts(q_ids, K, experts, n);
      }
      for (int i = 0; i < n; ++i) {
        const int found = __popc(__ballot_sync(~0u, holds >> i & 1u));
        if (lane == i) hits += found;
      }
    }
    warp_hits[warp][lane] = hits;
    __syncthreads();
    const int32_t e = slot.expert;
    int pos = 0;  // rows before r holding e: this chunk's, then the earlier chunks'
    for (int w = 0; w < kPaddedWarps; ++w) pos += warp_hits[w][lane];
    for (int c = 0; e >= 0 && c < r / kExpertChunkRows; ++c)
      pos += args.chunk_counts[int64_t(c) * El + e];
    const int64_t at = e >= 0 && pos < C ? int64_t(e) * C + pos : -1;  // -1: none, or dropped
    if (warp == 0) {
      if (e >= 0) args.expert_rows[int64_t(r) * M + slot.column] = int32_t(at);
      if (at >= 0) {
        args.expert_src[at] = r;
        args.expert_of_row[at] = e;
        args.weights_out[at] = slot.weight;
      }
    }
    copy_to_rows(args.x_out, x, args.x_row_bytes, x_aligned, x_stage, at, n);
    copy_to_rows(args.scales_out, scales, args.scale_row_bytes, scales_aligned, scale_stage, at, n);
    if (k0 + 32 < K) __syncthreads();  // warp_hits is written again
  }
  for (int m = distinct + threadIdx.x; m < M; m += kPaddedThreads)
    args.expert_rows[int64_t(r) * M + m] = -1;
}

// Experts [e0, e0 + kExpertsPerBlock): their rows (the earlier chunks' counts plus the last
// chunk's rows holding them, a thread per row reading its ids once), those kept before the
// capacity, and -1 / 0 in the maps past them. A block takes several experts so that the last
// chunk's ids are read a few times, not once per expert.
constexpr int kExpertsPerBlock = 8;
static_assert(kExpertsPerBlock <= kPaddedThreads, "a thread per expert's total");
__device__ void finish_padded_experts(const ExpertPaddedArgs& args, int e0) {
  __shared__ int32_t total[kExpertsPerBlock];
  const int K = args.num_topk, C = args.capacity, last = args.chunks() - 1;
  const int n = min(kExpertsPerBlock, args.experts_per_rank - e0);
  if (threadIdx.x < n) total[threadIdx.x] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < n * last; i += kPaddedThreads)
    atomicAdd(&total[i % n],
              args.chunk_counts[int64_t(i / n) * args.experts_per_rank + e0 + i % n]);
  for (int q = last * kExpertChunkRows + threadIdx.x; q < args.rows; q += kPaddedThreads) {
    const int32_t* ids = args.topk_rows + int64_t(q) * K;
    for (int k0 = 0; k0 < K; k0 += kIdsAtOnce) {
      int32_t v[kIdsAtOnce];
      load_distinct_ids(ids, K, k0, e0, e0 + n, v);
#pragma unroll
      for (int i = 0; i < kIdsAtOnce; ++i)
        if (v[i] >= 0) atomicAdd(&total[v[i] - e0], 1);
    }
  }
  __syncthreads();
  if (threadIdx.x < n) {
    args.tokens_per_expert[e0 + threadIdx.x] = min(total[threadIdx.x], C);
    args.expert_counts[e0 + threadIdx.x] = total[threadIdx.x];
  }
  for (int i = threadIdx.x; i < n * C; i += kPaddedThreads) {
    if (i % C < total[i / C]) continue;
    const int64_t at = int64_t(e0) * C + i;
    args.expert_src[at] = args.expert_of_row[at] = -1;
    args.weights_out[at] = 0.f;
  }
}

// Blocks [0, rows): a rank-level row each; the blocks after: kExpertsPerBlock experts each.
__global__ void __launch_bounds__(kPaddedThreads) padded_kernel(ExpertPaddedArgs args) {
  if (int(blockIdx.x) < args.rows)
    place_padded_row(args, blockIdx.x);
  else
    finish_padded_experts(args, (blockIdx.x - args.rows) * kExpertsPerBlock);
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
    const int full_chunks = args.chunks() - 1;
    const int count_blocks = full_chunks * (kExpertChunkRows / kRowsPerCountBlock);
    JAX_EP_CUDA_TRY(
        cudaMemsetAsync(args.chunk_counts, 0, sizeof(int32_t) * int64_t(full_chunks) * El, stream));
    count_chunks_kernel<<<count_blocks, kRowsPerCountBlock, chunk_smem, stream>>>(args);
  }
  const int expert_blocks = (El + kExpertsPerBlock - 1) / kExpertsPerBlock;
  padded_kernel<<<args.rows + expert_blocks, kPaddedThreads, 0, stream>>>(args);
  JAX_EP_CUDA_TRY(cudaGetLastError());
  return {};
}

}  // namespace jax_ep::cuda
