// FP8 quantization on GPUs (the rule of kernels/fp8.h), for the operands of jax_ep.nn's FP8
// grouped matmuls: rows in 1 x 128 blocks (a warp per row, as the dispatch quantizes) and
// expert weights in 128 x 128 blocks (a block per weight block, which it stores K innermost
// through shared memory and, when asked, N innermost as it was read).
#include "kernels/cuda/rows.cuh"
#include "kernels/cuda/sync.cuh"
#include "kernels/cuda/warp.cuh"

namespace jax_ep::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(QuantizeRowsArgs a) {
  using Step = RowStep<T, true>;
  const int lane = threadIdx.x % 32, warps = gridDim.x * (kThreads / 32);
  const int blocks = a.hidden / kFp8Block;
  for (int64_t r = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; r < a.rows; r += warps) {
    const T* row = static_cast<const T*>(a.x) + r * a.hidden;
    for (int first = 0; first < a.hidden; first += Step::kStep) {
      // A 128 block is whole in or past the row (hidden is a multiple of 128): the lanes
      // past it quantize zeros and store nothing.
      const int e = first + lane * Step::kElems;
      int4 v[Step::kLoads];
#pragma unroll
      for (int l = 0; l < Step::kLoads; ++l)
        v[l] = e < a.hidden ? __ldg(reinterpret_cast<const int4*>(row + e) + l)
                            : make_int4(0, 0, 0, 0);
      float scale;
      const int4 q = quantize16<T>(v, a.round_scale, &scale);
      if (e >= a.hidden) continue;
      *reinterpret_cast<int4*>(a.q + r * a.hidden + e) = q;
      if (lane % Step::kLanesPerBlock == 0) a.scales[r * blocks + e / kFp8Block] = scale;
    }
  }
}

// Block (bn, bk, g): weight block [bk * 128, +128) x [bn * 128, +128) of group g. Thread t holds
// 64 values of row t / 2 of the block, half t % 2.
constexpr int kHalf = kFp8Block / 2;
constexpr int kPitch = kFp8Block + 16;  // bytes per row of the transposed block (16-aligned)

template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_weights_kernel(QuantizeWeightsArgs a) {
  static_assert(kThreads == 2 * kFp8Block, "two threads per row of a weight block");
  __shared__ __align__(16) uint8_t transposed[kFp8Block * kPitch];  // [n][k] of the block
  __shared__ float warp_max[kThreads / 32];
  const int bn = blockIdx.x, bk = blockIdx.y, g = blockIdx.z, K = a.k, N = a.n;
  const int i = threadIdx.x / 2, j0 = threadIdx.x % 2 * kHalf;  // row in the block, first column
  const int64_t group = int64_t(g) * K * N;
  const T* src =
      static_cast<const T*>(a.w) + group + int64_t(bk * kFp8Block + i) * N + bn * kFp8Block + j0;
  float v[kHalf];
  constexpr int kPerWord = 16 / int(sizeof(T));
#pragma unroll
  for (int w = 0; w < kHalf / kPerWord; ++w) {
    const int4 word = __ldg(reinterpret_cast<const int4*>(src) + w);
#pragma unroll
    for (int x = 0; x < kPerWord; ++x) v[w * kPerWord + x] = element_as_float<T>(&word, x);
  }
  float max_abs = 0.f;
#pragma unroll
  for (int x = 0; x < kHalf; ++x) max_abs = fmaxf(max_abs, fabsf(v[x]));
  max_abs = group_max<32>(max_abs);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = max_abs;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) max_abs = fmaxf(max_abs, warp_max[w]);
  const Fp8Block block = Fp8Block::make(max_abs, false);
  const int kb = K / kFp8Block, nb = N / kFp8Block;
  if (threadIdx.x == 0) {
    a.scales[(int64_t(g) * nb + bn) * kb + bk] = block.scale;
    if (a.scales_t) a.scales_t[(int64_t(g) * kb + bk) * nb + bn] = block.scale;
  }
  uint32_t q[kHalf / 4];  // the 64 e4m3 bytes, in column order
#pragma unroll
  for (int x = 0; x < kHalf / 4; ++x) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(
        make_float2(block.scaled(v[4 * x]), block.scaled(v[4 * x + 1])), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(
        make_float2(block.scaled(v[4 * x + 2]), block.scaled(v[4 * x + 3])), __NV_SATFINITE,
        __NV_E4M3);
    q[x] = lo | hi << 16;
  }
  if (a.q_t) {  // N innermost: the row as read
    int4* to = reinterpret_cast<int4*>(a.q_t + group + int64_t(bk * kFp8Block + i) * N +
                                       bn * kFp8Block + j0);
#pragma unroll
    for (int w = 0; w < kHalf / 16; ++w)
      to[w] = make_int4(int(q[4 * w]), int(q[4 * w + 1]), int(q[4 * w + 2]), int(q[4 * w + 3]));
  }
#pragma unroll
  for (int x = 0; x < kHalf; ++x)
    transposed[(j0 + x) * kPitch + i] = uint8_t(q[x / 4] >> (8 * (x % 4)));
  __syncthreads();
  // K innermost: thread t stores half t % 2 of the block's column t / 2.
  const int4* from = reinterpret_cast<const int4*>(transposed + i * kPitch + j0);
  int4* to =
      reinterpret_cast<int4*>(a.q + group + int64_t(bn * kFp8Block + i) * K + bk * kFp8Block + j0);
#pragma unroll
  for (int w = 0; w < kHalf / 16; ++w) to[w] = from[w];
}

template <typename F>
cudaError_t with_float_type(Dtype dtype, F&& f) {
  return dtype == Dtype::kBF16 ? f(__nv_bfloat16()) : f(float());
}

}  // namespace

std::string quantize_rows(cudaStream_t stream, const QuantizeRowsArgs& a) {
  if (a.rows == 0 || a.hidden == 0) return {};
  constexpr int64_t kMaxBlocks = 4096;  // each warp then takes several rows
  const int blocks =
      int(std::min<int64_t>((a.rows + kThreads / 32 - 1) / (kThreads / 32), kMaxBlocks));
  JAX_EP_CUDA_TRY(with_float_type(a.dtype, [&](auto t) {
    quantize_rows_kernel<decltype(t)><<<blocks, kThreads, 0, stream>>>(a);
    return cudaGetLastError();
  }));
  return {};
}

std::string quantize_weights(cudaStream_t stream, const QuantizeWeightsArgs& a) {
  if (a.groups == 0 || a.k == 0 || a.n == 0) return {};
  if (a.groups > 65535 || a.k / kFp8Block > 65535)
    return "jax_ep: quantize_weights takes at most 65535 groups and 65535 blocks of K";
  const dim3 grid(a.n / kFp8Block, a.k / kFp8Block, a.groups);
  JAX_EP_CUDA_TRY(with_float_type(a.dtype, [&](auto t) {
    quantize_weights_kernel<decltype(t)><<<grid, kThreads, 0, stream>>>(a);
    return cudaGetLastError();
  }));
  return {};
}

}  // namespace jax_ep::cuda
