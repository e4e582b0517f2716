// Dispatch on GPUs (kernels/window.h has the memory, docs/ARCHITECTURE.md the protocol).
//   send part  every block finds each token's row j among those this rank sends rank d (a
//              ballot scan over the T tokens in shared memory, or for large batches the route
//              kernel's slots plus their chunk's offset, or a handle's); block 0 tells every
//              rank how many rows it gets, in all and per expert. Warps quantise and store
//              pieces of each token's row once per destination, straight from registers into
//              row j of this rank's block of the destination's window (NVLink for peers), with
//              the token's local expert ids and weights, then raise the pieces' flags. In a
//              whole op a rank's rows to itself go straight to their place in its output.
//   recv part  from every source's count word, each output row's source; warps take pieces of
//              rows in (source, j) order, wait for their flags and copy them into XLA's
//              buffers; block 0 sums the sources' rows per expert.
// A whole op runs both parts in one kernel, a split op one part per kernel.
#include "kernels/cuda/rows.cuh"
#include "kernels/cuda/sync.cuh"
#include "kernels/cuda/warp.cuh"
#include "kernels/fp8.h"
#include "kernels/layout.h"

namespace jax_ep::cuda {
namespace {

// 24 warps hide the rows' loads better than 16 (kernel 89 against 102 us at V3 4096 on an H200).
constexpr int kWarps = 24;
constexpr int kScanChunks = kMaxInBlockTokens / 32;
constexpr int kRouteThreads = Window::kChunkTokens;

// How a send part finds each token's row j on each rank (and who sends the count records):
//   kInBlock  a fresh dispatch of at most kMaxInBlockTokens tokens: a ballot scan in every block
//   kRouted   a larger fresh dispatch: route_kernel's slots plus their chunk's offset
//   kCached   a dispatch with a handle: its send_pos
enum class Routing : int { kInBlock, kRouted, kCached };

using DispatchParams = OpParams<DispatchSend, DispatchRecv>;

// Which ranks each token goes to and its row j among the tokens this rank sends there: bit t%32
// of sent_to[t/32][d], and before[t/32][d] + the set bits below it.
struct SendScan {
  uint32_t sent_to[kScanChunks][kMaxGpuRanks];
  int32_t before[kScanChunks][kMaxGpuRanks];
  __device__ uint32_t mask(int t, int num_ranks) const {
    uint32_t m = 0;
    for (int d = 0; d < num_ranks; ++d) m |= (sent_to[t / 32][d] >> (t % 32) & 1u) << d;
    return m;
  }
  __device__ int32_t row(int t, int d) const {
    return before[t / 32][d] + count_below(sent_to[t / 32][d], t % 32);
  }
};

// A warp per chunk of 32 tokens ballots their destinations; bad[warp] counts the invalid ids
// its chunks hold. Needs no op number, so it runs while the op starts.
__device__ void ballot_tokens(const DispatchSend& send, const Window& window, SendScan& scan,
                              int32_t* bad) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, El = window.experts_per_rank;
  const int R = window.num_ranks;
  int invalid = 0;
  for (int c = warp; c < (send.num_tokens + 31) / 32; c += kWarps) {
    const int t = c * 32 + lane;
    uint32_t m = 0;
    if (t < send.num_tokens) {
      const int32_t* topk = send.topk_idx + int64_t(t) * send.num_topk;
      m = dest_rank_mask(topk, send.num_topk, send.num_experts, El);
      invalid += count_invalid(topk, send.num_topk, send.num_experts);
    }
    for (int d = 0; d < R; ++d) {
      const uint32_t ballot = __ballot_sync(~0u, m >> d & 1u);
      if (lane == 0) scan.sent_to[c][d] = ballot;
    }
  }
  invalid = warp_sum(invalid);
  if (lane == 0) bad[warp] = invalid;
}

// Warp 0, after the ballots: each chunk's first row per rank; total[d]: rows sent to rank d.
__device__ void scan_rows(int num_tokens, int R, SendScan& scan, int32_t* total) {
  const int lane = threadIdx.x % 32, chunks = (num_tokens + 31) / 32;
  for (int d = 0; d < R; ++d) {
    const int n = lane < chunks ? __popc(scan.sent_to[lane][d]) : 0;
    const int inclusive = warp_inclusive_sum(n);
    if (lane < chunks) scan.before[lane][d] = inclusive - n;
    if (lane == 31) total[d] = inclusive;
  }
}

// Adds to tally[e] the tokens that name global expert e (once however many of their slots do).
__device__ void tally_tokens(const DispatchSend& send, int begin, int end, int32_t* tally) {
  const int K = send.num_topk;
  for (int i = begin * K + int(threadIdx.x); i < end * K; i += blockDim.x) {
    const int32_t* topk = send.topk_idx + int64_t(i / K) * K;
    const int k = i % K;
    if (is_routed(topk[k], send.num_experts) && !row_has_expert(topk, k, topk[k]))
      atomicAdd(&tally[topk[k]], 1);
  }
}

// One thread per destination d < R: how many rows it gets (total[d]), this rank's invalid expert
// ids and, per expert of d, how many of them name it (tally, by global expert; null for a cached
// dispatch).
__device__ void send_counts(const DispatchParams& params, uint64_t op, const int32_t* total,
                            int invalid, const int32_t* tally) {
  const Peers& peers = params.peers;
  const Window& window = peers.window;
  const int slot = int(op % kSlots), El = window.experts_per_rank;
  const Signature sig = signature(params.send);
  for (int d = threadIdx.x; d < window.num_ranks; d += blockDim.x)
    send_count(peers, d, op, count_word(total[d], invalid), sig);
  if (tally)
    for (int e = threadIdx.x; e < window.num_ranks * El; e += blockDim.x) {
      uint64_t* entry = peers.word(e / El, window.expert_rows_at(slot, peers.rank, e % El));
      store_relaxed(entry + kExpertRowsValue / 8, uint64_t(uint32_t(tally[e])));
      store_release(entry, op);
    }
}

// Large batches: a block per chunk of kRouteThreads tokens gives each token its index among the
// chunk's tokens sent to each rank (chunk_slot scratch) and counts the chunk's rows (chunk_rows)
// and rows per expert (expert_tally); the last block turns the chunk counts into offsets and
// sends every rank its counts.
__global__ void __launch_bounds__(kRouteThreads) route_kernel(DispatchParams params) {
  extern __shared__ int32_t block_tally[];  // per global expert
  __shared__ int32_t warp_rows[kRouteThreads / 32][kMaxGpuRanks];
  __shared__ int32_t invalid, total[kMaxGpuRanks];
  __shared__ uint64_t op;
  const Peers& peers = params.peers;
  const Window& window = peers.window;
  const DispatchSend& send = params.send;
  const int R = window.num_ranks, El = window.experts_per_rank, lane = threadIdx.x % 32,
            warp = threadIdx.x / 32;
  uint8_t* mine = peers.windows[peers.rank];
  auto* chunk_rows = reinterpret_cast<int32_t*>(mine + window.chunk_rows_at(0, 0));
  auto* expert_tally = reinterpret_cast<int32_t*>(mine + window.expert_tally_at(0));
  auto* chunk_slot = reinterpret_cast<int32_t*>(mine + window.chunk_slot_at(0, 0));
  auto* invalid_tally = reinterpret_cast<int32_t*>(mine + window.invalid_tally_at());
  begin_op(peers, Begin::kCount, nullptr, &op);
  for (int e = threadIdx.x; e < send.num_experts; e += blockDim.x) block_tally[e] = 0;
  if (threadIdx.x == 0) invalid = 0;
  __syncthreads();
  for (int c = blockIdx.x; c * kRouteThreads < send.num_tokens; c += gridDim.x) {
    const int t = c * kRouteThreads + threadIdx.x;
    uint32_t m = 0;
    if (t < send.num_tokens) {
      const int32_t* topk = send.topk_idx + int64_t(t) * send.num_topk;
      m = dest_rank_mask(topk, send.num_topk, send.num_experts, El);
      if (int bad = count_invalid(topk, send.num_topk, send.num_experts)) atomicAdd(&invalid, bad);
    }
    int32_t below[kMaxGpuRanks];  // tokens of earlier lanes of this warp sent to d
#pragma unroll
    for (int d = 0; d < kMaxGpuRanks; ++d) {
      const uint32_t ballot = __ballot_sync(~0u, m >> d & 1u);
      below[d] = count_below(ballot, lane);
      if (lane == 0 && d < R) warp_rows[warp][d] = __popc(ballot);
    }
    __syncthreads();
    if (warp < R) {  // warp d scans the warps' counts for rank d
      const int d = warp, n = warp_rows[lane][d];
      const int inclusive = warp_inclusive_sum(n);
      warp_rows[lane][d] = inclusive - n;
      if (lane == 31) chunk_rows[c * R + d] = inclusive;
    }
    __syncthreads();
    if (t < send.num_tokens)
#pragma unroll
      for (int d = 0; d < kMaxGpuRanks; ++d)
        if (d < R)
          chunk_slot[int64_t(t) * R + d] = m >> d & 1u ? warp_rows[warp][d] + below[d] : -1;
    tally_tokens(send, c * kRouteThreads, min(send.num_tokens, (c + 1) * kRouteThreads),
                 block_tally);
    __syncthreads();
  }
  for (int e = threadIdx.x; e < send.num_experts; e += blockDim.x)
    if (block_tally[e]) atomicAdd(&expert_tally[e], block_tally[e]);
  if (threadIdx.x == 0 && invalid) atomicAdd(invalid_tally, invalid);

  if (!last_block_done(peers)) return;
  if (threadIdx.x < R) {  // chunk counts -> rows of earlier chunks
    const int d = threadIdx.x;
    volatile int32_t* rows = chunk_rows;
    int running = 0;
    for (int c = 0; c * kRouteThreads < send.num_tokens; ++c) {
      const int n = rows[c * R + d];
      rows[c * R + d] = running;
      running += n;
    }
    total[d] = running;
  }
  if (threadIdx.x == 0) invalid = *reinterpret_cast<volatile int32_t*>(invalid_tally);
  wait_slot_free(peers, op);
  __syncthreads();
  send_counts(params, op, total, invalid, expert_tally);
  __syncthreads();
  for (int e = threadIdx.x; e < send.num_experts; e += blockDim.x) expert_tally[e] = 0;  // next op
  if (threadIdx.x == 0) {
    *send.num_invalid = invalid;
    *invalid_tally = 0;
  }
}

// Token t's row j on rank d, or -1, by routing. kInBlock (every lane, d = the lane < R): from
// the block's ballot scan.
__device__ int32_t row_in_block(const SendScan& scan, int t, int num_ranks) {
  const int d = threadIdx.x % 32;
  const uint32_t m = scan.mask(t, num_ranks);
  return d < num_ranks && (m >> d & 1u) ? scan.row(t, d) : -1;
}

// kRouted: the token's index among its chunk's tokens sent to d, plus the rows of earlier chunks
// (route_kernel's scratch in this rank's window).
__device__ int32_t row_routed(const Peers& peers, int t, int d) {
  const uint8_t* mine = peers.windows[peers.rank];
  int32_t j = reinterpret_cast<const int32_t*>(mine + peers.window.chunk_slot_at(t, d))[0];
  if (j >= 0)
    j += reinterpret_cast<const int32_t*>(mine +
                                          peers.window.chunk_rows_at(t / kRouteThreads, d))[0];
  return j;
}

// kCached: the handle's.
__device__ int32_t row_cached(const DispatchSend& send, int t, int d, int num_ranks) {
  return send.send_pos[int64_t(t) * num_ranks + d];
}

// Lane d (< R): the token's row j on rank d, or -1. `mask`: the ranks it goes to.
__device__ int32_t row_on(const DispatchParams& params, Routing routing, const SendScan& scan,
                          int t, uint32_t* mask) {
  const Window& window = params.peers.window;
  const int R = window.num_ranks, lane = threadIdx.x % 32;
  int32_t j = -1;
  if (routing == Routing::kInBlock) {
    j = row_in_block(scan, t, R);
  } else if (lane < R) {
    j = routing == Routing::kCached ? row_cached(params.send, t, lane, R)
                                    : row_routed(params.peers, t, lane);
    if (j >= window.rows_per_source) j = -1;  // a handle that does not fit the window: not sent
  }
  *mask = __ballot_sync(~0u, j >= 0);
  return j;
}

// The warp waits until parts [p0, p1) of `row`, from rank `source`, have come.
__device__ __forceinline__ bool wait_parts(const Peers& peers, const uint8_t* row, int p0, int p1,
                                           uint64_t op, int source) {
  const uint64_t* flags = reinterpret_cast<const uint64_t*>(row + peers.window.flags_at());
  bool ok = true;
  for (int part = p0 + threadIdx.x % 32; part < p1; part += 32)
    ok &= wait_op(peers, flags + part, op, kWaitRows, source);
  return __all_sync(~0u, ok);
}

template <typename T, bool kFp8>
__device__ void send_tokens(const DispatchParams& params, Routing routing, uint64_t op,
                            const SendScan& scan, float* stage, int first_self, bool aligned) {
  using Step = RowStep<T, kFp8>;
  static_assert(kPartElems % Step::kStep == 0, "a part is whole steps");
  constexpr int kStepsPerPart = kPartElems / Step::kStep;
  const Peers& peers = params.peers;
  const Window& window = peers.window;
  const DispatchSend& send = params.send;
  const DispatchRecv& recv = params.recv;
  const int R = window.num_ranks, me = peers.rank, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int K = send.num_topk, slot = int(op % kSlots), El = window.experts_per_rank;
  const bool fresh = send.fresh();
  __shared__ uint8_t* x_dst[kWarps][kMaxGpuRanks];  // the warp's token's row on each rank
  __shared__ float* scale_dst[kWarps][kMaxGpuRanks];
  const Pieces pieces(kWarps, send.num_tokens, send.hidden);
  const int units = send.num_tokens * pieces.pieces, stride = gridDim.x * kWarps;
  const int steps = (send.hidden + Step::kStep - 1) / Step::kStep;
  const int64_t out_row = recv.wire_row_bytes();
  const int num_scales = kFp8 ? window.num_scales() : 0;

  // Lane d: the token's row on rank d, in place (this rank's output) or in d's window.
  auto place = [&](int t, uint32_t* mask, uint32_t* in_place) {
    const int32_t j = row_on(params, routing, scan, t, mask);
    const bool here = params.in_place() && lane == me && j >= 0 && first_self + j < recv.out_rows;
    *in_place = __ballot_sync(~0u, here);
    return j;
  };
  for (int u = blockIdx.x * kWarps + warp; u < units; u += stride) {
    const int t = u / pieces.pieces, piece = u % pieces.pieces;
    uint32_t m, here;
    const int32_t j = place(t, &m, &here);
    if (fresh && piece == 0 && lane < R) send.send_pos[int64_t(t) * R + lane] = j;
    if (!m) continue;
    if (here >> lane & 1u) {
      const int64_t i = first_self + j;
      x_dst[warp][lane] = static_cast<uint8_t*>(recv.x_out) + i * out_row;
      scale_dst[warp][lane] = kFp8 ? recv.scales_out + i * num_scales : nullptr;
    } else if (j >= 0) {
      uint8_t* row = peers.row(lane, slot, me, j);
      x_dst[warp][lane] = row;
      scale_dst[warp][lane] = reinterpret_cast<float*>(row + window.scales_at());
    }
    __syncwarp();
    const uint8_t* x = static_cast<const uint8_t*>(send.x) + int64_t(t) * send.hidden * sizeof(T);
    if (aligned && lane == 0) {  // the piece of x into L2 at once (kernel -4% at V3 4096, H100)
      const int64_t b0 = int64_t(pieces.first(piece)) * kPartElems * sizeof(T);
      const int64_t b1 =
          min(int64_t(send.hidden), int64_t(pieces.end(piece)) * kPartElems) * int64_t(sizeof(T));
      prefetch_l2(x + b0, uint32_t(b1 - b0));
    }
    send_row<T, kFp8>(x, send.hidden, send.round_scale, m, x_dst[warp], scale_dst[warp], stage,
                      pieces.first(piece) * kStepsPerPart,
                      min(steps, pieces.end(piece) * kStepsPerPart), aligned);
    if (fresh && piece == 0) {  // the token's slots as each destination sees them
      const int32_t* topk = send.topk_idx + int64_t(t) * K;
      for (uint32_t mm = m; mm; mm &= mm - 1) {
        const int d = __ffs(mm) - 1;
        int32_t* ids;
        float* weights;
        if (here >> d & 1u) {
          const int64_t i = first_self + __shfl_sync(~0u, j, d);
          ids = recv.topk_out + i * K;
          weights = recv.weights_out + i * K;
        } else {
          ids = reinterpret_cast<int32_t*>(x_dst[warp][d] + window.meta_at());
          weights = reinterpret_cast<float*>(ids + K);
        }
        for (int k = lane; k < K; k += 32) {
          const int32_t local = local_expert_on(topk[k], d, send.num_experts, El);
          ids[k] = local;
          weights[k] = local >= 0 ? send.topk_weights[int64_t(t) * K + k] : 0.f;
        }
      }
    }
    __syncwarp();  // the warp's staging is free again
  }
  // One system fence for all of the warp's stores, then the flags of its pieces in windows.
  __syncwarp();
  fence_release_sys();
  for (int u = blockIdx.x * kWarps + warp; u < units; u += stride) {
    const int t = u / pieces.pieces, piece = u % pieces.pieces;
    uint32_t m, here;
    const int32_t j = place(t, &m, &here);
    for (uint32_t mm = m & ~here; mm; mm &= mm - 1) {
      const int d = __ffs(mm) - 1;
      raise_flags(window, peers.row(d, slot, me, __shfl_sync(~0u, j, d)), pieces.first(piece),
                  pieces.end(piece), op);
    }
  }
}

// Threads s < R: rows[s], what source s sends this rank in op `op` (its count record), once
// every source's signature is this rank's own; then first[s], its first row in (source, j)
// order, first[R] all, and the invalid expert ids of every source. False if this rank stopped.
__device__ bool row_offsets(const Peers& peers, uint64_t op, int32_t* first,
                            int32_t* group_invalid) {
  __shared__ int32_t rows[kMaxGpuRanks], invalid[kMaxGpuRanks];
  __shared__ bool ok;
  const Window& window = peers.window;
  const int s = threadIdx.x;
  if (s < window.num_ranks && !wait_count(peers, op, s, kWaitCounts, &rows[s], &invalid[s]))
    rows[s] = invalid[s] = 0;
  __syncthreads();
  check_signatures(peers, op);
  __syncthreads();
  if (threadIdx.x == 0) {
    int running = 0, bad = 0;
    for (int r = 0; r < window.num_ranks; ++r) {
      first[r] = running;
      running += rows[r];
      bad += invalid[r];
    }
    first[window.num_ranks] = running;
    *group_invalid = bad;
    ok = !aborted(peers);
  }
  __syncthreads();
  return ok;
}

// Block 0 (fresh dispatch): tokens per local expert, as their sources counted them, less those
// in rows dropped for capacity (rows [present, first[R])).
__device__ void tally_experts(const DispatchParams& params, uint64_t op, const int32_t* first,
                              int present, int32_t* tally) {
  const Peers& peers = params.peers;
  const Window& window = peers.window;
  const int K = window.num_topk, El = window.experts_per_rank, R = window.num_ranks,
            slot = int(op % kSlots);
  for (int e = threadIdx.x; e < El; e += blockDim.x) {
    int rows = 0;
    for (int s = 0; s < R; ++s) {
      const uint64_t* entry = peers.word(peers.rank, window.expert_rows_at(slot, s, e));
      if (wait_op(peers, entry, op, kWaitCounts, s))
        rows += int(uint32_t(load_volatile(entry + kExpertRowsValue / 8)));
    }
    tally[e] = rows;
  }
  __syncthreads();
  for (int row = present + threadIdx.x; row < first[R]; row += blockDim.x) {
    const int s = source_of(first, row);
    const uint8_t* at = peers.row(peers.rank, slot, s, row - first[s]);
    if (!wait_op(peers, reinterpret_cast<const uint64_t*>(at + window.flags_at()), op, kWaitRows,
                 s))
      continue;
    const int32_t* ids = reinterpret_cast<const int32_t*>(at + window.meta_at());
    for (int k = 0; k < K; ++k)
      if (ids[k] >= 0 && !row_has_expert(ids, k, ids[k])) atomicSub(&tally[ids[k]], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < El; e += blockDim.x) params.recv.tokens_per_expert[e] = tally[e];
}

__device__ void receive_tokens(const DispatchParams& params, uint64_t op, int32_t* tally) {
  const Peers& peers = params.peers;
  const Window& window = peers.window;
  const DispatchRecv& recv = params.recv;
  const int R = window.num_ranks, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int slot = int(op % kSlots), K = recv.num_topk;
  const bool fresh = recv.fresh();
  __shared__ int32_t first[kMaxGpuRanks + 1], group_invalid;
  if (!row_offsets(peers, op, first, &group_invalid)) return;
  const int present = min(first[R], recv.out_rows);
  if (fresh && blockIdx.x == 0) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < R; ++s) recv.recv_counts[s] = first[s + 1] - first[s];
      *recv.num_recv = present;
      *recv.num_dropped = first[R] - present;
      *recv.group_invalid = group_invalid;
    }
    tally_experts(params, op, first, present, tally);
  }

  const int64_t x_elem = recv.fp8 ? 1 : dtype_size(recv.x_dtype);
  const int num_scales = recv.fp8 ? window.num_scales() : 0;
  const Pieces pieces(kWarps, recv.out_rows, recv.hidden);
  // Block 0, busy with the tally, takes the last units.
  const int order = (blockIdx.x + gridDim.x - 1) % gridDim.x;
  for (int u = order * kWarps + warp; u < recv.out_rows * pieces.pieces; u += gridDim.x * kWarps) {
    const int i = u / pieces.pieces, piece = u % pieces.pieces;
    const int p0 = pieces.first(piece), p1 = pieces.end(piece);
    const uint8_t* row = nullptr;  // padding rows: zeros, expert -1, weight 0
    if (i < present) {
      const int s = source_of(first, i);
      if (s == peers.rank && params.in_place()) continue;  // written in place by the send part
      row = peers.row(peers.rank, slot, s, i - first[s]);
      if (!wait_parts(peers, row, p0, p1, op, s)) continue;
      __syncwarp();  // every lane's reads of the row after the flags the warp voted on
    }
    const int64_t e0 = int64_t(p0) * kPartElems,
                  e1 = min(int64_t(recv.hidden), int64_t(p1) * kPartElems);
    copy_bytes(static_cast<uint8_t*>(recv.x_out) + i * recv.wire_row_bytes(), row, e0 * x_elem,
               e1 * x_elem);
    if (num_scales)
      copy_bytes(recv.scales_out + int64_t(i) * num_scales,
                 row ? row + window.scales_at() : nullptr, e0 / kFp8Block * 4, e1 / kFp8Block * 4);
    if (!fresh || piece != 0) continue;
    const int32_t* ids = row ? reinterpret_cast<const int32_t*>(row + window.meta_at()) : nullptr;
    for (int k = lane; k < K; k += 32) {
      recv.topk_out[int64_t(i) * K + k] = ids ? ids[k] : -1;
      recv.weights_out[int64_t(i) * K + k] = ids ? reinterpret_cast<const float*>(ids + K)[k] : 0.f;
    }
  }
  finish_recv(peers, op);
}

