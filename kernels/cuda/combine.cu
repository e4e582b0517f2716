// Combine on GPUs, the mirror of dispatch.cu:
//   send part  each rank-level row this rank kept goes back into row j of its source's block of
//              that source's window (with its float32 extra columns, if any), flagged per part;
//              every source gets a count word (rows kept for it).
//   recv part  each token waits for the parts of the rows it sent and sums them from this
//              rank's window in rank order onto the bias, in float32, rounded once. In a whole
//              op a rank reads its rows from itself straight from its own rows.
#include "kernels/cuda/rows.cuh"
#include "kernels/cuda/sync.cuh"

namespace jax_ep::cuda {
namespace {

// 16: at 24 warps (80 registers a thread) the kernel spills and runs no faster.
constexpr int kWarps = 16;

using CombineParams = OpParams<CombineSend, CombineRecv>;

// first[s]: this rank's first rank-level row from source s (the dispatch's counts); first[R]: all.
// The handle's counts are trusted only within a block of the window and the rows given: a stale
// or corrupted handle cannot write past a block of a peer's window or read past row_data.
__device__ void dispatch_offsets(const CombineSend& send, int num_ranks, int rows_per_source,
                                 int32_t* first) {
  if (threadIdx.x == 0) {
    int running = 0;
    for (int r = 0; r < num_ranks; ++r) {
      first[r] = running;
      running += min(max(send.recv_counts[r], 0), rows_per_source);
    }
    first[num_ranks] = running;
  }
  __syncthreads();
}

__device__ void send_back(const CombineParams& params, uint64_t op, const int32_t* first) {
  const Peers& peers = params.peers;
  const Window& window = peers.window;
  const CombineSend& send = params.send;
  const int R = window.num_ranks, me = peers.rank, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = int(op % kSlots),
            present = max(0, min(*send.num_rows, min(first[R], send.rows)));
  if (blockIdx.x == 0 && threadIdx.x < R) {  // rows kept per source (the rest were dropped)
    const int src = threadIdx.x;
    const int kept = max(0, min(present - first[src], first[src + 1] - first[src]));
    send_count(peers, src, op, count_word(kept, 0),
               signature(send, window.num_ranks * window.experts_per_rank));
  }
  const int64_t elem = dtype_size(send.rows_dtype), row_bytes = send.width * elem;
  const Pieces pieces(kWarps, present, send.width);
  const int units = present * pieces.pieces, stride = gridDim.x * kWarps;
  // Row i of this rank goes back to row j of its source's block there; in place: not sent.
  auto dest = [&](int i) -> uint8_t* {
    const int src = source_of(first, i);
    if (src == me && params.in_place()) return nullptr;
    return peers.row(src, slot, me, i - first[src]);
  };
  for (int u = blockIdx.x * kWarps + warp; u < units; u += stride) {
    const int i = u / pieces.pieces, piece = u % pieces.pieces;
    uint8_t* to = dest(i);
    if (!to) continue;
    copy_bytes(to, static_cast<const uint8_t*>(send.row_data) + i * row_bytes,
               pieces.first(piece) * kPartElems * elem,
               min(row_bytes, pieces.end(piece) * kPartElems * elem));
    if (send.extra && piece == 0)
      for (int c = lane; c < send.extra_cols; c += 32)
        reinterpret_cast<float*>(to + window.meta_at())[c] =
            send.extra[int64_t(i) * send.extra_cols + c];
  }
  __syncwarp();
  fence_release_sys();
  for (int u = blockIdx.x * kWarps + warp; u < units; u += stride) {
    const int i = u / pieces.pieces, piece = u % pieces.pieces;
    uint8_t* to = dest(i);
    if (!to) continue;
    raise_flags(window, to, pieces.first(piece), pieces.end(piece), op);
  }
}

// out[t] = bias[t] + its rows from every rank it was sent to, in rank order, in float32.
__device__ void sum_back(const CombineParams& params, uint64_t op) {
  const Peers& peers = params.peers;
  const Window& window = peers.window;
  const CombineRecv& recv = params.recv;
  const int R = window.num_ranks, me = peers.rank, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int slot = int(op % kSlots);
  __shared__ int32_t kept[kMaxGpuRanks + 1];  // via row_offsets-like reads of the count words
  __shared__ int32_t self_first[kMaxGpuRanks + 1];
  __shared__ const int4* row_at[kWarps][kMaxGpuRanks];
  __shared__ const float* extra_at[kWarps][kMaxGpuRanks];
  __shared__ bool ok;
  if (threadIdx.x == 0) ok = true;
  __syncthreads();
  if (threadIdx.x < R && !wait_count(peers, op, threadIdx.x, kWaitCounts, &kept[threadIdx.x]))
    kept[threadIdx.x] = 0;
  if (params.in_place()) dispatch_offsets(params.send, R, window.rows_per_source, self_first);
  __syncthreads();
  check_signatures(peers, op);
  __syncthreads();
  if (threadIdx.x == 0) ok = !aborted(peers);
  __syncthreads();
  if (!ok) return;
  const int64_t elem = dtype_size(recv.rows_dtype);
  const bool vectors = (recv.width * elem) % 16 == 0;
  const Pieces pieces(kWarps, recv.num_tokens, recv.width);
  for (int u = blockIdx.x * kWarps + warp; u < recv.num_tokens * pieces.pieces;
       u += gridDim.x * kWarps) {
    const int t = u / pieces.pieces, piece = u % pieces.pieces;
    const int p0 = pieces.first(piece), p1 = pieces.end(piece);
    const int c0 = p0 * kPartElems, c1 = min(recv.width, p1 * kPartElems);
    int32_t j = lane < R ? recv.send_pos[int64_t(t) * R + lane] : -1;
    if (lane < R && j >= kept[lane]) j = -1;  // not sent, or dropped there
    const uint32_t sources = __ballot_sync(~0u, j >= 0);
    bool arrived = true;
    if (j >= 0) {
      const uint8_t* row;
      if (lane == me && params.in_place()) {  // this rank's own row, where its combine input is
        const int64_t i = self_first[me] + j;
        row = static_cast<const uint8_t*>(params.send.row_data) + i * recv.width * elem;
        extra_at[warp][lane] =
            params.send.extra ? params.send.extra + i * recv.extra_cols : nullptr;
      } else {
        row = peers.row(me, slot, lane, j);
        extra_at[warp][lane] = reinterpret_cast<const float*>(row + window.meta_at());
        const uint64_t* flags = reinterpret_cast<const uint64_t*>(row + window.flags_at());
        for (int part = p0; part < p1; ++part)
          arrived &= wait_op(peers, flags + part, op, kWaitRows, lane);
      }
      row_at[warp][lane] = reinterpret_cast<const int4*>(row);
      // Each source's whole run into L2 at once: sum_rows then finds its later chunks there
      // instead of waiting for each in turn (kernel 120 -> 100 us at V3 4096 on an H100).
      if (vectors && arrived) prefetch_l2(row + c0 * elem, uint32_t((c1 - c0) * elem));
    }
    if (!__all_sync(~0u, arrived)) continue;
    __syncwarp();
    if (vectors) {
      sum_rows(recv, t, sources, row_at[warp], int(c0 * elem / 16), int(c1 * elem / 16));
    } else {
      for (int c = c0 + lane; c < c1; c += 32) {
        const int64_t at = int64_t(t) * recv.width + c;
        float acc = recv.bias ? load_float(recv.bias, at, recv.bias_dtype) : 0.f;
        for (uint32_t m = sources; m; m &= m - 1)
          acc += load_float(row_at[warp][__ffs(m) - 1], c, recv.rows_dtype);
        store_float(recv.out, at, recv.out_dtype, acc);
      }
    }
    if (recv.extra_out && piece == 0)  // the extra columns, in the same order
      for (int c = lane; c < recv.extra_cols; c += 32) {
        float acc = 0.f;
        for (uint32_t m = sources; m; m &= m - 1) acc += extra_at[warp][__ffs(m) - 1][c];
        recv.extra_out[int64_t(t) * recv.extra_cols + c] = acc;
      }
    __syncwarp();
  }
  finish_recv(peers, op);
}

// What a failed op leaves in its output (the whole block, all of it): NaN.
__device__ void poison(const CombineParams& params) {
  if (params.part == Part::kSend) return;
  const CombineRecv& recv = params.recv;
  fill_nan(recv.out, int64_t(recv.num_tokens) * recv.width, dtype_size(recv.out_dtype));
  if (recv.extra_out) fill_nan(recv.extra_out, int64_t(recv.num_tokens) * recv.extra_cols, 4);
}

__global__ void __launch_bounds__(kWarps * 32, 1) combine_kernel(CombineParams params) {
  __shared__ uint64_t op;
  __shared__ int32_t first[kMaxGpuRanks + 1];
  __shared__ bool stop;
  if (threadIdx.x == 0) stop = aborted(params.peers);  // an op gave up: this one only leaves NaN
  __syncthreads();
  if (stop) return poison(params);
  const bool sending = params.part != Part::kRecv;
  begin_op(params.peers, sending ? Begin::kCount : Begin::kTicket, params.ticket, &op);
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x == 0 && params.token_out) *params.token_out = int32_t(op);
  if (sending) {
    wait_slot_free(params.peers, op);
    dispatch_offsets(params.send, params.peers.window.num_ranks,
                     params.peers.window.rows_per_source,
                     first);  // its barrier completes the wait
    send_back(params, op, first);
  }
  if (params.part != Part::kSend) sum_back(params, op);
  if (block_sees_abort(params.peers)) poison(params);
}

}  // namespace

std::string combine(const Rank& r, cudaStream_t stream, Part part, const CombineSend* send,
                    const CombineRecv* recv, const int32_t* ticket, int32_t* token_out) {
  if (auto err = r.failed(); !err.empty()) return err;
  const CombineParams params{
      r.peers(), send ? *send : CombineSend{}, recv ? *recv : CombineRecv{}, part, ticket,
      token_out};
  combine_kernel<<<r.blocks, kWarps * 32, 0, stream>>>(params);
  JAX_EP_CUDA_TRY(cudaGetLastError());
  return {};
}

}  // namespace jax_ep::cuda
