// Low-latency dispatch and combine for decode batches (T <= the Buffer's low_latency_tokens):
// one kernel per op, or one per half when split. Nothing is exchanged before the data moves and
// no step waits for a whole grid: every part of a row carries its own flag.
//   dispatch send  every block finds each token's row j among those this rank sends to d (a
//                  ballot scan over the T tokens, redundant per block; block 0 tells each rank
//                  how many rows it gets, in all and per expert); warps quantise and store
//                  pieces of each token's row once per destination rank straight into row j of
//                  that rank's region, with the token's local expert ids and weights, then raise
//                  the pieces' flags.
//   dispatch recv  warps take pieces of the output rows in (source rank, token) order, wait for
//                  their flags and copy them into XLA's buffers; block 0 sums the sources'
//                  counts per expert.
//   combine send   each received row goes back into row j of its source's region, flagged;
//   combine recv   each token sums its rows from its region in rank order, onto the bias, piece
//                  by piece as their flags rise.
// The next kernel of the same kind releases the op's slot to its senders. The regions and flags
// are described in comm.cuh.
#include "kernels/cuda/comm.cuh"
#include "kernels/cuda/rows.cuh"
#include "kernels/layout.h"

namespace jax_ep::cuda {
namespace {

constexpr int kWarps = 16;
constexpr int kMaxTokens = 1024;  // the Buffer's bound on low_latency_tokens
constexpr int kChunks = kMaxTokens / 32;

// The op this kernel serves, into `op` once the caller's next barrier has passed. A send half's
// blocks count themselves on `started`; every send half of a kind runs gridDim.x blocks, so the
// count names the op. A recv half serves the op its send half returned, whose low 32 bits the
// ticket holds: the last op sent, or the one before. Block 0 first releases, on every source, the
// last op of each slot this rank received (see comm.cuh).
__device__ __forceinline__ void begin_op(const Link& link, int kind, int half,
                                         const int32_t* ticket_in, uint64_t* op) {
  const LowLatencyState& mine = link.self->low_latency;
  if (blockIdx.x == 0 && threadIdx.x < link.num_ranks)
    for (int slot = 0; slot < 2; ++slot)
      store_relaxed(&link.peers[threadIdx.x]->low_latency.released[kind][slot][link.rank],
                    *reinterpret_cast<const volatile uint64_t*>(&mine.received[kind][slot]));
  if (threadIdx.x == 0) {
    auto* started = reinterpret_cast<unsigned long long*>(&link.self->low_latency.started[kind]);
    if (half & kSend) {
      *op = atomicAdd(started, 1ull) / gridDim.x + 1;
    } else {
      const uint64_t last = *reinterpret_cast<volatile unsigned long long*>(started) / gridDim.x;
      *op = last - uint32_t(uint32_t(last) - uint32_t(*ticket_in));
    }
  }
}

// Before writing into the slot of op `op` on every rank: each has read op - 2 from it. Warp 1
// waits (warp 0 is free for other work meanwhile); the caller's next barrier completes it.
__device__ __forceinline__ void wait_slot_free(const Link& link, int kind, uint64_t op) {
  const int d = threadIdx.x - 32;
  if (d >= 0 && d < link.num_ranks && op > 2)
    wait_for(link, &link.self->low_latency.released[kind][op & 1][d], op - 2, kWaitReleased, d);
}

// The end of a recv half, in every block: the next kernel of this kind releases the op.
__device__ __forceinline__ void finish_recv(const Link& link, int kind, uint64_t op) {
  if (threadIdx.x == 0)
    *reinterpret_cast<volatile uint64_t*>(&link.self->low_latency.received[kind][op & 1]) = op;
}

// How a warp's work splits rows into pieces of whole parts: few rows still use many warps.
struct Pieces {
  int parts, per_piece, pieces;  // per row
  __device__ Pieces(int rows, int width) {
    parts = (width + kPartElems - 1) / kPartElems;
    const int warps = gridDim.x * kWarps;
    const int want = max(1, min(parts, warps / max(rows, 1)));
    per_piece = (parts + want - 1) / want;
    pieces = (parts + per_piece - 1) / per_piece;
  }
  __device__ int first(int piece) const { return piece * per_piece; }
  __device__ int end(int piece) const { return min(parts, (piece + 1) * per_piece); }
};

// The warp's stores of its pieces are done before any of their flags rises: then the lanes raise
// flags [p0, p1) of `row` to `op`.
__device__ __forceinline__ void raise_flags(uint64_t* flags, int p0, int p1, uint64_t op) {
  for (int p = p0 + threadIdx.x % 32; p < p1; p += 32) store_relaxed(flags + p, op);
}

// The warp waits until flags [p0, p1) of every row in rows[d], d in `from`, reached `op`.
__device__ __forceinline__ void wait_flags(const Link& link, uint64_t* const* flags, uint32_t from,
                                           int p0, int p1, uint64_t op) {
  const int n = p1 - p0;
  for (uint32_t m = from; m; m &= m - 1) {
    const int d = __ffs(m) - 1;
    for (int p = p0 + threadIdx.x % 32; p < p0 + n; p += 32)
      wait_for(link, flags[d] + p, op, kWaitArrived, d);
  }
  __syncwarp();
}

// first[s]: the first row from source s, in source order; first[R]: rows in all.
__device__ __forceinline__ void row_offsets(const Link& link, const int32_t* counts,
                                            const uint64_t* words, uint64_t op, int32_t* first) {
  __shared__ int32_t rows[kMaxRanks];
  const int s = threadIdx.x;
  if (s < link.num_ranks) {
    if (words) {  // op << 24 | rows, written by the source
      wait_for(link, words + s, op << 24, kWaitCounts, s);
      rows[s] = int32_t(*reinterpret_cast<const volatile uint64_t*>(words + s) & 0xffffff);
    } else {
      rows[s] = counts[s];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int running = 0;
    for (int r = 0; r < link.num_ranks; ++r) {
      first[r] = running;
      running += rows[r];
    }
    first[link.num_ranks] = running;
  }
  __syncthreads();
}

__device__ __forceinline__ int source_of(const int32_t* first, int row) {
  int s = 0;
  while (first[s + 1] <= row) ++s;
  return s;
}

struct DispatchParams {
  LowLatencyDispatchArgs d;
  Link link;
};

// Which ranks each token goes to and its row j among the tokens this rank sends there: bit t%32
// of sent_to[t/32][d], and before[t/32][d] + the set bits below it.
struct SendScan {
  uint32_t sent_to[kChunks][kMaxRanks];
  int32_t before[kChunks][kMaxRanks];
  __device__ uint32_t mask(int t, int num_ranks) const {
    uint32_t m = 0;
    for (int d = 0; d < num_ranks; ++d) m |= (sent_to[t / 32][d] >> (t % 32) & 1u) << d;
    return m;
  }
  __device__ int32_t row(int t, int d) const {
    return before[t / 32][d] + __popc(sent_to[t / 32][d] & ((1u << (t % 32)) - 1u));
  }
};

// A warp per chunk of 32 tokens ballots their destinations; bad[warp] counts the invalid expert
// ids its chunks hold. Needs no op number, so it runs while the op starts.
__device__ __forceinline__ void ballot_tokens(const DispatchArgs& a, int num_ranks, SendScan& scan,
                                              int32_t* bad) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int chunks = (a.num_tokens + 31) / 32;
  int invalid = 0;
  for (int c = warp; c < chunks; c += kWarps) {
    const int t = c * 32 + lane;
    uint32_t m = 0;
    if (t < a.num_tokens) {
      if (a.cached) {
        for (int d = 0; d < num_ranks; ++d)
          m |= uint32_t(a.send_pos[int64_t(t) * num_ranks + d] >= 0) << d;
      } else {
        const int32_t* topk = a.topk_idx + int64_t(t) * a.num_topk;
        m = dest_rank_mask(topk, a.num_topk, a.num_experts, a.experts_per_rank());
        invalid += count_invalid(topk, a.num_topk, a.num_experts);
      }
    }
    for (int d = 0; d < num_ranks; ++d) {
      const uint32_t ballot = __ballot_sync(~0u, m >> d & 1u);
      if (lane == 0) scan.sent_to[c][d] = ballot;
    }
  }
  for (int off = 16; off; off /= 2) invalid += __shfl_xor_sync(~0u, invalid, off);
  if (lane == 0) bad[warp] = invalid;
}

// Warp 0, after the ballots: each chunk's first row per rank. total[d]: rows sent to rank d.
__device__ __forceinline__ void scan_rows(int num_tokens, int num_ranks, SendScan& scan,
                                          int32_t* total) {
  const int lane = threadIdx.x % 32, chunks = (num_tokens + 31) / 32;
  for (int d = 0; d < num_ranks; ++d) {
    const int n = lane < chunks ? __popc(scan.sent_to[lane][d]) : 0;
    int inclusive = n;
#pragma unroll
    for (int off = 1; off < 32; off *= 2) {
      const int up = __shfl_up_sync(~0u, inclusive, off);
      if (lane >= off) inclusive += up;
    }
    if (lane < chunks) scan.before[lane][d] = inclusive - n;
    if (lane == 31) total[d] = inclusive;
  }
}

// Block 0 of a fresh dispatch: per expert, the tokens this rank sends it (a token counts once per
// expert however many of its slots name it), tally[e] zeroed beforehand.
__device__ __forceinline__ void tally_sent(const DispatchArgs& a, int32_t* tally) {
  const int K = a.num_topk;
  for (int i = threadIdx.x; i < a.num_tokens * K; i += blockDim.x) {
    const int32_t* topk = a.topk_idx + int64_t(i / K) * K;
    const int k = i % K;
    const int32_t e = topk[k];
    if (is_routed(e, a.num_experts) && !row_has_expert(topk, k, e)) atomicAdd(&tally[e], 1);
  }
}

// The start of a send half: the routing scan runs beside the op's start and the wait for its
// slot. Then block 0 tells every rank how many rows it gets and how many of them go to each of
// its experts, and counts the invalid ids. `tally`: shared memory for num_experts counts.
__device__ __forceinline__ uint64_t start_send(const DispatchParams& p, const uint64_t& op_ref,
                                               SendScan& scan, int32_t* tally) {
  const DispatchArgs& a = p.d.a;
  const Link& link = p.link;
  const int R = link.num_ranks, warp = threadIdx.x / 32, El = a.experts_per_rank();
  const bool block_zero_fresh = blockIdx.x == 0 && !a.cached;
  __shared__ int32_t bad[kWarps], total[kMaxRanks];
  if (block_zero_fresh)
    for (int e = threadIdx.x; e < a.num_experts; e += blockDim.x) tally[e] = 0;
  ballot_tokens(a, R, scan, bad);
  __syncthreads();  // the op's number, the ballots, the zeroed tally
  const uint64_t op = op_ref;
  wait_slot_free(link, kLowLatencyDispatch, op);
  if (warp == 0) scan_rows(a.num_tokens, R, scan, total);
  if (block_zero_fresh) tally_sent(a, tally);
  __syncthreads();
  if (block_zero_fresh) {
    const int d = threadIdx.x;
    if (d < R)
      store_relaxed(&link.peers[d]->low_latency.counts[op & 1][link.rank],
                    op << 24 | uint64_t(total[d]));
    if (d == 0) {
      int invalid = 0;
      for (int w = 0; w < kWarps; ++w) invalid += bad[w];
      *a.num_invalid = invalid;
    }
    for (int e = threadIdx.x; e < a.num_experts; e += blockDim.x)
      store_relaxed(link.low_latency.expert_rows_from(e / El, int(op & 1), link.rank, R, El) + e % El,
                    op << 16 | uint64_t(tally[e]));
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 && p.d.ticket_out) *p.d.ticket_out = int32_t(op);
  return op;
}

template <typename T, bool kFp8>
__device__ __forceinline__ void send_tokens(const DispatchParams& p, const uint64_t& op_ref,
                                            float* stage, int32_t* tally, bool aligned) {
  using Step = RowStep<T, kFp8>;
  static_assert(kPartElems % Step::kStep == 0, "a part is whole steps");
  constexpr int kStepsPerPart = kPartElems / Step::kStep;
  const DispatchArgs& a = p.d.a;
  const Link& link = p.link;
  const LowLatencyLink& ll = link.low_latency;
  const int R = link.num_ranks, me = link.rank, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int K = a.num_topk;
  const bool fresh = !a.cached;
  __shared__ SendScan scan;
  __shared__ uint8_t* x_dst[kWarps][kMaxRanks];  // the warp's token's row on each rank
  __shared__ float* scale_dst[kWarps][kMaxRanks];
  const Pieces pieces(a.num_tokens, a.hidden);
  const int units = a.num_tokens * pieces.pieces, stride = gridDim.x * kWarps;
  {  // the warp's first piece of x and its token's slots, on their way to L2 while we wait
    const int u = blockIdx.x * kWarps + warp, t = u / pieces.pieces, piece = u % pieces.pieces;
    if (u < units) {
      const uint8_t* x = static_cast<const uint8_t*>(a.x) + int64_t(t) * a.hidden * sizeof(T);
      const int64_t begin = int64_t(pieces.first(piece)) * kPartElems * sizeof(T);
      const int64_t end = min(int64_t(pieces.end(piece)) * kPartElems, int64_t(a.hidden)) * sizeof(T);
      for (int64_t at = begin + lane * 128; at < end; at += 32 * 128) prefetch_l2(x + at);
      if (fresh && piece == 0 && lane == 0) {
        prefetch_l2(a.topk_idx + int64_t(t) * K);
        prefetch_l2(a.topk_weights + int64_t(t) * K);
      }
    }
  }
  const uint64_t op = start_send(p, op_ref, scan, tally);
  const int slot = int(op & 1);

  const int steps = (a.hidden + Step::kStep - 1) / Step::kStep;
  // The token's row on destination `lane`, or -1.
  auto row_on = [&](int t, uint32_t m) -> int32_t {
    if (lane >= R || !(m >> lane & 1)) return -1;
    return fresh ? scan.row(t, lane) : a.send_pos[int64_t(t) * R + lane];
  };
  for (int u = blockIdx.x * kWarps + warp; u < units; u += stride) {
    const int t = u / pieces.pieces, piece = u % pieces.pieces;
    const uint32_t m = scan.mask(t, R);
    const int32_t j = row_on(t, m);
    if (fresh && piece == 0 && lane < R) a.send_pos[int64_t(t) * R + lane] = j;
    if (!m) continue;
    if (j >= 0) {
      uint8_t* row = ll.row(kLowLatencyDispatch, lane, slot, me, j, R);
      x_dst[warp][lane] = row;
      scale_dst[warp][lane] = reinterpret_cast<float*>(row + ll.scales_at());
    }
    __syncwarp();
    const uint8_t* x = static_cast<const uint8_t*>(a.x) + int64_t(t) * a.hidden * sizeof(T);
    send_row<T, kFp8>(x, a.hidden, a.round_scale, m, x_dst[warp], scale_dst[warp], stage,
                      pieces.first(piece) * kStepsPerPart,
                      min(steps, pieces.end(piece) * kStepsPerPart), aligned);
    if (fresh && piece == 0) {  // the token's slots as each destination sees them
      const int32_t* topk = a.topk_idx + int64_t(t) * K;
      for (uint32_t mm = m; mm; mm &= mm - 1) {
        const int d = __ffs(mm) - 1;
        int32_t* ids = reinterpret_cast<int32_t*>(x_dst[warp][d] + ll.meta_at());
        for (int k = lane; k < K; k += 32) {
          const int32_t local = local_expert_on(topk[k], d, a.num_experts, a.experts_per_rank());
          ids[k] = local;
          reinterpret_cast<float*>(ids + K)[k] =
              local >= 0 ? a.topk_weights[int64_t(t) * K + k] : 0.f;
        }
      }
    }
    __syncwarp();
  }
  // One system fence for all of the warp's stores, then the flags of its pieces.
  __syncwarp();
  fence_release_sys();
  for (int u = blockIdx.x * kWarps + warp; u < units; u += stride) {
    const int t = u / pieces.pieces, piece = u % pieces.pieces;
    const uint32_t m = scan.mask(t, R);
    const int32_t j = row_on(t, m);
    for (uint32_t mm = m; mm; mm &= mm - 1) {
      const int d = __ffs(mm) - 1;
      const int32_t jd = __shfl_sync(~0u, j, d);
      raise_flags(ll.flags(kLowLatencyDispatch, ll.row(kLowLatencyDispatch, d, slot, me, jd, R)),
                  pieces.first(piece), pieces.end(piece), op);
    }
  }
}

// Block 0 (fresh dispatch): tokens per local expert, as their sources counted them, less those in
// rows dropped for capacity (rows [present, first[R])).
__device__ __forceinline__ void tally_experts(const DispatchParams& p, uint64_t op,
                                              const int32_t* first, int present, int32_t* tally) {
  const DispatchArgs& a = p.d.a;
  const Link& link = p.link;
  const LowLatencyLink& ll = link.low_latency;
  const int K = a.num_topk, El = a.experts_per_rank(), R = link.num_ranks, slot = int(op & 1);
  for (int e = threadIdx.x; e < El; e += blockDim.x) {
    int rows = 0;
    for (int s = 0; s < R; ++s) {
      const uint64_t* word = ll.expert_rows_from(link.rank, slot, s, R, El) + e;
      wait_for(link, word, op << 16, kWaitCounts, s);
      rows += int(*reinterpret_cast<const volatile uint64_t*>(word) & 0xffff);
    }
    tally[e] = rows;
  }
  __syncthreads();
  for (int row = present + threadIdx.x; row < first[R]; row += blockDim.x) {
    const int s = source_of(first, row);
    uint8_t* at = ll.row(kLowLatencyDispatch, link.rank, slot, s, row - first[s], R);
    wait_for(link, ll.flags(kLowLatencyDispatch, at), op, kWaitArrived, s);
    const int32_t* ids = reinterpret_cast<const int32_t*>(at + ll.meta_at());
    for (int k = 0; k < K; ++k) {
      const int32_t e = ids[k];
      if (e >= 0 && !row_has_expert(ids, k, e)) atomicSub(&tally[e], 1);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < El; e += blockDim.x) a.tokens_per_expert[e] = tally[e];
}

__device__ __forceinline__ void receive_tokens(const DispatchParams& p, uint64_t op,
                                               int32_t* tally) {
  const DispatchArgs& a = p.d.a;
  const Link& link = p.link;
  const LowLatencyLink& ll = link.low_latency;
  const int R = link.num_ranks, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int slot = int(op & 1), K = a.num_topk;
  const bool fresh = !a.cached;
  __shared__ int32_t first[kMaxRanks + 1];
  __shared__ uint64_t* flags_of[kWarps][kMaxRanks];
  row_offsets(link, p.d.recv_counts_in, fresh ? link.self->low_latency.counts[slot] : nullptr, op,
              first);
  const int present = min(first[R], a.out_rows);
  if (fresh && blockIdx.x == 0) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < R; ++s) a.recv_counts[s] = first[s + 1] - first[s];
      *a.num_recv = present;
      *a.num_dropped = first[R] - present;
    }
    tally_experts(p, op, first, present, tally);
  }