// The rows this rank sends itself that come before its own (ranks below it), for writing them
// in place: first_self = the rows of every lower rank.
__device__ void rows_before_self(const Peers& peers, uint64_t op, int32_t* first_self) {
  __shared__ int32_t rows[kMaxGpuRanks];
  const int s = threadIdx.x;
  if (s < peers.rank && !wait_count(peers, op, s, kWaitLower, &rows[s])) rows[s] = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    int n = 0;
    for (int r = 0; r < peers.rank; ++r) n += rows[r];
    *first_self = n;
  }
  __syncthreads();
}

// A send part's routes and count records, by routing (see Routing), around the barrier that
// completes the slot wait; kRouted has only that barrier (route_kernel sent its counts).
// kInBlock, while the op starts (needs no op number): block 0 zeroes its tally of tokens per
// expert; every block ballots the tokens' destinations into `scan`, their invalid ids into `bad`
// (per warp).
__device__ void ballot_in_block(const DispatchParams& params, SendScan& scan, int32_t* bad,
                                int32_t* tally) {
  const DispatchSend& send = params.send;
  if (blockIdx.x == 0)
    for (int e = threadIdx.x; e < send.num_experts; e += blockDim.x) tally[e] = 0;
  ballot_tokens(send, params.peers.window, scan, bad);
}

