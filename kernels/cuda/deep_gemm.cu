// DeepGEMM's SM90 kernels (deep_gemm.h), launched without DeepGEMM's JIT: one instance per
// product, tile shape and group count, compiled here, with the shapes given at run time. Their
// grouped layout is DeepGEMM's "psum" one, each group's end row: its scheduler walks the groups
// (a compile-time count: the groups are padded with empty ones) and stops after the last, so no
// tile of the rows past the groups is computed. tgmm's is each group's rows.
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
constexpr uint32_t kSmemCapacity = 232448;  // shared memory per block of an sm_90 GPU, opted in
// FP8: the weights' scales of a tile's K steps sit in shared memory, sized from K at run time;
// the stages are sized for K up to kDeepGemmMaxFp8K.
constexpr uint32_t kMaxFp8K = kDeepGemmMaxFp8K;

constexpr uint32_t align_up(uint32_t x, uint32_t to) { return (x + to - 1) / to * to; }

// One kernel: product P in BlockM x BlockN tiles (ShapeN, ShapeK: DeepGEMM's N and K fixed at
// compile time, 0: given at run time; Groups: the groups its scheduler walks, padded with empty
// ones; Cluster: CTAs that share the loads of A's tile (SharedA) or of B's, each loaded once and
// multicast to both), as many pipeline stages as fit (DeepGEMM's own sizing: the output tile, the
// stages' operand tiles, FP8's row scales per stage and the weight scales of every K step, the
// barriers).
template <GroupedProduct P, uint32_t BlockM, uint32_t BlockN, uint32_t ShapeN = 0,
          uint32_t Groups = 1, uint32_t ShapeK = 0, uint32_t Cluster = 1, bool SharedA = false>
struct Kernel {
  static constexpr bool kFp8 = P == GroupedProduct::kGmmFp8;
  // tgmm is DeepGEMM's "k-grouped" product: each group's rows are the sum's steps.
  static constexpr bool kKGrouped = P == GroupedProduct::kTgmm;
  static constexpr uint32_t kBlockM = BlockM;
  static constexpr uint32_t kElem = kFp8 ? 1 : 2, kBlockK = 128 / kElem;
  // gmm reads the weights [G, K, N] N-major; gmm_t and FP8 read [G, N, K] K-major; tgmm reads
  // both operands' rows [M, K] and [M, N], K and N innermost.
  static constexpr Major kMajorA = kKGrouped ? Major::MN : Major::K;
  static constexpr Major kMajorB = P == GroupedProduct::kGmm || kKGrouped ? Major::MN : Major::K;
  static constexpr uint32_t kSwizzleA = kMajorA == Major::K ? 128 : swizzle_bytes(BlockM * kElem);
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
  // DeepGEMM's conditions on a cluster: whole clusters on the grid and, for the grouped layout,
  // an even count of N tiles (its scheduler turns the multicast off where two m tiles of a
  // cluster fall in different groups); tgmm's K (DeepGEMM's m) and sum (its k) are run time's.
  static_assert(kSms % Cluster == 0 &&
                (Cluster == 1 || (ShapeN && (ShapeN + BlockN - 1) / BlockN % Cluster == 0)));
  static_assert(!kKGrouped || (ShapeK == 0 && Cluster == 1));

  static uint32_t smem_bytes(uint32_t k) {
    const uint32_t weight_scales = kFp8 ? align_up(k / kBlockK * 4 * kWeightScales, 8) : 0;
    return kOutput + kBarriers + weight_scales + kStages * kPerStage;
  }

  static constexpr GemmType kLayout =
      kKGrouped ? GemmType::KGroupedContiguous : GemmType::MGroupedContiguousWithPsumLayout;

  static auto function() {
    if constexpr (kFp8)
      return &deep_gemm::sm90_fp8_gemm_1d2d_impl<Major::MN, 0, ShapeN, ShapeK, Groups, kBlockM,
                                                 BlockN, kBlockK, kSwizzleA, kSwizzleB, kSwizzleD,
                                                 kStages, kTmaThreads, kMathThreads, Cluster,
                                                 SharedA, kSms, kLayout, cutlass::bfloat16_t>;
    else
      return &deep_gemm::sm90_bf16_gemm_impl<kMajorA, kMajorB, 0, ShapeN, ShapeK, Groups, kBlockM,
                                             BlockN, kBlockK, kSwizzleA, kSwizzleB, kSwizzleD,
                                             kStages, kTmaThreads, kMathThreads, Cluster, SharedA,
                                             kSms, kLayout, false, cutlass::bfloat16_t>;
  }