  const int64_t x_elem = a.fp8 ? 1 : dtype_size(a.x_dtype);
  const int num_scales = a.fp8 ? a.scales_per_row() : 0;
  const Pieces pieces(a.out_rows, a.hidden);
  // Block 0, busy with the tally, takes the last units.
  const int order = (blockIdx.x + gridDim.x - 1) % gridDim.x;
  for (int u = order * kWarps + warp; u < a.out_rows * pieces.pieces; u += gridDim.x * kWarps) {
    const int i = u / pieces.pieces, piece = u % pieces.pieces;
    const int p0 = pieces.first(piece), p1 = pieces.end(piece);
    const uint8_t* row = nullptr;  // padding rows: zeros, expert -1, weight 0
    if (i < present) {
      const int s = source_of(first, i);
      uint8_t* at = ll.row(kLowLatencyDispatch, link.rank, slot, s, i - first[s], R);
      if (lane == 0) flags_of[warp][s] = ll.flags(kLowLatencyDispatch, at);
      __syncwarp();
      wait_flags(link, flags_of[warp], 1u << s, p0, p1, op);
      row = at;
    }
    const int64_t e0 = int64_t(p0) * kPartElems, e1 = min(int64_t(a.hidden), int64_t(p1) * kPartElems);
    copy_bytes(static_cast<uint8_t*>(a.x_out) + i * a.x_out_row_bytes(), row, e0 * x_elem,
               e1 * x_elem);
    if (num_scales)
      copy_bytes(a.scales_out + int64_t(i) * num_scales, row ? row + ll.scales_at() : nullptr,
                 e0 / kFp8Block * 4, e1 / kFp8Block * 4);
    if (!fresh || piece != 0) continue;
    const int32_t* ids = row ? reinterpret_cast<const int32_t*>(row + ll.meta_at()) : nullptr;
    for (int k = lane; k < K; k += 32) {
      a.topk_out[int64_t(i) * K + k] = ids ? ids[k] : -1;
      a.weights_out[int64_t(i) * K + k] = ids ? reinterpret_cast<const float*>(ids + K)[k] : 0.f;
    }
  }
  finish_recv(link, kLowLatencyDispatch, op);
}