// kInBlock, once the ballots are in: warp 0 scans them (rows per rank into `total`), block 0
// tallies the tokens per expert; after the barrier block 0 sends the counts.
__device__ void count_in_block(const DispatchParams& params, uint64_t op, SendScan& scan,
                               const int32_t* bad, int32_t* total, int32_t* tally) {
  const DispatchSend& send = params.send;
  if (threadIdx.x / 32 == 0) scan_rows(send.num_tokens, params.peers.window.num_ranks, scan, total);
  if (blockIdx.x == 0) tally_tokens(send, 0, send.num_tokens, tally);
  __syncthreads();
  if (blockIdx.x == 0) {
    int invalid = 0;
    for (int wp = 0; wp < kWarps; ++wp) invalid += bad[wp];
    send_counts(params, op, total, invalid, tally);
    if (threadIdx.x == 0) *send.num_invalid = invalid;
  }
}

// kCached: block 0 counts the handle's rows per rank (those that fit the window) into `total`
// and, after the barrier, sends the counts (no tally: a handle's receivers use their own).
__device__ void count_cached(const DispatchParams& params, uint64_t op, int32_t* total) {
  const DispatchSend& send = params.send;
  const Window& window = params.peers.window;
  const int R = window.num_ranks, warp = threadIdx.x / 32;
  if (blockIdx.x == 0)
    for (int d = warp; d < R; d += kWarps) {
      int n = 0;
      for (int t = threadIdx.x % 32; t < send.num_tokens; t += 32) {
        const int32_t j = send.send_pos[int64_t(t) * R + d];
        n += j >= 0 && j < window.rows_per_source;
      }
      n = warp_sum(n);
      if (threadIdx.x % 32 == 0) total[d] = n;
    }
  __syncthreads();
  if (blockIdx.x == 0) send_counts(params, op, total, 0, nullptr);
}

