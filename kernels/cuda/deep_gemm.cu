// DeepGEMM's SM90 kernels (deep_gemm.h), launched without DeepGEMM's JIT: one instance per
// product and tile shape, compiled here, with the shapes given at run time. Their grouped layout
// is DeepGEMM's "m-grouped contiguous" one: for each 128-row tile, the group whose weights it
// takes (read at the tile's row 0, and by FP8 at its row 64: one per math warpgroup), -1 for none.
#include <deep_gemm/impls/sm90_bf16_gemm.cuh>
#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>

#include "kernels/cuda/deep_gemm.h"
#include "kernels/cuda/tma.h"
#include "kernels/fp8.h"

namespace jax_ep::cuda {
namespace {

using deep_gemm::GemmType;
using Major = cute::UMMA::Major;

// DeepGEMM's kernels are persistent over a grid of this many CTAs, fixed at compile time: the
// SMs of an H100 (SXM), H800 or H200. They do not run on a device with another count.
constexpr uint32_t kSms = kDeepGemmSms;
constexpr uint32_t kTmaThreads = 128, kMathThreads = 256;  // one producer, two math warpgroups
constexpr uint32_t kBlockM = kDeepGemmRows;
constexpr uint32_t kSmemCapacity = 232448;  // shared memory per block of an sm_90 GPU, opted in
// FP8: the weights' scales of a tile's K steps sit in shared memory, sized from K at run time;
// the stages are sized for K up to kDeepGemmMaxFp8K.
constexpr uint32_t kMaxFp8K = kDeepGemmMaxFp8K;

constexpr uint32_t align_up(uint32_t x, uint32_t to) { return (x + to - 1) / to * to; }

// One kernel: product P in BlockN-wide tiles (ShapeN: DeepGEMM's N fixed at compile time, 0:
// given at run time), as many pipeline stages as fit (DeepGEMM's own sizing: the output tile, the
// stages' operand tiles, FP8's row scales per stage and the weight scales of every K step, the
// barriers).
template <GroupedProduct P, uint32_t BlockN, uint32_t ShapeN = 0>
struct Kernel {
  static constexpr bool kFp8 = P == GroupedProduct::kGmmFp8;
  static constexpr uint32_t kElem = kFp8 ? 1 : 2, kBlockK = 128 / kElem;
  // gmm reads the weights [G, K, N] N-major; gmm_t and FP8 read [G, N, K] K-major.
  static constexpr Major kMajorB = P == GroupedProduct::kGmm ? Major::MN : Major::K;
  static constexpr uint32_t kSwizzleA = 128;
  static constexpr uint32_t kSwizzleB = kMajorB == Major::K ? 128 : swizzle_bytes(BlockN * kElem);
  static constexpr uint32_t kSwizzleD = swizzle_bytes(BlockN * 2);
  // FP8: a tile reads one weight-scale block per K step, or two where BlockN spans two.
  static constexpr uint32_t kWeightScales = kBlockK % BlockN == 0 ? 1 : 2;
  static constexpr uint32_t kPerStage =
      (kBlockM + BlockN) * kBlockK * kElem + (kFp8 ? align_up(kBlockM * 4, 128) : 0);
  static constexpr uint32_t kBarriers = 16 * 8 * 2;  // at most 16 stages, two 8-byte barriers
  static constexpr uint32_t kOutput = align_up(kBlockM * BlockN * 2, 1024);
  static constexpr uint32_t kStages = std::min(
      (kSmemCapacity - kOutput - kBarriers - (kFp8 ? kMaxFp8K / kBlockK * 4 * kWeightScales : 0)) /
          kPerStage,
      16u);
  static_assert(kStages >= 3 && (kBlockM * BlockN >= 128 * 192 || kStages >= 4),
                "too few stages to hide the loads");

  static uint32_t smem_bytes(uint32_t k) {
    const uint32_t weight_scales = kFp8 ? align_up(k / kBlockK * 4 * kWeightScales, 8) : 0;
    return kOutput + kBarriers + weight_scales + kStages * kPerStage;
  }

  static auto function() {
    if constexpr (kFp8)
      return &deep_gemm::sm90_fp8_gemm_1d2d_impl<Major::MN, 0, ShapeN, 0, 1, kBlockM, BlockN,
                                                 kBlockK, kSwizzleA, kSwizzleB, kSwizzleD, kStages,
                                                 kTmaThreads, kMathThreads, 1, false, kSms,
                                                 GemmType::MGroupedContiguous, cutlass::bfloat16_t>;
    else
      return &deep_gemm::sm90_bf16_gemm_impl<
          Major::K, kMajorB, 0, ShapeN, 0, 1, kBlockM, BlockN, kBlockK, kSwizzleA, kSwizzleB,
          kSwizzleD, kStages, kTmaThreads, kMathThreads, 1, false, kSms,
          GemmType::MGroupedContiguous, false, cutlass::bfloat16_t>;
  }