  // DeepGEMM's m, n, k: out [rows, n] = lhs [rows, k] times group g's [k, n]; tgmm: out[g]
  // [K, N] = lhs [rows of g, K]^T times rhs [rows of g, N] (m = K, k = the group's rows).
  // layout: each tile's group (m-grouped), or each group's rows (tgmm).
  static std::string launch(const GroupedGemmArgs& a, int* layout, const float* lhs_scales_t,
                            cudaStream_t stream) {
    const uint64_t rows = a.m, groups = a.groups;
    const uint64_t m = kKGrouped ? a.k : rows, n = P == GroupedProduct::kGmmT ? a.k : a.n,
                   k = kKGrouped                    ? rows
                       : P == GroupedProduct::kGmmT ? a.n
                                                    : a.k;
    const auto element = kFp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    const auto bf16 = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    CUtensorMap lhs, rhs, out, scales{};
    std::string error;
    if constexpr (kKGrouped) {  // lhs [rows, K], rhs [rows, N], out [G, K, N]
      error = operand_map(lhs, a.lhs, bf16, 2, m, rows, kBlockK, kSwizzleA);
      if (error.empty()) error = operand_map(rhs, a.rhs, bf16, 2, n, rows, kBlockK, kSwizzleB);
      if (error.empty())
        error = operand_map(out, a.out, bf16, 2, n, m * groups, kBlockM, kSwizzleD);
    } else {
      error = operand_map(lhs, a.lhs, element, kElem, k, rows, kBlockM, kSwizzleA);
      if (error.empty())
        error = kMajorB == Major::MN
                    ? operand_map(rhs, a.rhs, element, kElem, n, k * groups, kBlockK, kSwizzleB)
                    : operand_map(rhs, a.rhs, element, kElem, k, n * groups, BlockN, kSwizzleB);
      if (error.empty()) error = operand_map(out, a.out, bf16, 2, n, rows, kBlockM, kSwizzleD);
    }
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
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim = {Cluster, 1, 1};
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(kSms);
    config.blockDim = dim3(kTmaThreads + kMathThreads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = &cluster;
    config.numAttrs = Cluster > 1;  // as DeepGEMM launches: no cluster attribute for one CTA
    cudaError_t launched;
    if constexpr (kFp8)
      launched =
          cudaLaunchKernelEx(&config, fn, const_cast<float*>(a.rhs_scales), layout, uint32_t(rows),
                             uint32_t(n), uint32_t(k), lhs, rhs, out, scales);
    else
      launched = cudaLaunchKernelEx(&config, fn, layout, uint32_t(m), uint32_t(n), uint32_t(k), lhs,
                                    rhs, out);
    if (launched == cudaSuccess) launched = cudaPeekAtLastError();
    if (launched != cudaSuccess) {
      cudaGetLastError();  // clears it
      return std::string("DeepGEMM's kernel: ") + cudaGetErrorString(launched);
    }
    return "";
  }
};

// The tiles, per product, from lab.versus_deepgemm's sweep on an H200 at DeepSeek-V3's expert
// shapes (bench/results/grouped_matmul/versus-deepgemm-nvidia-h200-2026-12-05.json): the best
// single-CTA tile of each projection, gate/up (N < K) and down (N > K), TFLOP/s there. FP8 tiles
// wider than 128 straddle the weights' 128-column scale blocks, and that kernel keeps its
// registers (no spills) only with N fixed at compile time: instances for V3's two N, 128-wide
// tiles for any other. V3's FP8 down projection itself (K 2048: 16 steps a tile) runs ~5% faster
// through JAX on a cluster of two CTAs sharing the weights' loads with K fixed too, and on
// neither alone (an H100,
// bench/results/grouped_matmul/deepgemm-variants-nvidia-h100-2026-12-05.txt). Each comes for
// every group count of kGroupCounts.
template <uint32_t Groups>
struct Kernels {
  using Fp8GateUp = Kernel<GroupedProduct::kGmmFp8, 128, 192, 2048, Groups>;  // 1202-1205
  using Fp8Down = Kernel<GroupedProduct::kGmmFp8, 128, 160, 7168, Groups>;    // 1081-1168
  using Fp8V3Down = Kernel<GroupedProduct::kGmmFp8, 128, 192, 7168, Groups, 2048, 2>;
  using Fp8AnyN = Kernel<GroupedProduct::kGmmFp8, 128, 128, 0, Groups>;        // 1038-1149
  using GmmNarrow = Kernel<GroupedProduct::kGmm, 128, 256, 0, Groups>;         // 694-697
  using GmmWide = Kernel<GroupedProduct::kGmm, 128, 192, 0, Groups>;           // 657-680
  using GmmT = Kernel<GroupedProduct::kGmmT, 128, 256, 0, Groups>;             // 661-696
  using Tgmm = Kernel<GroupedProduct::kTgmm, kDeepGemmTgmmK, 128, 0, Groups>;  // 619-647
};

// The group counts the kernels are built for: a call's groups are padded to the next, with empty
// groups, which its scheduler passes over at the end (at most 4x the groups).
constexpr uint32_t kGroupCounts[] = {16, 64, kDeepGemmMaxGroups};

// The group count of a call's kernel (0: more groups than any takes).
int group_count(int groups) {
  for (uint32_t count : kGroupCounts)
    if (groups <= int(count)) return int(count);
  return 0;
}

template <uint32_t Groups, class Fn>
std::string with_kernel_of(const GroupedGemmArgs& a, Fn&& fn) {
  using K = Kernels<Groups>;
  const bool wide = a.n > a.k;
  switch (a.product) {
    case GroupedProduct::kTgmm:
      return fn(typename K::Tgmm{});
    case GroupedProduct::kGmmFp8:
      return a.n == 2048                  ? fn(typename K::Fp8GateUp{})
             : a.n == 7168 && a.k == 2048 ? fn(typename K::Fp8V3Down{})
             : a.n == 7168                ? fn(typename K::Fp8Down{})
                                          : fn(typename K::Fp8AnyN{});
    case GroupedProduct::kGmm:
      return wide ? fn(typename K::GmmWide{}) : fn(typename K::GmmNarrow{});
    case GroupedProduct::kGmmT:
      return fn(typename K::GmmT{});
    default:
      return "DeepGEMM: no kernel for this product";
  }
}

template <class Fn>
std::string with_kernel(const GroupedGemmArgs& a, Fn&& fn) {
  switch (group_count(a.groups)) {
    case kGroupCounts[0]:
      return with_kernel_of<kGroupCounts[0]>(a, fn);
    case kGroupCounts[1]:
      return with_kernel_of<kGroupCounts[1]>(a, fn);
    case kGroupCounts[2]:
      return with_kernel_of<kGroupCounts[2]>(a, fn);
    default:
      return "DeepGEMM's kernels take at most " + std::to_string(kDeepGemmMaxGroups) + " groups";
  }
}

// The groups' ends as DeepGEMM's psum layout takes them. Its group g's tiles run from the end of
// g - 1 rounded up to 128 rows to g's end; end'_g = max(end_g, end_{g-1} rounded up) keeps that
// range non-negative, makes it exactly the rows of a group DeepGEMM takes (deep_gemm_takes_group:
// the group before it ends on a boundary), and keeps every other group's tiles on rows that
// CUTLASS's kernel or the zeroing overwrite. Padding groups end where the last one's tiles end.
__global__ void psum_ends_kernel(int32_t groups, int32_t count, const int32_t* rows,
                                 const int64_t* offsets, int* ends) {
  const auto end = [&](int g) {  // a padding group's: the last group's
    const int e = min(g, groups - 1);
    return offsets[e] + rows[e];
  };
  for (int g = blockIdx.x * blockDim.x + threadIdx.x; g < count; g += gridDim.x * blockDim.x) {
    const int64_t own = end(g), before = g ? end(g - 1) : 0;
    ends[g] = int(max(own, (before + kDeepGemmRows - 1) / kDeepGemmRows * kDeepGemmRows));
  }
}

// tgmm: each group's rows for DeepGEMM's k-grouped kernel, padded with empty groups; all zero
// (nothing for it to compute) unless it takes every group (deep_gemm_takes_k_group).
__global__ void k_group_sizes_kernel(int32_t groups, int32_t count, const int32_t* rows,
                                     int* sizes) {
  bool misaligned = false;
  for (int e = threadIdx.x; e < groups; e += blockDim.x)
    misaligned |= !deep_gemm_takes_k_group(rows[e]);
  const bool all = !__syncthreads_or(misaligned);
  for (int e = threadIdx.x; e < count; e += blockDim.x) sizes[e] = all && e < groups ? rows[e] : 0;
}

// FP8: the rows' scales [M, K/128] as DeepGEMM's TMA reads them, [K/128, M rounded up to 4],
// for the rows in groups only: a row past them is computed from whatever its scales hold, and the
// zeroing overwrites it. Through shared memory in 32 x 32 tiles, so that a warp reads and writes
// 32 consecutive floats (written one float per M-strided row, it ran at ~0.45 TB/s).
constexpr int kTransposeTile = 32, kTransposeRowsPerPass = 8;
__global__ void transpose_scales_kernel(const float* scales, int64_t m, int64_t blocks,
                                        int32_t groups, const int32_t* rows, const int64_t* offsets,
                                        float* scales_t) {
  __shared__ float tile[kTransposeTile][kTransposeTile + 1];  // + 1: no bank conflicts
  const int64_t m_padded = (m + 3) / 4 * 4, total = offsets[groups - 1] + rows[groups - 1];
  const int64_t row0 = int64_t(blockIdx.x) * kTransposeTile;
  const int64_t block0 = int64_t(blockIdx.y) * kTransposeTile;
  if (row0 >= total) return;
  for (int i = threadIdx.y; i < kTransposeTile; i += kTransposeRowsPerPass) {
    const int64_t row = row0 + i, block = block0 + threadIdx.x;
    if (row < total && block < blocks) tile[i][threadIdx.x] = scales[row * blocks + block];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < kTransposeTile; i += kTransposeRowsPerPass) {
    const int64_t block = block0 + i, row = row0 + threadIdx.x;
    if (row < total && block < blocks) scales_t[block * m_padded + row] = tile[threadIdx.x][i];
  }
}

struct Scratch {
  int* layout;
  float* lhs_scales_t;
  size_t bytes;

