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

constexpr int kWarps = 16;

struct Params {
  Peers p;
  CombineSend s;
  CombineRecv v;
  Part part;
  const int32_t* ticket;
  int32_t* token_out;
  __host__ __device__ bool in_place() const { return part == Part::kWhole && p.direct_local; }
};

// first[s]: this rank's first rank-level row from source s (the dispatch's counts); first[R]: all.
// The handle's counts are trusted only within a block of the window and the rows given: a stale
// or corrupted handle cannot write past a block of a peer's window or read past row_data.
__device__ void dispatch_offsets(const CombineSend& s, int num_ranks, int rows_per_source,
                                 int32_t* first) {
  if (threadIdx.x == 0) {
    int running = 0;
    for (int r = 0; r < num_ranks; ++r) {
      first[r] = running;
      running += min(max(s.recv_counts[r], 0), rows_per_source);
    }
    first[num_ranks] = running;
  }
  __syncthreads();
}

__device__ void send_back(const Params& P, uint64_t op, const int32_t* first) {
  const Peers& p = P.p;
  const Window& w = p.w;
  const CombineSend& s = P.s;
  const int R = w.num_ranks, me = p.rank, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = int(op % kSlots), present = max(0, min(*s.num_rows, min(first[R], s.rows)));
  if (blockIdx.x == 0 && threadIdx.x < R) {  // rows kept per source (the rest were dropped)
    const int src = threadIdx.x;
    const int kept = max(0, min(present - first[src], first[src + 1] - first[src]));
    send_count(p, src, op, count_word(kept, 0), signature(s, w.num_ranks * w.experts_per_rank));
  }
  const int64_t elem = dtype_size(s.rows_dtype), row_bytes = s.width * elem;
  const Pieces pieces(kWarps, present, s.width);
  const int units = present * pieces.pieces, stride = gridDim.x * kWarps;
  // Row i of this rank goes back to row j of its source's block there; in place: not sent.
  auto dest = [&](int i) -> uint8_t* {
    const int src = source_of(first, i);
    if (src == me && P.in_place()) return nullptr;
    return p.row(src, slot, me, i - first[src]);
  };
  for (int u = blockIdx.x * kWarps + warp; u < units; u += stride) {
    const int i = u / pieces.pieces, piece = u % pieces.pieces;
    uint8_t* to = dest(i);
    if (!to) continue;
    copy_bytes(to, static_cast<const uint8_t*>(s.row_data) + i * row_bytes,
               pieces.first(piece) * kPartElems * elem,
               min(row_bytes, pieces.end(piece) * kPartElems * elem));
    if (s.extra && piece == 0)
      for (int c = lane; c < s.extra_cols; c += 32)
        reinterpret_cast<float*>(to + w.meta_at())[c] = s.extra[int64_t(i) * s.extra_cols + c];
  }
  __syncwarp();
  fence_release_sys();
  for (int u = blockIdx.x * kWarps + warp; u < units; u += stride) {
    const int i = u / pieces.pieces, piece = u % pieces.pieces;
    uint8_t* to = dest(i);
    if (!to) continue;
    uint64_t* flags = reinterpret_cast<uint64_t*>(to + w.flags_at());
    for (int part = pieces.first(piece) + lane; part < pieces.end(piece); part += 32)
      store_relaxed(flags + part, op);
  }
}

