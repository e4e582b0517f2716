// Dispatch on NVLink GPUs. Two kernels on the op's stream:
//   route  (a block per 1024 tokens) publishes this rank's output buffers, gives every token its
//          slot per destination rank, all-gathers the per-rank row counts;
//   send   (<= num_sms blocks) each warp takes tokens, loads a row (FP8-quantising it when
//          asked) and stores it from registers straight into the output row of every
//          destination rank, tallying rows per destination expert; the last block hands each
//          rank its tally, announces the rows arrived, waits for every peer's rows and totals
//          tokens per local expert.
// A cached dispatch is the send kernel alone (its block 0 publishes the output buffers).
#include <cuda_bf16.h>

#include "kernels/cuda/comm.cuh"
#include "kernels/cuda/rows.cuh"
#include "kernels/fp8.h"
#include "kernels/layout.h"

namespace jax_ep::cuda {
namespace {

constexpr int kSendWarps = 24;
constexpr int kMaxScales = 1024;   // per row (hidden <= 131072 when fp8): 128 KB of staging

struct Params {
  DispatchArgs a;
  Link link;
};

// One block per chunk of kRouteTokens tokens: each token's slot among the chunk's tokens sent to
// each rank (send_pos; the send kernel adds the rows of earlier chunks and ranks), the chunk's
// row counts in chunk_rows. The last block turns those into offsets and sends this rank's row
// of the count matrix to every rank.
__global__ void __launch_bounds__(kRouteTokens) route_kernel(Params p) {
  const DispatchArgs& a = p.a;
  const Link& link = p.link;
  const int R = link.num_ranks, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  constexpr int kWarps = kRouteTokens / 32;
  static_assert(kWarps == 32, "one lane per warp in the scan below");
  __shared__ int32_t warp_rows[kWarps][kMaxRanks];  // then: rows of earlier warps
  __shared__ int32_t invalid, total[kMaxRanks];
  const uint64_t seq = this_op(link.self);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    void* mine[kMailboxPointers] = {a.x_out, a.scales_out, a.topk_out, a.weights_out};
    publish(link.self, seq, mine);
  }
  if (threadIdx.x == 0) invalid = 0;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < R * a.experts_per_rank();
       i += gridDim.x * blockDim.x)
    link.self->expert_tally[i] = 0;
  __syncthreads();

  const int t = blockIdx.x * kRouteTokens + threadIdx.x;
  uint32_t mask = 0;
  if (t < a.num_tokens) {
    const int32_t* topk = a.topk_idx + int64_t(t) * a.num_topk;
    mask = dest_rank_mask(topk, a.num_topk, a.num_experts, a.experts_per_rank());
    if (int bad = count_invalid(topk, a.num_topk, a.num_experts)) atomicAdd(&invalid, bad);
  }
  int32_t below[kMaxRanks];  // tokens of earlier lanes of this warp sent to d
#pragma unroll
  for (int d = 0; d < kMaxRanks; ++d) {
    const uint32_t ballot = __ballot_sync(~0u, mask >> d & 1u);
    below[d] = __popc(ballot & ((1u << lane) - 1u));
    if (lane == 0 && d < R) warp_rows[warp][d] = __popc(ballot);
  }
  __syncthreads();
  if (warp < R) {  // warp d scans the warps' counts for rank d
    const int d = warp, n = warp_rows[lane][d];
    int inclusive = n;
#pragma unroll
    for (int off = 1; off < 32; off *= 2) {
      const int up = __shfl_up_sync(~0u, inclusive, off);
      if (lane >= off) inclusive += up;
    }
    warp_rows[lane][d] = inclusive - n;
    if (lane == 31) link.self->chunk_rows[blockIdx.x][d] = inclusive;
  }
  if (threadIdx.x == 0 && invalid) atomicAdd(&link.self->route_invalid, invalid);
  __syncthreads();
  if (t < a.num_tokens)
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d)
      if (d < R) a.send_pos[int64_t(t) * R + d] = mask >> d & 1u ? warp_rows[warp][d] + below[d] : -1;

  if (!last_block_done(&link.self->ticket)) return;
  if (threadIdx.x < R) {  // chunk counts -> rows of earlier chunks
    const int d = threadIdx.x;
    volatile int32_t(*rows)[kMaxRanks] = link.self->chunk_rows;
    int running = 0;
    for (int c = 0; c < gridDim.x; ++c) {
      const int n = rows[c][d];
      rows[c][d] = running;
      running += n;
    }
    total[d] = running;
  }
  if (threadIdx.x == 0) {
    volatile int32_t* seen = &link.self->route_invalid;
    *a.num_invalid = *seen;
    *seen = 0;
  }
  __syncthreads();
  if (threadIdx.x < R) {  // my row of the count matrix, to every rank (myself included)
    DeviceState* peer = link.peers[threadIdx.x];
    int32_t* row = peer->counts[seq & 1][link.rank];
    for (int d = 0; d < R; ++d) row[d] = total[d];
    __threadfence_system();
    store_release(&peer->counts_seq[seq & 1][link.rank], seq);
  }
}