  // DeepGEMM's m, n, k: out [rows, n] = lhs [rows, k] times group g's [k, n].
  static std::string launch(const GroupedGemmArgs& a, int* layout, const float* lhs_scales_t,
                            cudaStream_t stream) {
    const uint64_t rows = a.m, n = P == GroupedProduct::kGmmT ? a.k : a.n,
                   k = P == GroupedProduct::kGmmT ? a.n : a.k, groups = a.groups;
    const auto element = kFp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    CUtensorMap lhs, rhs, out, scales{};
    std::string error = operand_map(lhs, a.lhs, element, kElem, k, rows, kBlockM, kSwizzleA);
    if (error.empty())
      error = kMajorB == Major::MN
                  ? operand_map(rhs, a.rhs, element, kElem, n, k * groups, kBlockK, kSwizzleB)
                  : operand_map(rhs, a.rhs, element, kElem, k, n * groups, BlockN, kSwizzleB);
    if (error.empty())
      error =
          operand_map(out, a.out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, n, rows, kBlockM, kSwizzleD);
    const uint64_t rows_padded = (rows + 3) / 4 * 4;
    if (error.empty() && kFp8)
      error = tensor_map(scales, lhs_scales_t, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, rows_padded,
                         k / kFp8Block, rows_padded * 4, kBlockM, 1, 0);
    if (!error.empty()) return "DeepGEMM's tensor maps: " + error;

    const auto fn = function();
    const uint32_t smem = smem_bytes(uint32_t(k));
    if (cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) !=
        cudaSuccess)
      return std::string("DeepGEMM's shared memory: ") + cudaGetErrorString(cudaGetLastError());
    if constexpr (kFp8)
      fn<<<kSms, kTmaThreads + kMathThreads, smem, stream>>>(const_cast<float*>(a.rhs_scales),
                                                             layout, uint32_t(rows), uint32_t(n),
                                                             uint32_t(k), lhs, rhs, out, scales);
    else
      fn<<<kSms, kTmaThreads + kMathThreads, smem, stream>>>(layout, uint32_t(rows), uint32_t(n),
                                                             uint32_t(k), lhs, rhs, out);
    if (cudaPeekAtLastError() != cudaSuccess)
      return std::string("DeepGEMM's kernel: ") + cudaGetErrorString(cudaGetLastError());
    return "";
  }
};

// The tiles, per product, from bench.versus_deepgemm's sweep on an H200 at DeepSeek-V3's expert
// shapes (bench/results/versus-deepgemm-*.json): the best single-CTA tile of each projection,
// gate/up (N < K) and down (N > K), TFLOP/s there. FP8 tiles wider than 128 straddle the
// weights' 128-column scale blocks, and that kernel keeps its registers (no spills) only with N
// fixed at compile time: instances for V3's two N, 128-wide tiles for any other.
using Fp8GateUp = Kernel<GroupedProduct::kGmmFp8, 192, 2048>;  // 1202-1205
using Fp8Down = Kernel<GroupedProduct::kGmmFp8, 160, 7168>;    // 1081-1168
using Fp8AnyN = Kernel<GroupedProduct::kGmmFp8, 128>;          // 1038-1149
using GmmNarrow = Kernel<GroupedProduct::kGmm, 256>;           // 694-697
using GmmWide = Kernel<GroupedProduct::kGmm, 192>;             // 657-680
using GmmT = Kernel<GroupedProduct::kGmmT, 256>;               // 661-696

template <class Fn>
std::string with_kernel(const GroupedGemmArgs& a, Fn&& fn) {
  const bool wide = a.n > a.k;
  switch (a.product) {
    case GroupedProduct::kGmmFp8:
      return a.n == 2048 ? fn(Fp8GateUp{}) : a.n == 7168 ? fn(Fp8Down{}) : fn(Fp8AnyN{});
    case GroupedProduct::kGmm:
      return wide ? fn(GmmWide{}) : fn(GmmNarrow{});
    case GroupedProduct::kGmmT:
      return fn(GmmT{});
    default:
      return "DeepGEMM's kernels compute gmm, gmm_t and FP8 gmm";
  }
}

// The tiles' groups: tile t (rows from t * 128) takes group g's weights when it lies in g and g
// is DeepGEMM's, else -1. One thread per tile, a binary search over the groups' ends.
__global__ void tile_groups_kernel(int64_t m, int32_t groups, const int32_t* rows,
                                   const int64_t* offsets, const int64_t* total, int* layout) {
  const int64_t tiles = (m + kDeepGemmRows - 1) / kDeepGemmRows, all = *total;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < tiles;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = t * kDeepGemmRows;
    int lo = 0, hi = groups;  // the first group ending past `row`
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (offsets[mid] + rows[mid] <= row)
        lo = mid + 1;
      else
        hi = mid;
    }
    const bool taken =
        row < all && lo < groups && deep_gemm_takes_group(offsets[lo], rows[lo], all);
    const int group = taken ? lo : -1;
    layout[row] = group;
    if (row + kDeepGemmRows / 2 < m) layout[row + kDeepGemmRows / 2] = group;
  }
}

