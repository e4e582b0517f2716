// Combine on NVLink GPUs: each rank pulls the rows of its own tokens from every rank's XLA buffer.
// One kernel (<= num_sms blocks): block 0 publishes the address of this rank's rows; each warp
// takes tokens and adds their rows from every rank (loaded over NVLink for peers) in rank order,
// in float32, onto the bias, and stores the result once; the last block tells every peer it is
// done reading its rows and waits until every peer is done reading this rank's.
#include "kernels/cuda/comm.cuh"
#include "kernels/cuda/rows.cuh"
#include "kernels/layout.h"

namespace jax_ep::cuda {
namespace {

constexpr int kWarps = 16;

struct Params {
  CombineArgs a;
  Link link;
};

// Block 0 publishes this rank's rows; every block learns where each rank's rows are.
__device__ __forceinline__ void share_rows(const Link& link, uint64_t seq, const void* mine,
                                           const uint8_t** rows_of) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    void* ptrs[kMailboxPointers] = {const_cast<void*>(mine), nullptr, nullptr, nullptr};
    publish(link.self, seq, ptrs);
  }
  if (threadIdx.x < link.num_ranks) {
    void* ptrs[kMailboxPointers];
    read_mailbox(link, threadIdx.x, seq, ptrs);
    rows_of[threadIdx.x] = static_cast<const uint8_t*>(ptrs[0]);
  }
  __syncthreads();
}

// Each warp takes whole tokens: for every rank its row went to, in rank order, loads kUnroll
// 16-byte vectors per lane from that rank's rows (NVLink for peers) and adds them in float32 onto
// the bias; the sum is rounded once and stored.
__global__ void __launch_bounds__(kWarps * 32, 1) pull_kernel(Params p) {
  __shared__ const uint8_t* rows_of[kMaxRanks];
  __shared__ const int4* row_at[kWarps][kMaxRanks];  // the current token's row on each rank
  const CombineArgs& a = p.a;
  const Link& link = p.link;
  const int R = link.num_ranks, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint64_t seq = this_op(link.self);
  share_rows(link, seq, a.row_data, rows_of);

  const int64_t row_bytes = int64_t(a.width) * dtype_size(a.rows_dtype);
  for (int t = blockIdx.x * kWarps + warp; t < a.num_tokens; t += gridDim.x * kWarps) {
    const int32_t pos = lane < R ? a.send_pos[int64_t(t) * R + lane] : -1;
    const uint32_t sources = __ballot_sync(~0u, pos >= 0);
    if (pos >= 0) row_at[warp][lane] = reinterpret_cast<const int4*>(rows_of[lane] + pos * row_bytes);
    __syncwarp();
    sum_rows(a, t, sources, row_at[warp], 0, int(row_bytes / 16));
    __syncwarp();
  }

  if (last_block_done(&link.self->ticket)) finish_op(link, seq, kWaitReleased);
}

// Rows whose size is no multiple of 16 bytes: plain loads from the peers, same order.
__global__ void pull_plain_kernel(Params p) {
  __shared__ const uint8_t* rows_of[kMaxRanks];
  const CombineArgs& a = p.a;
  const Link& link = p.link;
  const int R = link.num_ranks;
  const uint64_t seq = this_op(link.self);
  share_rows(link, seq, a.row_data, rows_of);
  const int64_t n = int64_t(a.num_tokens) * a.width;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / a.width, c = i % a.width;
    float acc = a.has_bias ? load_float(a.bias, i, a.bias_dtype) : 0.f;
    for (int d = 0; d < R; ++d) {
      const int32_t pos = a.send_pos[t * R + d];
      if (pos >= 0) acc += load_float(rows_of[d], int64_t(pos) * a.width + c, a.rows_dtype);
    }
    store_float(a.out, i, a.out_dtype, acc);
  }
  if (last_block_done(&link.self->ticket)) finish_op(link, seq, kWaitReleased);
}

}  // namespace

std::string combine(Comm& comm, int device, cudaStream_t stream, const CombineArgs& a) {
  Comm::Rank* rank = nullptr;
  if (auto err = comm.rank_on(device, &rank); !err.empty()) return err;
  const Params p{a, rank->link};
  const int blocks = bandwidth_blocks(comm.knobs, device);
  if ((int64_t(a.width) * dtype_size(a.rows_dtype)) % 16 == 0) {
    pull_kernel<<<blocks, kWarps * 32, 0, stream>>>(p);
  } else {
    pull_plain_kernel<<<blocks, 256, 0, stream>>>(p);
  }
  JAX_EP_CUDA_TRY(cudaGetLastError());
  return {};
}

}  // namespace jax_ep::cuda