template <typename T, bool kFp8>
__global__ void __launch_bounds__(kWarps * 32, 1) dispatch_kernel(DispatchParams p, bool aligned) {
  extern __shared__ float dynamic[];  // per warp its row's scales, then the expert tallies
  const int num_scales = kFp8 ? p.d.a.scales_per_row() : 0;
  int32_t* tally = reinterpret_cast<int32_t*>(dynamic + kWarps * num_scales);
  __shared__ uint64_t op;
  begin_op(p.link, kLowLatencyDispatch, p.d.half, p.d.ticket_in, &op);
  if (p.d.half & kSend)
    send_tokens<T, kFp8>(p, op, dynamic + threadIdx.x / 32 * num_scales, tally, aligned);
  else
    __syncthreads();
  if (p.d.half & kRecv)
    receive_tokens(p, op, tally);
}

struct CombineParams {
  LowLatencyCombineArgs c;
  Link link;
};

// Each received row goes back to row j of its source's region (zeros for rows dropped at
// dispatch, which the source then adds harmlessly), then its flags rise.
__device__ __forceinline__ void send_back(const CombineParams& p, uint64_t op) {
  const CombineArgs& a = p.c.a;
  const Link& link = p.link;
  const LowLatencyLink& ll = link.low_latency;
  const int R = link.num_ranks, warp = threadIdx.x / 32, slot = int(op & 1);
  __shared__ int32_t first[kMaxRanks + 1];
  wait_slot_free(link, kLowLatencyCombine, op);
  row_offsets(link, p.c.recv_counts, nullptr, op, first);
  if (blockIdx.x == 0 && threadIdx.x == 0 && p.c.ticket_out) *p.c.ticket_out = int32_t(op);
  const int rows = first[R], present = *p.c.num_rows;
  const int64_t elem = dtype_size(a.rows_dtype), row_bytes = a.width * elem;
  const Pieces pieces(rows, a.width);
  const int units = rows * pieces.pieces, stride = gridDim.x * kWarps;
  auto dest = [&](int i) {
    const int s = source_of(first, i);
    return ll.row(kLowLatencyCombine, s, slot, link.rank, i - first[s], R);
  };
  for (int u = blockIdx.x * kWarps + warp; u < units; u += stride) {
    const int i = u / pieces.pieces, piece = u % pieces.pieces;
    const uint8_t* from = i < present ? static_cast<const uint8_t*>(a.row_data) + i * row_bytes
                                      : nullptr;
    copy_bytes(dest(i), from, pieces.first(piece) * kPartElems * elem,
               min(row_bytes, pieces.end(piece) * kPartElems * elem));
  }
  __syncwarp();
  fence_release_sys();
  for (int u = blockIdx.x * kWarps + warp; u < units; u += stride) {
    const int i = u / pieces.pieces, piece = u % pieces.pieces;
    raise_flags(ll.flags(kLowLatencyCombine, dest(i)), pieces.first(piece), pieces.end(piece), op);
  }
}