// FP8: the rows' scales [M, K/128] as DeepGEMM's TMA reads them, [K/128, M rounded up to 4].
__global__ void transpose_scales_kernel(const float* scales, int64_t m, int64_t blocks,
                                        float* scales_t) {
  const int64_t m_padded = (m + 3) / 4 * 4;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < m * blocks;
       i += int64_t(gridDim.x) * blockDim.x)
    scales_t[(i % blocks) * m_padded + i / blocks] = scales[i];
}

struct Scratch {
  int* layout;
  float* lhs_scales_t;
  size_t bytes;

  Scratch(void* base, const GroupedGemmArgs& a) {
    const int64_t rows = (a.m + kDeepGemmRows - 1) / kDeepGemmRows * kDeepGemmRows;
    layout = static_cast<int*>(base);
    const size_t layout_bytes = (rows * sizeof(int) + 255) / 256 * 256;
    lhs_scales_t = reinterpret_cast<float*>(static_cast<uint8_t*>(base) + layout_bytes);
    const bool fp8 = a.product == GroupedProduct::kGmmFp8;
    bytes = layout_bytes + (fp8 ? (a.m + 3) / 4 * 4 * (a.k / kFp8Block) * sizeof(float) : 0);
  }
};

}  // namespace

std::string deep_gemm_misfit(const GroupedGemmArgs& a, int device) {
  if (grouped_gemm_sms(device) != int(kSms))
    return "DeepGEMM's kernels are built for " + std::to_string(kSms) + " SMs, the device has " +
           std::to_string(grouped_gemm_sms(device));
  if (a.group_stride) return "DeepGEMM's kernels take consecutive groups (no group_stride)";
  if (a.m <= 0 || a.m > kDeepGemmMaxRows)
    return "DeepGEMM's kernels take 1 to " + std::to_string(kDeepGemmMaxRows) + " rows";
  const int64_t multiple = a.product == GroupedProduct::kGmmFp8 ? kFp8Block : kDeepGemmAlignment;
  if (a.k % multiple || a.n % multiple)
    return "DeepGEMM's kernels take K and N multiples of " + std::to_string(multiple);
  if (a.product == GroupedProduct::kGmmFp8 && a.k > kMaxFp8K)
    return "DeepGEMM's FP8 kernels take K up to " + std::to_string(kMaxFp8K);
  return with_kernel(a, [](auto) { return std::string(); });
}

size_t deep_gemm_scratch_bytes(const GroupedGemmArgs& a) { return Scratch(nullptr, a).bytes; }

std::string deep_gemm(const GroupedGemmArgs& a, const int32_t* rows, const int64_t* offsets,
                      const int64_t* total, void* scratch, cudaStream_t stream) {
  Scratch s(scratch, a);
  const int64_t tiles = (a.m + kDeepGemmRows - 1) / kDeepGemmRows;
  tile_groups_kernel<<<int((tiles + 255) / 256), 256, 0, stream>>>(a.m, a.groups, rows, offsets,
                                                                   total, s.layout);
  if (a.product == GroupedProduct::kGmmFp8)
    transpose_scales_kernel<<<2 * kSms, 256, 0, stream>>>(a.lhs_scales, a.m, a.k / kFp8Block,
                                                          s.lhs_scales_t);
  if (cudaPeekAtLastError() != cudaSuccess)
    return std::string("DeepGEMM's layout: ") + cudaGetErrorString(cudaGetLastError());
  return with_kernel(a, [&](auto kernel) {
    return decltype(kernel)::launch(a, s.layout, s.lhs_scales_t, stream);
  });
}

}  // namespace jax_ep::cuda