// out[t] = bias[t] + its rows from every rank it was sent to, in rank order, in float32.
__device__ void sum_back(const Params& P, uint64_t op) {
  const Peers& p = P.p;
  const Window& w = p.w;
  const CombineRecv& v = P.v;
  const int R = w.num_ranks, me = p.rank, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int slot = int(op % kSlots);
  __shared__ int32_t kept[kMaxGpuRanks + 1];  // via row_offsets-like reads of the count words
  __shared__ int32_t self_first[kMaxGpuRanks + 1];
  __shared__ const int4* row_at[kWarps][kMaxGpuRanks];
  __shared__ const float* extra_at[kWarps][kMaxGpuRanks];
  __shared__ bool ok;
  if (threadIdx.x == 0) ok = true;
  __syncthreads();
  if (threadIdx.x < R && !wait_count(p, op, threadIdx.x, kWaitCounts, &kept[threadIdx.x]))
    kept[threadIdx.x] = 0;
  if (P.in_place()) dispatch_offsets(P.s, R, w.rows_per_source, self_first);
  __syncthreads();
  check_signatures(p, op);
  __syncthreads();
  if (threadIdx.x == 0) ok = !aborted(p);
  __syncthreads();
  if (!ok) return;
  const int64_t elem = dtype_size(v.rows_dtype);
  const bool vectors = (v.width * elem) % 16 == 0;
  const Pieces pieces(kWarps, v.num_tokens, v.width);
  for (int u = blockIdx.x * kWarps + warp; u < v.num_tokens * pieces.pieces;
       u += gridDim.x * kWarps) {
    const int t = u / pieces.pieces, piece = u % pieces.pieces;
    const int p0 = pieces.first(piece), p1 = pieces.end(piece);
    int32_t j = lane < R ? v.send_pos[int64_t(t) * R + lane] : -1;
    if (lane < R && j >= kept[lane]) j = -1;  // not sent, or dropped there
    const uint32_t sources = __ballot_sync(~0u, j >= 0);
    bool arrived = true;
    if (j >= 0) {
      const uint8_t* row;
      if (lane == me && P.in_place()) {  // this rank's own row, where its combine input is
        const int64_t i = self_first[me] + j;
        row = static_cast<const uint8_t*>(P.s.row_data) + i * v.width * elem;
        extra_at[warp][lane] = P.s.extra ? P.s.extra + i * v.extra_cols : nullptr;
      } else {
        row = p.row(me, slot, lane, j);
        extra_at[warp][lane] = reinterpret_cast<const float*>(row + w.meta_at());
        const uint64_t* flags = reinterpret_cast<const uint64_t*>(row + w.flags_at());
        for (int part = p0; part < p1; ++part)
          arrived &= wait_op(p, flags + part, op, kWaitRows, lane);
      }
      row_at[warp][lane] = reinterpret_cast<const int4*>(row);
    }
    if (!__all_sync(~0u, arrived)) continue;
    __syncwarp();
    const int c0 = p0 * kPartElems, c1 = min(v.width, p1 * kPartElems);
    if (vectors) {
      sum_rows(v, t, sources, row_at[warp], int(c0 * elem / 16), int(c1 * elem / 16));
    } else {
      for (int c = c0 + lane; c < c1; c += 32) {
        const int64_t at = int64_t(t) * v.width + c;
        float acc = v.bias ? load_float(v.bias, at, v.bias_dtype) : 0.f;
        for (uint32_t m = sources; m; m &= m - 1)
          acc += load_float(row_at[warp][__ffs(m) - 1], c, v.rows_dtype);
        store_float(v.out, at, v.out_dtype, acc);
      }
    }
    if (v.extra_out && piece == 0)  // the extra columns, in the same order
      for (int c = lane; c < v.extra_cols; c += 32) {
        float acc = 0.f;
        for (uint32_t m = sources; m; m &= m - 1) acc += extra_at[warp][__ffs(m) - 1][c];
        v.extra_out[int64_t(t) * v.extra_cols + c] = acc;
      }
    __syncwarp();
  }
  finish_recv(p, op);
}

// What a failed op leaves in its output (the whole block, all of it): NaN.
__device__ void poison(const Params& P) {
  if (P.part == Part::kSend) return;
  const CombineRecv& v = P.v;
  fill_nan(v.out, int64_t(v.num_tokens) * v.width, dtype_size(v.out_dtype));
  if (v.extra_out) fill_nan(v.extra_out, int64_t(v.num_tokens) * v.extra_cols, 4);
}

__global__ void __launch_bounds__(kWarps * 32, 1) combine_kernel(Params P) {
  __shared__ uint64_t op;
  __shared__ int32_t first[kMaxGpuRanks + 1];
  __shared__ bool stop;
  if (threadIdx.x == 0) stop = aborted(P.p);  // an op gave up: this one only leaves NaN
  __syncthreads();
  if (stop) return poison(P);
  const bool sending = P.part != Part::kRecv;
  begin_op(P.p, sending ? Begin::kCount : Begin::kTicket, P.ticket, &op);
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x == 0 && P.token_out) *P.token_out = int32_t(op);
  if (sending) {
    wait_slot_free(P.p, op);
    dispatch_offsets(P.s, P.p.w.num_ranks, P.p.w.rows_per_source,
                     first);  // its barrier completes the wait
    send_back(P, op, first);
  }
  if (P.part != Part::kSend) sum_back(P, op);
  if (block_sees_abort(P.p)) poison(P);
}

}  // namespace

std::string combine(const Rank& r, cudaStream_t stream, Part part, const CombineSend* send,
                    const CombineRecv* recv, const int32_t* ticket, int32_t* token_out) {
  if (auto err = r.failed(); !err.empty()) return err;
  const Params P{
      r.peers(), send ? *send : CombineSend{}, recv ? *recv : CombineRecv{}, part, ticket,
      token_out};
  combine_kernel<<<r.blocks, kWarps * 32, 0, stream>>>(P);
  JAX_EP_CUDA_TRY(cudaGetLastError());
  return {};
}

}  // namespace jax_ep::cuda
