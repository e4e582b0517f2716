// Peer bandwidth of the mechanisms a kernel can use to move bytes between two GPUs, from a given
// number of SMs: the ceilings the dispatch and combine kernels are measured against (bench/).
// The row paths are jax_ep's own (kernels/cuda/rows.cuh): the probes measure what the kernels run.
#include <cuda_runtime.h>

#include <chrono>
#include <vector>

#include "bench/cuda/probe.h"
#include "bench/cuda/ptx.cuh"
#include "kernels/cuda/rows.cuh"

namespace jax_ep::probe {
namespace {

using cuda::quantize16;
using cuda::RowStep;
using cuda::send_row;
using cuda::sum_rows;

constexpr int kWarps = 8;
constexpr int kChunk = 8192;
constexpr int kDepth = 3;  // bulk copies in flight per warp

// Each warp pushes chunks from its shared memory into `dst` (peer memory) with bulk copies.
__global__ void __launch_bounds__(kWarps * 32) push_bulk(uint8_t* dst, int64_t bytes) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint8_t* mine = smem + warp * kDepth * kChunk;
  for (int i = lane; i < kDepth * kChunk / 16; i += 32)
    reinterpret_cast<int4*>(mine)[i] = make_int4(i, warp, 0, 0);
  fence_shared_to_async();
  __syncwarp();
  const int64_t chunks = bytes / kChunk;
  int slot = 0;
  for (int64_t c = int64_t(blockIdx.x) * kWarps + warp; c < chunks;
       c += int64_t(gridDim.x) * kWarps) {
    if (lane == 0) {
      bulk_wait_read<kDepth - 1>();
      bulk_store(dst + c * kChunk, mine + slot * kChunk, kChunk);
      bulk_commit();
    }
    slot = (slot + 1) % kDepth;
  }
  if (lane == 0) bulk_wait_all();
}

// Plain 16-byte stores from registers into peer memory. With `local`, the traffic of a
// dispatch's send beside them: each vector also goes to local memory, after loading twice its
// bytes from there (a BF16 row read, its FP8 row written to a local and a peer rank).
__global__ void push_stores(int4* dst, int64_t vectors, int4* local) {
  const int4 v = make_int4(threadIdx.x, blockIdx.x, 1, 2);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (local) {
      const int4 a = local[vectors + 2 * i], b = local[vectors + 2 * i + 1];
      local[i] = make_int4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w);
      dst[i] = local[i];
    } else {
      dst[i] = v;
    }
  }
}

// A V3 row: 7168 elements, FP8 bytes on the wire; modes 5-7 move whole rows.
constexpr int kRowElems = 7168, kRowScales = kRowElems / kFp8Block;

// Plain 16-byte stores laid out like a dispatch's: each warp writes whole rows of `row_bytes`
// (a V3 FP8 row), the warps of the grid many rows at once.
__global__ void push_rows(uint8_t* dst, int64_t bytes, int row_bytes) {
  const int warps = gridDim.x * blockDim.x / 32, lane = threadIdx.x % 32;
  const int64_t rows = bytes / row_bytes;
  for (int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < rows; r += warps) {
    int4* row = reinterpret_cast<int4*>(dst + r * row_bytes);
    for (int i = lane; i < row_bytes / 16; i += 32) row[i] = make_int4(i, int(r), 1, 2);
  }
}

// The dispatch send's row path alone (send_row, as the send kernel calls it): each warp
// quantises whole V3 rows (7168 BF16 elements from local memory) to FP8 and stores them, and
// their scales, into the peer's rows and/or local rows (either may be null); rows
// [first_row, end_row) of `rows`.
constexpr int kRowWarps = 24;
constexpr int kMaxStaged = 8;  // chunks of a staged copy (modes 8, 9)

__global__ void __launch_bounds__(kRowWarps * 32, 1)
    push_send_rows(const uint8_t* x, uint8_t* local, uint8_t* peer, int64_t rows, int64_t first_row,
                   int64_t end_row) {
  using Step = RowStep<__nv_bfloat16, true>;
  __shared__ float stage[kRowWarps][kRowScales];
  __shared__ uint8_t* row_on[kRowWarps][2];
  __shared__ float* scales_on[kRowWarps][2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t r = first_row + int64_t(blockIdx.x) * kRowWarps + warp; r < end_row;
       r += int64_t(gridDim.x) * kRowWarps) {
    if (lane < 2 && (lane ? peer : local)) {
      uint8_t* base = lane ? peer : local;
      row_on[warp][lane] = base + r * kRowElems;
      scales_on[warp][lane] = reinterpret_cast<float*>(base + rows * kRowElems) + r * kRowScales;
    }
    __syncwarp();
    const uint32_t targets = (local ? 1u : 0u) | (peer ? 2u : 0u);
    send_row<__nv_bfloat16, true>(x + r * kRowElems * 2, kRowElems, false, targets, row_on[warp],
                                  scales_on[warp], stage[warp], 0, kRowElems / Step::kStep, true);
    __syncwarp();
  }
}