// out[t] = bias[t] + its rows from every rank it was sent to, in rank order, in float32.
__device__ __forceinline__ void sum_back(const CombineParams& p, uint64_t op) {
  const CombineArgs& a = p.c.a;
  const Link& link = p.link;
  const LowLatencyLink& ll = link.low_latency;
  const int R = link.num_ranks, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int slot = int(op & 1);
  __shared__ const int4* row_at[kWarps][kMaxRanks];
  __shared__ uint64_t* flags_of[kWarps][kMaxRanks];
  const int64_t elem = dtype_size(a.rows_dtype);
  const bool vectors = (a.width * elem) % 16 == 0;
  const Pieces pieces(a.num_tokens, a.width);
  for (int u = blockIdx.x * kWarps + warp; u < a.num_tokens * pieces.pieces;
       u += gridDim.x * kWarps) {
    const int t = u / pieces.pieces, piece = u % pieces.pieces;
    const int p0 = pieces.first(piece), p1 = pieces.end(piece);
    const int32_t j = lane < R ? a.send_pos[int64_t(t) * R + lane] : -1;
    const uint32_t sources = __ballot_sync(~0u, j >= 0);
    if (j >= 0) {
      uint8_t* row = ll.row(kLowLatencyCombine, link.rank, slot, lane, j, R);
      row_at[warp][lane] = reinterpret_cast<const int4*>(row);
      flags_of[warp][lane] = ll.flags(kLowLatencyCombine, row);
    }
    __syncwarp();
    wait_flags(link, flags_of[warp], sources, p0, p1, op);
    const int c0 = p0 * kPartElems, c1 = min(a.width, p1 * kPartElems);
    if (vectors) {
      sum_rows(a, t, sources, row_at[warp], int(c0 * elem / 16), int(c1 * elem / 16));
    } else {
      for (int c = c0 + lane; c < c1; c += 32) {
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
  __shared__ uint64_t op;
  begin_op(p.link, kLowLatencyCombine, p.c.half, p.c.ticket_in, &op);
  __syncthreads();
  if (p.c.half & kSend) send_back(p, op);
  if (p.c.half & kRecv) sum_back(p, op);
}

template <typename T, bool kFp8>
cudaError_t launch_dispatch(const DispatchParams& p, int blocks, bool aligned, cudaStream_t stream) {
  const size_t smem = sizeof(float) * (kFp8 ? kWarps * p.d.a.scales_per_row() : 0) +
                      sizeof(int32_t) * p.d.a.num_experts;
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
  if (int64_t(c.a.width) * dtype_size(c.a.rows_dtype) > 4 * int64_t(ll.hidden))
    return "jax_ep: combine rows wider than 4 * hidden bytes";
  const CombineParams p{c, rank->link};
  combine_kernel<<<bandwidth_blocks(comm.knobs, device), kWarps * 32, 0, stream>>>(p);
  JAX_EP_CUDA_TRY(cudaGetLastError());
  return {};
}

}  // namespace jax_ep::cuda