// What a failed op leaves in the outputs of this kernel's parts (the whole block, all of them):
// NaN in the rows, scales and weights, -1 in the ids and routes, 0 in the counts.
__device__ void poison(const DispatchParams& params) {
  const Window& window = params.peers.window;
  const DispatchSend& send = params.send;
  const DispatchRecv& recv = params.recv;
  if (params.part != Part::kRecv && send.fresh()) {
    fill(send.send_pos, int64_t(send.num_tokens) * window.num_ranks, int32_t(-1));
    if (threadIdx.x == 0) *send.num_invalid = 0;
  }
  if (params.part == Part::kSend) return;
  const int elem = recv.fp8 ? 1 : dtype_size(recv.x_dtype);
  fill_nan(recv.x_out, int64_t(recv.out_rows) * recv.hidden, elem);
  if (recv.fp8) fill_nan(recv.scales_out, int64_t(recv.out_rows) * window.num_scales(), 4);
  if (!recv.fresh()) return;
  fill(recv.topk_out, int64_t(recv.out_rows) * recv.num_topk, int32_t(-1));
  fill_nan(recv.weights_out, int64_t(recv.out_rows) * recv.num_topk, 4);
  fill(recv.recv_counts, int64_t(window.num_ranks), int32_t(0));
  fill(recv.tokens_per_expert, int64_t(window.experts_per_rank), int32_t(0));
  if (threadIdx.x == 0) *recv.num_recv = *recv.num_dropped = *recv.group_invalid = 0;
}