// A lean FP8 row path, specialised to V3 rows, against send_row (modes 12 local, 13 peer): a warp
// quantises a whole V3 row, all loads of half a row in flight, the scales gathered by shuffles and
// stored at the row's end.
__global__ void __launch_bounds__(kRowWarps * 32, 1)
    quantise_rows_lean(const uint8_t* x, uint8_t* dst, int64_t rows) {
  constexpr int kSteps = kRowElems / 512, kHalf = kSteps / 2;  // 512 elements a warp step
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* scales = reinterpret_cast<float*>(dst + rows * kRowElems);
  for (int64_t r = int64_t(blockIdx.x) * kRowWarps + warp; r < rows;
       r += int64_t(gridDim.x) * kRowWarps) {
    const int4* src = reinterpret_cast<const int4*>(x + r * kRowElems * 2) + lane * 2;
    int4* out = reinterpret_cast<int4*>(dst + r * kRowElems) + lane;
    float kept[2] = {0.f, 0.f};  // lane l keeps the scales of blocks l and 32 + l
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int4 v[kHalf][2];
#pragma unroll
      for (int u = 0; u < kHalf; ++u) {
        v[u][0] = __ldg(src + (h * kHalf + u) * 64);
        v[u][1] = __ldg(src + (h * kHalf + u) * 64 + 1);
      }
#pragma unroll
      for (int u = 0; u < kHalf; ++u) {
        const int step = h * kHalf + u;
        float scale;
        out[step * 32] = quantize16<__nv_bfloat16>(v[u], false, &scale);
        const float block_scale = __shfl_sync(~0u, scale, (lane % 4) * 8);
        if (lane / 4 == step % 8) kept[step / 8] = block_scale;
      }
    }
    scales[r * kRowScales + lane] = kept[0];
    if (32 + lane < kRowScales) scales[r * kRowScales + 32 + lane] = kept[1];
  }
}

// The combine's row path alone (sum_rows, as the pull kernel calls it): each warp sums a V3 row
// of BF16 from local memory and the same row of the peer's memory into a local BF16 row.
constexpr int kSumWarps = 16;

__global__ void __launch_bounds__(kSumWarps * 32)
    pull_sum_rows(const uint8_t* local, const uint8_t* peer, uint8_t* out, int64_t rows) {
  constexpr int kRowBytes = kRowElems * 2;
  __shared__ const int4* row_at[kSumWarps][2];
  CombineArgs a{};
  a.width = kRowElems;
  a.rows_dtype = a.out_dtype = a.bias_dtype = Dtype::kBF16;
  a.out = out;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t r = int64_t(blockIdx.x) * kSumWarps + warp; r < rows;
       r += int64_t(gridDim.x) * kSumWarps) {
    if (lane < 2)
      row_at[warp][lane] = reinterpret_cast<const int4*>((lane ? peer : local) + r * kRowBytes);
    __syncwarp();
    sum_rows(a, int(r), 3u, row_at[warp], 0, kRowBytes / 16);
    __syncwarp();
  }
}

// One warp bulk-loads chunks of peer memory into a ring of stages; the other warps release them.
__global__ void __launch_bounds__((kWarps + 1) * 32)
    pull_bulk(const uint8_t* src, int64_t bytes, uint64_t timeout_ns) {
  extern __shared__ __align__(128) uint8_t ring[];
  constexpr int kStages = 12;
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], kWarps);
    mbar_init_fence();
  }
  __syncthreads();
  const int64_t chunks = bytes / (2 * kChunk);
  uint32_t item = 0;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x, ++item) {
    const int stage = item % kStages;
    if (warp == 0) {
      if (lane == 0) {
        mbar_wait(timeout_ns, &empty[stage], ((item / kStages) & 1) ^ 1);
        mbar_expect_tx(&full[stage], 2 * kChunk);
        bulk_load(ring + stage * 2 * kChunk, src + c * 2 * kChunk, 2 * kChunk, &full[stage]);
      }
    } else {
      mbar_wait(timeout_ns, &full[stage], (item / kStages) & 1);
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[stage]);
    }
  }
}