// Each warp takes whole tokens: loads its row (kUnroll steps of loads in flight per lane),
// quantizes it when asked, and stores it from registers straight into the output row of every
// destination rank (NVLink for peers); scales and expert ids follow with coalesced stores.
template <typename T, bool kFp8>
__global__ void __launch_bounds__(kSendWarps * 32, 1) send_kernel(Params p, bool aligned) {
  using Step = RowStep<T, kFp8>;
  extern __shared__ float scale_stage[];  // per warp: the scales of its current row
  const DispatchArgs& a = p.a;
  const Link& link = p.link;
  const int R = link.num_ranks, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const uint64_t seq = this_op(link.self);
  __shared__ int32_t first_row[kMaxRanks];
  __shared__ void* dest[kMaxRanks][kMailboxPointers];
  __shared__ int32_t present, received;
  __shared__ uint8_t* out_rows_of[kSendWarps][kMaxRanks];  // the current token's row on each rank
  __shared__ float* scales_of[kSendWarps][kMaxRanks];       // and its scales

  if (threadIdx.x == 0) {
    if (a.cached) {
      received = present = *a.cached_num_recv;
    } else {
      received = 0;
      for (int s = 0; s < R; ++s)
        wait_for(link, &link.self->counts_seq[seq & 1][s], seq, kWaitCounts, s);
      const volatile int32_t(*counts)[kMaxRanks] = link.self->counts[seq & 1];
      for (int d = 0; d < R; ++d) {
        int before = 0;
        for (int s = 0; s < link.rank; ++s) before += counts[s][d];
        first_row[d] = before;
      }
      for (int s = 0; s < R; ++s) received += counts[s][link.rank];
      present = received < a.out_rows ? received : a.out_rows;
      if (blockIdx.x == 0) {
        for (int s = 0; s < R; ++s) a.recv_counts[s] = counts[s][link.rank];
        *a.num_recv = present;
        *a.num_dropped = received - present;
      }
    }
  }
  if (a.cached && blockIdx.x == 0 && threadIdx.x == 0) {
    void* mine[kMailboxPointers] = {a.x_out, a.scales_out, nullptr, nullptr};
    publish(link.self, seq, mine);
  }
  if (threadIdx.x < R) read_mailbox(link, threadIdx.x, seq, dest[threadIdx.x]);
  __syncthreads();

  const int64_t in_row = int64_t(a.hidden) * sizeof(T);
  const int64_t out_row = a.x_out_row_bytes();
  const int num_scales = kFp8 ? a.scales_per_row() : 0;
  float* scales = scale_stage + warp * num_scales;

  // A token's routing, loaded one token ahead (its loads in flight while the warp sends the
  // current row): lane d its slot among the rows sent to rank d, that chunk's first row there;
  // lane k < 32 its k-th expert and weight.
  struct Route {
    int32_t slot = -1, chunk_row = 0, expert = -1;
    float weight = 0.f;
  };
  auto route_of = [&](int t) {
    Route r;
    if (t >= a.num_tokens) return r;
    if (lane < R) {
      r.slot = a.send_pos[int64_t(t) * R + lane];
      if (!a.cached) r.chunk_row = link.self->chunk_rows[t / kRouteTokens][lane];
    }
    if (!a.cached && lane < a.num_topk) {
      r.expert = a.topk_idx[int64_t(t) * a.num_topk + lane];
      r.weight = a.topk_weights[int64_t(t) * a.num_topk + lane];
    }
    return r;
  };
  const int stride = gridDim.x * kSendWarps;
  Route next = route_of(blockIdx.x * kSendWarps + warp);
  for (int t = blockIdx.x * kSendWarps + warp; t < a.num_tokens; t += stride) {
    const Route route = next;
    next = route_of(t + stride);
    if (t + stride < a.num_tokens)  // and the next row into L2, its first loads then hit there
      for (int64_t at = lane * 128; at < in_row; at += 32 * 128)
        prefetch_l2(static_cast<const uint8_t*>(a.x) + (t + stride) * in_row + at);
    // Lane d holds the token's row on rank d (-1: not sent there, or past the capacity).
    int32_t pos = route.slot;
    if (!a.cached && pos >= 0) {
      pos += first_row[lane] + route.chunk_row;
      if (pos >= a.out_rows) pos = -1;
      a.send_pos[int64_t(t) * R + lane] = pos;
    }
    const uint32_t targets = __ballot_sync(~0u, pos >= 0);
    if (!targets) continue;
    const uint8_t* row = static_cast<const uint8_t*>(a.x) + t * in_row;
    uint8_t** out = out_rows_of[warp];
    if (pos >= 0) out[lane] = static_cast<uint8_t*>(dest[lane][0]) + int64_t(pos) * out_row;
    __syncwarp();

    if (pos >= 0)
      scales_of[warp][lane] = kFp8 ? static_cast<float*>(dest[lane][1]) + int64_t(pos) * num_scales
                                   : nullptr;
    __syncwarp();
    int32_t expert = route.expert;
    float weight = route.weight;
    send_row<T, kFp8>(row, a.hidden, a.round_scale, targets, out, scales_of[warp], scales, 0,
                      (a.hidden + Step::kStep - 1) / Step::kStep, aligned);
    if (!a.cached) {  // local expert ids and weights as each destination sees them
      const int32_t* topk = a.topk_idx + int64_t(t) * a.num_topk;
      const float* weights = a.topk_weights + int64_t(t) * a.num_topk;
      for (int k0 = 0; k0 < a.num_topk; k0 += 32) {
        const int k = k0 + lane;
        if (k0 > 0) {
          expert = k < a.num_topk ? topk[k] : -1;
          weight = k < a.num_topk ? weights[k] : 0.f;
        }
        // The same expert in an earlier slot: the pair counts once.
        const uint32_t same = __match_any_sync(~0u, expert);
        const bool repeated = (same & ((1u << lane) - 1u)) || row_has_expert(topk, k0, expert);
        for (uint32_t m = targets; m; m &= m - 1) {
          const int d = __ffs(m) - 1;
          const int64_t at = int64_t(__shfl_sync(~0u, pos, d)) * a.num_topk + k;
          if (k >= a.num_topk) continue;
          const int32_t local = local_expert_on(expert, d, a.num_experts, a.experts_per_rank());
          static_cast<int32_t*>(dest[d][2])[at] = local;
          static_cast<float*>(dest[d][3])[at] = local >= 0 ? weight : 0.f;
          if (local >= 0 && !repeated)
            atomicAdd(&link.self->expert_tally[d * a.experts_per_rank() + local], 1);
        }
      }
    }
    __syncwarp();  // the warp's scale and row-address staging is free again
  }

  // Padding rows of this rank's own outputs: zeros, expert -1, weight 0.
  const int64_t pad_rows = a.out_rows - present;
  if (pad_rows > 0) {
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    uint8_t* x_pad = static_cast<uint8_t*>(a.x_out) + present * out_row;
    if (out_row % 16 == 0) {
      for (int64_t i = tid; i < pad_rows * out_row / 16; i += stride)
        reinterpret_cast<int4*>(x_pad)[i] = make_int4(0, 0, 0, 0);
    } else {
      for (int64_t i = tid; i < pad_rows * out_row; i += stride) x_pad[i] = 0;
    }
    if (kFp8)
      for (int64_t i = tid; i < pad_rows * num_scales; i += stride)
        a.scales_out[present * num_scales + i] = 0.f;
    if (!a.cached)
      for (int64_t i = tid; i < pad_rows * a.num_topk; i += stride) {
        a.topk_out[present * a.num_topk + i] = -1;
        a.weights_out[present * a.num_topk + i] = 0.f;
      }
  }

  __threadfence_system();  // every thread's stores, before the last block announces them
  if (!last_block_done(&link.self->ticket)) return;
  const int El = a.experts_per_rank();
  if (!a.cached)  // each destination gets this rank's tally of the rows it was sent
    for (int i = threadIdx.x; i < R * El; i += blockDim.x)
      link.peers[i / El]->expert_inbox[((seq & 1) * R + link.rank) * El + i % El] =
          link.self->expert_tally[i];
  __threadfence_system();
  __syncthreads();
  finish_op(link, seq, kWaitArrived);
  if (!a.cached)
    for (int e = threadIdx.x; e < El; e += blockDim.x) {
      int total = 0;
      for (int src = 0; src < R; ++src)
        total += static_cast<volatile int32_t*>(link.self->expert_inbox)[((seq & 1) * R + src) * El + e];
      a.tokens_per_expert[e] = total;
    }
}