template <typename T, bool kFp8>
__global__ void __launch_bounds__(kWarps * 32, 1)
    dispatch_kernel(DispatchParams params, Routing routing, bool aligned) {
  extern __shared__ float dynamic[];  // per warp its row's scales, then the expert tallies
  __shared__ uint64_t op;
  __shared__ SendScan scan;
  __shared__ int32_t bad[kWarps], total[kMaxGpuRanks], first_self;
  __shared__ bool stop;
  const Peers& peers = params.peers;
  const int warp = threadIdx.x / 32;
  const int num_scales = kFp8 ? peers.window.num_scales() : 0;
  int32_t* tally = reinterpret_cast<int32_t*>(dynamic + kWarps * num_scales);
  if (threadIdx.x == 0) stop = aborted(peers);  // an op gave up: this one only leaves NaN
  __syncthreads();
  if (stop) return poison(params);
  const bool sending = params.part != Part::kRecv;
  begin_op(peers,
           !sending                      ? Begin::kTicket
           : routing == Routing::kRouted ? Begin::kFollow
                                         : Begin::kCount,
           params.ticket, &op);
  if (sending && routing == Routing::kInBlock) ballot_in_block(params, scan, bad, tally);
  __syncthreads();  // the op's number, the ballots, the zeroed tally
  if (blockIdx.x == 0 && threadIdx.x == 0 && params.token_out) *params.token_out = int32_t(op);
  if (sending) {
    wait_slot_free(peers, op);
    switch (routing) {
      case Routing::kInBlock:
        count_in_block(params, op, scan, bad, total, tally);
        break;
      case Routing::kRouted:
        __syncthreads();
        break;
      case Routing::kCached:
        count_cached(params, op, total);
        break;
    }
    if (params.in_place()) rows_before_self(peers, op, &first_self);
    send_tokens<T, kFp8>(params, routing, op, scan, dynamic + warp * num_scales,
                         params.in_place() ? first_self : 0, aligned);
  }
  if (params.part != Part::kSend) receive_tokens(params, op, tally);
  if (block_sees_abort(peers)) poison(params);
}