// Plain 16-byte loads from peer memory, eight in flight per thread.
__global__ void pull_loads(const int4* src, int64_t vectors, int* sink) {
  int acc = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors; i += 8 * stride) {
    int4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = i + u * stride < vectors ? src[i + u * stride] : int4{};
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].w;
  }
  if (acc == 0x12345678) *sink = acc;
}

// Lets `device` read and write `peer`'s memory (idempotent).
bool enable_peer_access(int device, int peer) {
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, device, peer) != cudaSuccess || !can) return false;
  cudaSetDevice(device);
  const cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();  // clears it
  return err == cudaSuccess || err == cudaErrorPeerAccessAlreadyEnabled;
}

// Moves `bytes` from a buffer on `from` to one on `to`, `iters` times, with the mechanism of
// `mode` (-1: the copy engine); pushes run on `from`, pulls on `to`.
struct Transfer {
  int from, to, mode, blocks;
  int64_t bytes;
  void* given_dst = nullptr;  // e.g. an XLA buffer on `to`; else dst is allocated here
  void *src = nullptr, *dst = nullptr;
  int* sink = nullptr;
  cudaStream_t stream = nullptr;
  cudaStream_t copier = nullptr;  // modes 8, 9: the copy engine's stream
  cudaEvent_t packed[kMaxStaged] = {}, copied = nullptr;