template <typename T, bool kFp8>
cudaError_t launch_send(const Params& p, int blocks, bool aligned, cudaStream_t stream) {
  const size_t smem = kFp8 ? kSendWarps * p.a.scales_per_row() * sizeof(float) : 0;
  return launch(send_kernel<T, kFp8>, blocks, kSendWarps * 32, smem, stream, p, aligned);
}

}  // namespace

std::string dispatch(Comm& comm, int device, cudaStream_t stream, const DispatchArgs& a) {
  Comm::Rank* rank = nullptr;
  if (auto err = comm.rank_on(device, &rank); !err.empty()) return err;
  if (a.fp8 && a.scales_per_row() > kMaxScales) return "jax_ep: fp8 dispatch supports hidden <= 131072";
  if (!a.cached && a.num_tokens > kRouteTokens * kMaxRouteChunks)
    return "jax_ep: dispatch supports at most " + std::to_string(kRouteTokens * kMaxRouteChunks) +
           " tokens per rank";
  const Params p{a, rank->link};
  const int blocks = bandwidth_blocks(comm.knobs, device);
  if (!a.cached) {
    const int chunks = max(1, (a.num_tokens + kRouteTokens - 1) / kRouteTokens);
    route_kernel<<<chunks, kRouteTokens, 0, stream>>>(p);
    JAX_EP_CUDA_TRY(cudaGetLastError());
  }

  const bool aligned = (int64_t(a.hidden) * dtype_size(a.x_dtype)) % 16 == 0;
  JAX_EP_CUDA_TRY(with_row_type(a.x_dtype, a.fp8, [&](auto t, auto fp8) {
    return launch_send<decltype(t), decltype(fp8)::value>(p, blocks, aligned, stream);
  }));
  return {};
}

}  // namespace jax_ep::cuda