  Scratch(void* base, const GroupedGemmArgs& a) {
    layout = static_cast<int*>(base);
    const size_t layout_bytes = (group_count(a.groups) * sizeof(int) + 255) / 256 * 256;
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
  // tgmm's output tiles are 256 rows of one group's [K, N] block: K must not split one.
  if (a.product == GroupedProduct::kTgmm && a.k % kDeepGemmTgmmK)
    return "DeepGEMM's weight gradient takes K multiples of " + std::to_string(kDeepGemmTgmmK);
  return with_kernel(a, [](auto) { return std::string(); });
}

size_t deep_gemm_scratch_bytes(const GroupedGemmArgs& a) { return Scratch(nullptr, a).bytes; }

std::string deep_gemm(const GroupedGemmArgs& a, const int32_t* rows, const int64_t* offsets,
                      void* scratch, cudaStream_t stream) {
  Scratch s(scratch, a);
  const int count = group_count(a.groups);
  if (a.product == GroupedProduct::kTgmm)
    k_group_sizes_kernel<<<1, 1024, 0, stream>>>(a.groups, count, rows, s.layout);
  else
    psum_ends_kernel<<<(count + 255) / 256, 256, 0, stream>>>(a.groups, count, rows, offsets,
                                                              s.layout);
  if (a.product == GroupedProduct::kGmmFp8)
    transpose_scales_kernel<<<dim3((a.m + kTransposeTile - 1) / kTransposeTile,
                                   (a.k / kFp8Block + kTransposeTile - 1) / kTransposeTile),
                              dim3(kTransposeTile, kTransposeRowsPerPass), 0, stream>>>(
        a.lhs_scales, a.m, a.k / kFp8Block, a.groups, rows, offsets, s.lhs_scales_t);
  if (cudaPeekAtLastError() != cudaSuccess)
    return std::string("DeepGEMM's layout: ") + cudaGetErrorString(cudaGetLastError());
  return with_kernel(a, [&](auto kernel) {
    return decltype(kernel)::launch(a, s.layout, s.lhs_scales_t, stream);
  });
}

}  // namespace jax_ep::cuda