template <typename T, bool kFp8>
cudaError_t launch_dispatch(const DispatchParams& params, Routing routing, int blocks, bool aligned,
                            cudaStream_t stream) {
  const size_t smem =
      sizeof(float) * (kFp8 ? kWarps * params.peers.window.num_scales() : 0) +
      sizeof(int32_t) * (params.peers.window.num_ranks * params.peers.window.experts_per_rank);
  return launch(dispatch_kernel<T, kFp8>, blocks, kWarps * 32, smem, stream, params, routing,
                aligned);
}

}  // namespace

std::string dispatch(const Rank& r, cudaStream_t stream, Part part, const DispatchSend* send,
                     const DispatchRecv* recv, bool low_latency, const int32_t* ticket,
                     int32_t* token_out) {
  if (auto err = r.failed(); !err.empty()) return err;
  const DispatchParams params{
      r.peers(), send ? *send : DispatchSend{}, recv ? *recv : DispatchRecv{}, part, ticket,
      token_out};
  Routing routing = Routing::kCached;  // unless a fresh send (a recv part has no routes)
  if (send && send->fp8 && r.window.num_scales() > kMaxScalesPerRow)  // the kernel's shared memory
    return "jax_ep: fp8 dispatch on GPUs supports hidden <= " +
           std::to_string(kMaxScalesPerRow * kFp8Block);
  if (send && send->fresh()) {
    const bool in_block = low_latency && send->num_tokens <= kMaxInBlockTokens;
    routing = in_block ? Routing::kInBlock : Routing::kRouted;
    if (!in_block)
      JAX_EP_CUDA_TRY(launch(route_kernel, r.blocks, kRouteThreads,
                             sizeof(int32_t) * send->num_experts, stream, params));
  }
  const Dtype x_dtype = send ? send->x_dtype : recv->x_dtype;
  const bool fp8 = send ? send->fp8 : recv->fp8;
  const int hidden = send ? send->hidden : recv->hidden;
  const bool aligned = (int64_t(hidden) * dtype_size(x_dtype)) % 16 == 0;
  JAX_EP_CUDA_TRY(with_row_type(x_dtype, fp8, [&](auto t, auto is_fp8) {
    return launch_dispatch<decltype(t), decltype(is_fp8)::value>(params, routing, r.blocks, aligned,
                                                                 stream);
  }));
  return {};
}

}  // namespace jax_ep::cuda