  int chunks() const { return mode == 8 ? 4 : 8; }  // modes 8, 9
  // Modes 6-9 and 11-13 quantise BF16 rows (2 * bytes, from src) into FP8 rows of 7168 bytes,
  // their scales (4 bytes per 128) after them; mode 10 keeps its local rows and output on `to`.
  bool quantises() const { return mode >= 6 && mode != 10; }
  int64_t rows() const { return bytes / kRowElems; }
  int64_t dst_bytes() const {
    return mode == 10 ? 2 * bytes : quantises() ? bytes + bytes / 32 : bytes;
  }
  int runner() const { return mode == 2 || mode == 3 || mode == 10 ? to : from; }
  bool setup() {
    if (!enable_peer_access(from, to) || !enable_peer_access(to, from)) return false;
    cudaSetDevice(to);
    dst = given_dst;
    if (!given_dst) cudaMalloc(&dst, dst_bytes());
    cudaSetDevice(from);
    // x, then local rows (modes 6, 8, 9, 11, 12); the quantisation's work does not depend on values
    cudaMalloc(&src, mode == 4 ? 3 * bytes : quantises() ? 2 * bytes + dst_bytes() : bytes);
    if (quantises()) cudaMemset(src, 0, 2 * bytes);
    cudaSetDevice(runner());
    cudaMalloc(&sink, sizeof(int));
    cudaStreamCreate(&stream);
    if (mode == 8 || mode == 9) {
      cudaStreamCreateWithFlags(&copier, cudaStreamNonBlocking);
      for (int c = 0; c < chunks(); ++c)
        cudaEventCreateWithFlags(&packed[c], cudaEventDisableTiming);
      cudaEventCreateWithFlags(&copied, cudaEventDisableTiming);
    }
    cudaFuncSetAttribute(push_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         kWarps * kDepth * kChunk);
    cudaFuncSetAttribute(pull_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, 12 * 2 * kChunk);
    return cudaGetLastError() == cudaSuccess;
  }
  void launch() {
    cudaSetDevice(runner());
    switch (mode) {
      case -1:
        cudaMemcpyPeerAsync(dst, to, src, from, bytes, stream);
        break;
      case 0:
        push_bulk<<<blocks, kWarps * 32, kWarps * kDepth * kChunk, stream>>>(
            static_cast<uint8_t*>(dst), bytes);
        break;
      case 1:
        push_stores<<<blocks, 512, 0, stream>>>(static_cast<int4*>(dst), bytes / 16, nullptr);
        break;
      case 4:
        push_stores<<<blocks, 512, 0, stream>>>(static_cast<int4*>(dst), bytes / 16,
                                                static_cast<int4*>(src));
        break;
      case 5:
        push_rows<<<blocks, 768, 0, stream>>>(static_cast<uint8_t*>(dst), bytes, kRowElems);
        break;
      case 11:  // the quantisation alone, into local rows
      case 6:
      case 7: {
        uint8_t* x = static_cast<uint8_t*>(src);
        push_send_rows<<<blocks, kRowWarps * 32, 0, stream>>>(
            x, mode == 7 ? nullptr : x + 2 * bytes,
            mode == 11 ? nullptr : static_cast<uint8_t*>(dst), rows(), 0, rows());
        break;
      }
      case 12:
      case 13:
        quantise_rows_lean<<<blocks, kRowWarps * 32, 0, stream>>>(
            static_cast<const uint8_t*>(src),
            mode == 12 ? static_cast<uint8_t*>(src) + 2 * bytes : static_cast<uint8_t*>(dst),
            rows());
        break;
      case 8:
      case 9: {  // chunks quantised into local staging, each moved by the copy engine meanwhile
        uint8_t* x = static_cast<uint8_t*>(src);
        uint8_t *staging = x + 2 * bytes, *to_rows = static_cast<uint8_t*>(dst);
        for (int c = 0; c < chunks(); ++c) {
          const int64_t first = rows() * c / chunks(), end = rows() * (c + 1) / chunks();
          push_send_rows<<<blocks, kRowWarps * 32, 0, stream>>>(x, staging, nullptr, rows(), first,
                                                                end);
          cudaEventRecord(packed[c], stream);
          cudaStreamWaitEvent(copier, packed[c], 0);
          cudaMemcpyPeerAsync(to_rows + first * kRowElems, to, staging + first * kRowElems, from,
                              (end - first) * kRowElems, copier);
        }
        const int64_t scales = rows() * kRowElems;  // then every row's scales at once
        cudaMemcpyPeerAsync(to_rows + scales, to, staging + scales, from, rows() * kRowScales * 4,
                            copier);
        cudaEventRecord(copied, copier);
        cudaStreamWaitEvent(stream, copied, 0);
        break;
      }
      case 10: {  // bytes: the peer's BF16 rows; local rows and the output live in dst
        uint8_t* here = static_cast<uint8_t*>(dst);
        pull_sum_rows<<<blocks, kSumWarps * 32, 0, stream>>>(here, static_cast<const uint8_t*>(src),
                                                             here + bytes, bytes / (kRowElems * 2));
        break;
      }
      case 2:
        pull_bulk<<<blocks, (kWarps + 1) * 32, 12 * 2 * kChunk, stream>>>(
            static_cast<const uint8_t*>(src), bytes, uint64_t(10e9));
        break;
      case 3:
        pull_loads<<<blocks, 512, 0, stream>>>(static_cast<const int4*>(src), bytes / 16, sink);
    }
  }
  void finish() {
    cudaSetDevice(runner());
    cudaStreamSynchronize(stream);
  }
  void release() {
    cudaSetDevice(runner());
    cudaStreamDestroy(stream);
    if (copier) {
      cudaStreamDestroy(copier);
      for (int c = 0; c < chunks(); ++c) cudaEventDestroy(packed[c]);
      cudaEventDestroy(copied);
    }
    cudaFree(sink);
    cudaSetDevice(from);
    cudaFree(src);
    cudaSetDevice(to);
    if (!given_dst) cudaFree(dst);
  }
};

}  // namespace

double peer_gbps(int src, int dst, int64_t bytes, int blocks, int mode, int iters, bool both_ways,
                 void* dst_buffer) {
  if (mode < -1 || mode > 13 || (dst_buffer && (both_ways || mode == 2 || mode == 3 || mode >= 6)))
    return -1.0;
  int previous = 0;
  cudaGetDevice(&previous);
  std::vector<Transfer> transfers{{src, dst, mode, blocks, bytes, dst_buffer}};
  if (both_ways) transfers.push_back({dst, src, mode, blocks, bytes});
  bool ok = true;
  for (auto& t : transfers) ok = ok && t.setup();
  double seconds = 0;
  if (ok) {
    for (auto& t : transfers) t.launch(), t.finish();  // warm up
    auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i)
      for (auto& t : transfers) t.launch();
    for (auto& t : transfers) t.finish();
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ok = cudaGetLastError() == cudaSuccess;
  }
  for (auto& t : transfers) t.release();
  cudaSetDevice(previous);
  return ok && seconds > 0 ? double(bytes) * iters / seconds / 1e9 : -1.0;
}

}  // namespace jax_ep::probe
