// Low-latency dispatch and combine for decode batches (T <= the Buffer's low_latency_tokens):
// one kernel per op, or one per half when split. Nothing is exchanged before the data moves:
//   dispatch send  every block finds each token's row j among those this rank sends to d (a scan
//                  over the T tokens, redundant per block), then warps quantise and store each
//                  token once per destination rank straight into row j of that rank's region,
//                  with its local expert ids and weights; the row counts follow; the last block
//                  raises `arrived` on every rank and commits the op number.
//   dispatch recv  waits for every source's flag, copies the rows into XLA's buffers in (source
//                  rank, token) order, tallies tokens per expert; the last block releases the
//                  slot to every source.
//   combine send   each received row goes back into row j of its source's region;
//   combine recv   each token sums its rows from its region in rank order, onto the bias.
// The regions and flags are described in comm.cuh.
#include "kernels/cuda/comm.cuh"
#include "kernels/cuda/rows.cuh"
#include "kernels/layout.h"

namespace jax_ep::cuda {
namespace {

constexpr int kWarps = 16;
constexpr int kMaxTokens = 1024;  // the Buffer's bound on low_latency_tokens
constexpr int64_t kCopyChunk = 32 * 8 * 16;  // bytes one warp moves per round of copy_bytes

// The op this kernel serves: the next one of its kind when it sends, else the one its send
// half returned.
__device__ __forceinline__ uint64_t op_of(const Link& link, int kind, int half,
                                          const int32_t* ticket_in) {
  __shared__ uint64_t op;
  if (threadIdx.x == 0)
    op = half & kSend
             ? *reinterpret_cast<const volatile uint64_t*>(&link.self->low_latency.seq[kind]) + 1
             : uint64_t(uint32_t(*ticket_in));
  __syncthreads();
  return op;
}

// Before writing into the slot of op `op` on every rank: each has read op - 2 from it.
__device__ __forceinline__ void wait_slot_free(const Link& link, int kind, uint64_t op) {
  const int d = threadIdx.x;
  if (d < link.num_ranks && op > 2)
    wait_for(link, &link.self->low_latency.released[kind][d], op - 2, kWaitReleased, d);
  __syncthreads();
}

// The end of a send half, in its last block: the rows are on every rank; commit the op number.
__device__ __forceinline__ void finish_send(const Link& link, int kind, uint64_t op,
                                            int32_t* ticket_out) {
  if (!last_block_done(&link.self->low_latency.tickets[kind][0])) return;
  if (threadIdx.x < link.num_ranks)
    store_release(&link.peers[threadIdx.x]->low_latency.arrived[kind][link.rank], op);
  if (threadIdx.x == 0) {
    *reinterpret_cast<volatile uint64_t*>(&link.self->low_latency.seq[kind]) = op;
    if (ticket_out) *ticket_out = int32_t(op);
  }
}

__device__ __forceinline__ void wait_arrivals(const Link& link, int kind, uint64_t op) {
  const int s = threadIdx.x;
  if (s < link.num_ranks) wait_for(link, &link.self->low_latency.arrived[kind][s], op, kWaitArrived, s);
  __syncthreads();
}

// The end of a recv half: true in its last block, after every source learnt its slot is free.
__device__ __forceinline__ bool finish_recv(const Link& link, int kind, uint64_t op) {
  if (!last_block_done(&link.self->low_latency.tickets[kind][1])) return false;
  if (threadIdx.x < link.num_ranks)
    store_release(&link.peers[threadIdx.x]->low_latency.released[kind][link.rank], op);
  return true;
}

// first[s]: the first row from source s, in source order; first[R]: rows in all.
__device__ __forceinline__ void row_offsets(int num_ranks, const int32_t* counts, bool is_volatile,
                                            int32_t* first) {
  if (threadIdx.x == 0) {
    int running = 0;
    for (int s = 0; s < num_ranks; ++s) {
      first[s] = running;
      running += is_volatile ? *reinterpret_cast<const volatile int32_t*>(counts + s) : counts[s];
    }
    first[num_ranks] = running;
  }
  __syncthreads();
}

__device__ __forceinline__ int source_of(const int32_t* first, int row) {
  int s = 0;
  while (first[s + 1] <= row) ++s;
  return s;
}

// A row split into `parts` ranges of whole copy rounds, so that few rows still use many warps.
__device__ __forceinline__ int parts_per_row(int rows, int64_t row_bytes) {
  const int warps = gridDim.x * kWarps;
  const int rounds = int((row_bytes + kCopyChunk - 1) / kCopyChunk);
  return max(1, min(rounds, warps / max(rows, 1)));
}

struct DispatchParams {
  LowLatencyDispatchArgs d;
  Link link;
};

template <typename T, bool kFp8>
__device__ __forceinline__ void send_tokens(const DispatchParams& p, uint64_t op, float* stage,
                                            bool aligned) {
  using Step = RowStep<T, kFp8>;
  const DispatchArgs& a = p.d.a;
  const Link& link = p.link;
  const LowLatencyLink& ll = link.low_latency;
  const int R = link.num_ranks, me = link.rank, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int tokens = a.num_tokens, slot = int(op & 1);
  const bool fresh = !a.cached;
  __shared__ uint32_t mask[kMaxTokens];                  // destination ranks of each token
  __shared__ int32_t before[kMaxTokens / 32][kMaxRanks];  // rows earlier 32-token chunks send
  __shared__ int32_t invalid;
  __shared__ uint8_t* x_dst[kWarps][kMaxRanks];          // the warp's token's row on each rank
  __shared__ float* scale_dst[kWarps][kMaxRanks];
  if (threadIdx.x == 0) invalid = 0;
  wait_slot_free(link, kLowLatencyDispatch, op);

  for (int t = threadIdx.x; t < tokens; t += blockDim.x) {
    uint32_t m = 0;
    if (fresh) {
      const int32_t* topk = a.topk_idx + int64_t(t) * a.num_topk;
      m = dest_rank_mask(topk, a.num_topk, a.num_experts, a.experts_per_rank());
      const int bad = blockIdx.x == 0 ? count_invalid(topk, a.num_topk, a.num_experts) : 0;
      if (bad) atomicAdd(&invalid, bad);
    } else {
      for (int d = 0; d < R; ++d) m |= uint32_t(a.send_pos[int64_t(t) * R + d] >= 0) << d;
    }
    mask[t] = m;
  }
  __syncthreads();
  const int chunks = (tokens + 31) / 32;
  if (fresh) {
    for (int i = threadIdx.x; i < chunks * R; i += blockDim.x) {
      const int c = i / R, d = i % R;
      int n = 0;
      for (int t = c * 32; t < min(tokens, c * 32 + 32); ++t) n += mask[t] >> d & 1;
      before[c][d] = n;
    }
    __syncthreads();
    if (threadIdx.x < R) {
      const int d = threadIdx.x;
      int running = 0;
      for (int c = 0; c < chunks; ++c) {
        const int n = before[c][d];
        before[c][d] = running;
        running += n;
      }
      if (blockIdx.x == 0) link.peers[d]->low_latency.counts[slot][me] = running;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) *a.num_invalid = invalid;
    __syncthreads();
  }

  const int steps = (a.hidden + Step::kStep - 1) / Step::kStep;
  const int warps = gridDim.x * kWarps;
  const int parts = max(1, min(steps, warps / max(tokens, 1)));
  const int per_part = (steps + parts - 1) / parts;
  for (int u = blockIdx.x * kWarps + warp; u < tokens * parts; u += warps) {
    const int t = u / parts, part = u % parts;
    const uint32_t m = mask[t];
    int32_t j = -1;  // lane d: the token's row among those this rank sends to d
    if (lane < R && (m >> lane & 1)) {
      if (fresh) {
        j = before[t / 32][lane];
        for (int s = t / 32 * 32; s < t; ++s) j += mask[s] >> lane & 1;
      } else {
        j = a.send_pos[int64_t(t) * R + lane];
      }
    }
    if (fresh && part == 0 && lane < R) a.send_pos[int64_t(t) * R + lane] = j;
    if (!m) continue;
    if (j >= 0) {
      uint8_t* row = ll.row(kLowLatencyDispatch, lane, slot, me, j, R);
      x_dst[warp][lane] = row;
      scale_dst[warp][lane] = reinterpret_cast<float*>(row + ll.scales_at());
    }
    __syncwarp();
    const int first = part * per_part, end = min(steps, first + per_part);
    const uint8_t* x = static_cast<const uint8_t*>(a.x) + int64_t(t) * a.hidden * sizeof(T);
    if (first < end)
      send_row<T, kFp8>(x, a.hidden, a.round_scale, m, x_dst[warp], scale_dst[warp], stage, first,
                        end, aligned);
    if (fresh && part == 0) {  // the token's slots as each destination sees them
      const int32_t* topk = a.topk_idx + int64_t(t) * a.num_topk;
      for (uint32_t mm = m; mm; mm &= mm - 1) {
        const int d = __ffs(mm) - 1;
        int32_t* ids = reinterpret_cast<int32_t*>(x_dst[warp][d] + ll.meta_at());
        float* weights = reinterpret_cast<float*>(ids + a.num_topk);
        for (int k = lane; k < a.num_topk; k += 32) {
          const int32_t local = local_expert_on(topk[k], d, a.num_experts, a.experts_per_rank());
          ids[k] = local;
          weights[k] = local >= 0 ? a.topk_weights[int64_t(t) * a.num_topk + k] : 0.f;
        }
      }
    }
    __syncwarp();
  }
  finish_send(link, kLowLatencyDispatch, op, p.d.ticket_out);
}

__device__ __forceinline__ void receive_tokens(const DispatchParams& p, uint64_t op,
                                               int32_t* tally) {
  const DispatchArgs& a = p.d.a;
  const Link& link = p.link;
  const LowLatencyLink& ll = link.low_latency;
  const int R = link.num_ranks, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int slot = int(op & 1), K = a.num_topk, El = a.experts_per_rank();
  const bool fresh = !a.cached;
  __shared__ int32_t first[kMaxRanks + 1];
  if (fresh)
    for (int e = threadIdx.x; e < El; e += blockDim.x) tally[e] = 0;
  wait_arrivals(link, kLowLatencyDispatch, op);
  row_offsets(R, fresh ? link.self->low_latency.counts[slot] : p.d.recv_counts_in, fresh, first);
  const int present = min(first[R], a.out_rows);
  if (fresh && blockIdx.x == 0 && threadIdx.x == 0) {
    for (int s = 0; s < R; ++s) a.recv_counts[s] = first[s + 1] - first[s];
    *a.num_recv = present;
    *a.num_dropped = first[R] - present;
  }

  const int64_t x_bytes = a.x_out_row_bytes();
  const int num_scales = a.fp8 ? a.scales_per_row() : 0;
  for (int i = blockIdx.x * kWarps + warp; i < a.out_rows; i += gridDim.x * kWarps) {
    uint8_t* x_out = static_cast<uint8_t*>(a.x_out) + i * x_bytes;
    const uint8_t* row = nullptr;  // padding rows: zeros, expert -1, weight 0
    if (i < present) {
      const int s = source_of(first, i);
      row = ll.row(kLowLatencyDispatch, link.rank, slot, s, i - first[s], R);
    }
    copy_bytes(x_out, row, 0, x_bytes);
    if (num_scales)
      copy_bytes(a.scales_out + int64_t(i) * num_scales, row ? row + ll.scales_at() : nullptr, 0,
                 4 * num_scales);
    if (!fresh) continue;
    const int32_t* ids = row ? reinterpret_cast<const int32_t*>(row + ll.meta_at()) : nullptr;
    for (int k = lane; k < K; k += 32) {
      const int32_t e = ids ? ids[k] : -1;
      a.topk_out[int64_t(i) * K + k] = e;
      a.weights_out[int64_t(i) * K + k] = ids ? reinterpret_cast<const float*>(ids + K)[k] : 0.f;
      if (e >= 0 && !row_has_expert(ids, k, e)) atomicAdd(&tally[e], 1);  // pairs count once
    }
  }
  if (fresh) {
    __syncthreads();
    for (int e = threadIdx.x; e < El; e += blockDim.x)
      if (tally[e]) atomicAdd(&ll.expert_count[e], tally[e]);
  }
  if (finish_recv(link, kLowLatencyDispatch, op) && fresh)
    for (int e = threadIdx.x; e < El; e += blockDim.x)
      a.tokens_per_expert[e] = atomicExch(&ll.expert_count[e], 0);
}

template <typename T, bool kFp8>
__global__ void __launch_bounds__(kWarps * 32, 1) dispatch_kernel(DispatchParams p, bool aligned) {
  extern __shared__ float dynamic[];  // per warp its row's scales, then the expert tally
  const int num_scales = kFp8 ? p.d.a.scales_per_row() : 0;
  const uint64_t op = op_of(p.link, kLowLatencyDispatch, p.d.half, p.d.ticket_in);
  if (p.d.half & kSend)
    send_tokens<T, kFp8>(p, op, dynamic + threadIdx.x / 32 * num_scales, aligned);
  if (p.d.half & kRecv)
    receive_tokens(p, op, reinterpret_cast<int32_t*>(dynamic + kWarps * num_scales));
}

struct CombineParams {
  LowLatencyCombineArgs c;
  Link link;
};

// Each received row goes back to row j of its source's region (zeros for rows dropped at
// dispatch, which the source then adds harmlessly).
__device__ __forceinline__ void send_back(const CombineParams& p, uint64_t op) {
  const CombineArgs& a = p.c.a;
  const Link& link = p.link;
  const LowLatencyLink& ll = link.low_latency;
  const int R = link.num_ranks, warp = threadIdx.x / 32, slot = int(op & 1);
  __shared__ int32_t first[kMaxRanks + 1];
  wait_slot_free(link, kLowLatencyCombine, op);
  row_offsets(R, p.c.recv_counts, false, first);
  const int rows = first[R], present = *p.c.num_rows;
  const int64_t row_bytes = int64_t(a.width) * dtype_size(a.rows_dtype);
  const int parts = row_bytes % 16 ? 1 : parts_per_row(rows, row_bytes);
  const int64_t part_bytes =
      parts == 1 ? row_bytes : ((row_bytes + parts - 1) / parts + kCopyChunk - 1) / kCopyChunk * kCopyChunk;
  for (int u = blockIdx.x * kWarps + warp; u < rows * parts; u += gridDim.x * kWarps) {
    const int i = u / parts, part = u % parts, s = source_of(first, i);
    const int64_t begin = part * part_bytes;
    if (begin >= row_bytes) continue;
    uint8_t* to = ll.row(kLowLatencyCombine, s, slot, link.rank, i - first[s], R);
    const uint8_t* from = i < present ? static_cast<const uint8_t*>(a.row_data) + i * row_bytes
                                      : nullptr;
    copy_bytes(to, from, begin, min(begin + part_bytes, row_bytes));
  }
  finish_send(link, kLowLatencyCombine, op, p.c.ticket_out);
}

// out[t] = bias[t] + its rows from every rank it was sent to, in rank order, in float32.
__device__ __forceinline__ void sum_back(const CombineParams& p, uint64_t op) {
  const CombineArgs& a = p.c.a;
  const Link& link = p.link;
  const LowLatencyLink& ll = link.low_latency;
  const int R = link.num_ranks, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int slot = int(op & 1);
  __shared__ const int4* row_at[kWarps][kMaxRanks];
  wait_arrivals(link, kLowLatencyCombine, op);
  const int64_t row_bytes = int64_t(a.width) * dtype_size(a.rows_dtype);
  const int vectors = int(row_bytes / 16);
  const int parts = row_bytes % 16 ? 1 : parts_per_row(a.num_tokens, row_bytes);
  const int per_part = (vectors + parts - 1) / parts;
  for (int u = blockIdx.x * kWarps + warp; u < a.num_tokens * parts; u += gridDim.x * kWarps) {
    const int t = u / parts, part = u % parts;
    const int32_t j = lane < R ? a.send_pos[int64_t(t) * R + lane] : -1;
    const uint32_t sources = __ballot_sync(~0u, j >= 0);
    if (j >= 0)
      row_at[warp][lane] = reinterpret_cast<const int4*>(
          ll.row(kLowLatencyCombine, link.rank, slot, lane, j, R));
    __syncwarp();
    if (row_bytes % 16 == 0) {
      sum_rows(a, t, sources, row_at[warp], part * per_part, min(vectors, (part + 1) * per_part));
    } else {
      for (int c = lane; c < a.width; c += 32) {
        const int64_t at = int64_t(t) * a.width + c;
        float acc = a.has_bias ? load_float(a.bias, at, a.bias_dtype) : 0.f;
        for (uint32_t m = sources; m; m &= m - 1)
          acc += load_float(row_at[warp][__ffs(m) - 1], c, a.rows_dtype);
        store_float(a.out, at, a.out_dtype, acc);
      }
    }
    __syncwarp();
  }
  finish_recv(link, kLowLatencyCombine, op);
}

__global__ void __launch_bounds__(kWarps * 32, 1) combine_kernel(CombineParams p) {
  const uint64_t op = op_of(p.link, kLowLatencyCombine, p.c.half, p.c.ticket_in);
  if (p.c.half & kSend) send_back(p, op);
  if (p.c.half & kRecv) sum_back(p, op);
}

template <typename T, bool kFp8>
cudaError_t launch_dispatch(const DispatchParams& p, int blocks, bool aligned, cudaStream_t stream) {
  const size_t smem = sizeof(float) * (kFp8 ? kWarps * p.d.a.scales_per_row() : 0) +
                      sizeof(int32_t) * p.d.a.experts_per_rank();
  return launch(dispatch_kernel<T, kFp8>, blocks, kWarps * 32, smem, stream, p, aligned);
}

// Why the low-latency kernels cannot take this call, or "".
std::string check(const LowLatencyLink& ll, int tokens, int hidden) {
  if (ll.tokens == 0)
    return "jax_ep: this Buffer has no low-latency memory (low_latency_tokens=0)";
  if (tokens > ll.tokens)
    return "jax_ep: " + std::to_string(tokens) + " tokens per rank, more than the Buffer's "
           "low_latency_tokens=" + std::to_string(ll.tokens);
  if (hidden > ll.hidden)
    return "jax_ep: rows wider than the Buffer's hidden=" + std::to_string(ll.hidden);
  return {};
}

}  // namespace

std::string low_latency_dispatch(Comm& comm, int device, cudaStream_t stream,
                                 const LowLatencyDispatchArgs& d) {
  Comm::Rank* rank = nullptr;
  if (auto err = comm.rank_on(device, &rank); !err.empty()) return err;
  const DispatchArgs& a = d.a;
  if (auto err = check(rank->link.low_latency, a.num_tokens, a.hidden); !err.empty())
    return err;
  if (!a.cached && a.num_topk != rank->link.low_latency.num_topk)
    return "jax_ep: topk_idx has " + std::to_string(a.num_topk) + " slots, the Buffer " +
           std::to_string(rank->link.low_latency.num_topk);
  const DispatchParams p{d, rank->link};
  const int blocks = bandwidth_blocks(comm.knobs, device);
  const bool aligned = (int64_t(a.hidden) * dtype_size(a.x_dtype)) % 16 == 0;
  JAX_EP_CUDA_TRY(with_row_type(a.x_dtype, a.fp8, [&](auto t, auto fp8) {
    return launch_dispatch<decltype(t), decltype(fp8)::value>(p, blocks, aligned, stream);
  }));
  return {};
}

std::string low_latency_combine(Comm& comm, int device, cudaStream_t stream,
                                const LowLatencyCombineArgs& c) {
  Comm::Rank* rank = nullptr;
  if (auto err = comm.rank_on(device, &rank); !err.empty()) return err;
  const LowLatencyLink& ll = rank->link.low_latency;
  if (auto err = check(ll, c.a.num_tokens, 0); !err.empty()) return err;
  if (int64_t(c.a.width) * dtype_size(c.a.rows_dtype) > ll.combine_row())
    return "jax_ep: combine rows wider than 4 * hidden bytes";
  const CombineParams p{c, rank->link};
  combine_kernel<<<bandwidth_blocks(comm.knobs, device), kWarps * 32, 0, stream>>>(p);
  JAX_EP_CUDA_TRY(cudaGetLastError());
  return {};
}

}  // namespace jax_ep::cuda
