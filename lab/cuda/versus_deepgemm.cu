// jax_ep's grouped matmuls (CUTLASS's kernels, kernels/cuda/grouped_gemm.cu) against DeepGEMM's
// SM90 kernels on the same operands, timed alone, outside JAX. DeepGEMM (github.com/deepseek-ai/
// DeepGEMM, MIT; the headers of the sgl-deep-gemm wheel, as jax_ep builds with) is launched here
// without its JIT and torch, for a few tile shapes and clusters sized as its heuristics
// (csrc/jit_kernels/heuristics/sm90.hpp) size them:
//   gmm      out [M, N] = lhs [M, K] @ rhs[g] [K, N]     sm90_bf16_gemm, m-grouped, B N-major
//   gmm_t    out [M, K] = lhs [M, N] @ rhs[g]^T          sm90_bf16_gemm, m-grouped, B K-major
//   tgmm     out[g] [K, N] = lhs[g]^T @ rhs[g]            sm90_bf16_gemm, k-grouped, A, B M/N-major
//            (written in bf16 as jax_ep's is; DeepGEMM's own API accumulates into float32)
//   gmm_fp8  gmm in e4m3, lhs 1 x 128 and rhs 128 x 128 scales (rhs [G, N, K])
//                                                        sm90_fp8_gemm_1d2d, m-grouped
//   tgmm_fp8 tgmm in e4m3, both scaled per 128 rows and column, each group's rows transposed
//            (a weight gradient), into float32          sm90_fp8_gemm_1d1d, k-grouped
//            jax_ep has no FP8 tgmm: its bf16 tgmm of the same values, dequantized, is the
//            reference (the scales are powers of two, so the dequantized values are exact).
// The shape is EP8's per rank at DeepSeek-V3's sizes: 32768 rows in 32 groups, uniform or Zipf
// in multiples of 128 rows (DeepGEMM's grouped layouts start each group at a multiple of 128
// rows, so groups of any size would need padding). Prints each kernel's TFLOP/s (median and best
// of 7 samples of 20 calls) and DeepGEMM's output's relative L2 distance from jax_ep's (both sum
// in float32, in different orders). jax_ep's times include its small kernels around the GEMM
// (the groups' offsets, FP8's scale packing, the zeroing of rows no group covers); DeepGEMM's
// group ends are made here once.
//   nvcc -std=c++20 -O3 -DNDEBUG -gencode arch=compute_90a,code=sm_90a -I. \
//     -isystem $CUTLASS/include -isystem $CUTLASS/tools/util/include \
//     -isystem $DEEPGEMM_HOME/include --expt-relaxed-constexpr -diag-suppress 174,177,20168 \
//     lab/cuda/versus_deepgemm.cu -o versus_deepgemm
// (CUTLASS's headers first: jax_ep's kernels as jax_ep builds them; DEEPGEMM_HOME: the
// sgl-deep-gemm wheel's deep_gemm/ directory, whose include/ ships a CUTLASS of its own too.)
//   ./versus_deepgemm gmm|gmm_t|tgmm|gmm_fp8|tgmm_fp8 K N uniform|zipf [i,j,...]
// (K N: 7168 2048 or 2048 7168; i,j,...: the numbers of the DeepGEMM configurations to run, by
// default all, for going on after one that failed: python -m lab.versus_deepgemm runs it so.)
#include "kernels/cuda/grouped_gemm.cu"

#include <cuda.h>
#include <cuda_fp8.h>

#include <cmath>
#include <sstream>
#include <deep_gemm/impls/sm90_bf16_gemm.cuh>
#include <deep_gemm/impls/sm90_fp8_gemm_1d1d.cuh>
#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>
#include <string>
#include <vector>

#include "lab/cuda/alone.cuh"
#include "kernels/cuda/tma.h"

namespace {

using deep_gemm::GemmType;
using jax_ep::alone::device_random;
using jax_ep::cuda::GroupedProduct;
using jax_ep::cuda::swizzle_bytes;
using Major = cute::UMMA::Major;
using Fp8 = __nv_fp8_e4m3;

constexpr int64_t kRows = 32768;
constexpr uint32_t kGroups = 32;
constexpr uint32_t kSms = 132;  // DeepGEMM's kernels are persistent over a grid of every SM
constexpr uint32_t kSmemCapacity = 232448;  // an H100's / H200's shared memory per block, opted in
constexpr int kCalls = 20, kSamples = 7;

// The operands, shared by both kernels: jax_ep's layouts are DeepGEMM's, except FP8's lhs scales,
// which DeepGEMM's TMA reads as columns ([K/128, M rounded up to 4]).
struct Operands {
  GroupedProduct product;
  int64_t m, k, n;
  const void* lhs;
  const void* rhs;
  float* lhs_scales;     // gmm_fp8: [M, K/128]
  float* lhs_scales_t;   // gmm_fp8: [K/128, M rounded up to 4]
  float* rhs_scales;     // gmm_fp8: [G, K/128, N/128], DeepGEMM's "MN-major" weight scales
  int32_t* group_sizes;  // [G]
  int32_t* group_ends;   // [G] each group's end row (DeepGEMM's m-grouped "psum" layout)
  __nv_bfloat16* out;
  int64_t out_elems;
  // tgmm_fp8: each group's rows transposed, [K, rows of g] and [N, rows of g] one group after
  // the other, their scales [M/128, K] and [M/128, N] (per 128 rows and column), the output.
  Fp8* lhs_t;
  Fp8* rhs_t;
  float* lhs_t_scales;
  float* rhs_t_scales;
  float* out_f32;
  uint64_t first_group_rows;
};

// What a kernel writes: its output, compared with jax_ep's.
struct Output {
  void* data;
  int64_t elems;
  bool f32;  // float32, else bfloat16
};

__global__ void transpose_scales_kernel(const float* scales, float* scales_t, int64_t m,
                                        int64_t blocks, int64_t m_padded) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < m * blocks;
       i += int64_t(gridDim.x) * blockDim.x)
    scales_t[(i % blocks) * m_padded + i / blocks] = scales[i];
}

// Powers of two, 2^-9 to 2^-12 by a hash of the index: scales whose products with e4m3 values
// are exact in bf16.
__global__ void power_of_two_scales_kernel(float* scales, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    scales[i] = ldexpf(1.f, -9 - int(jax_ep::alone::hash_index(i, seed) & 3));
}

// rows [M, cols] = each group's transposed e4m3 block times its scales:
// rows[i][c] = t[g][c][i - start of g] * scales[i / 128][c].
__global__ void dequantize_transposed_kernel(const Fp8* t, const float* scales,
                                             const int32_t* group_ends, int64_t rows, int64_t cols,
                                             __nv_bfloat16* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * cols;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / cols, c = i % cols;
    int g = 0;
    while (group_ends[g] <= row) ++g;
    const int64_t start = g ? group_ends[g - 1] : 0, group_rows = group_ends[g] - start;
    const float q = float(t[start * cols + c * group_rows + (row - start)]);
    out[i] = __float2bfloat16(q * scales[row / 128 * cols + c]);
  }
}

// --- DeepGEMM's kernels, launched by hand ------------------------------------------------------

// A TMA map `make` fills (kernels/cuda/tma.h); one that cannot be made ends the program.
template <class Make>
CUtensorMap made(Make&& make) {
  CUtensorMap map;
  const std::string error = make(map);
  if (!error.empty()) {
    std::printf("%s\n", error.c_str());
    std::exit(1);
  }
  return map;
}
template <class... Args>
CUtensorMap tensor_map(Args... args) {
  return made([&](CUtensorMap& map) { return jax_ep::cuda::tensor_map(map, args...); });
}
template <class... Args>
CUtensorMap operand_map(Args... args) {
  return made([&](CUtensorMap& map) { return jax_ep::cuda::operand_map(map, args...); });
}

constexpr uint32_t align_up(uint32_t x, uint32_t to) { return (x + to - 1) / to * to; }
// Whether a BlockN-column FP8 tile that spans two weight-scale blocks splits where the kernel's
// unrolled promotion can follow (DeepGEMM's 1D2D condition).
constexpr bool two_scale_blocks_unroll(uint32_t block_n, uint32_t block_k) {
  return block_n <= block_k || block_n % (block_n - block_k) == 0 ||
         block_k % (block_n - block_k) == 0;
}

// One configuration of one product at jax_ep's (K, N): DeepGEMM's output tile is BlockM x
// BlockN, K in steps of BLOCK_K (64 bf16, 128 e4m3: one scale block); clusters of `Cluster` CTAs
// share the loads of A (SharedA) or of B. Stages and shared memory as DeepGEMM sizes them.
template <GroupedProduct P, uint32_t K, uint32_t N, uint32_t BlockM, uint32_t BlockN,
          uint32_t Cluster, bool SharedA>
struct DeepGemm {
  static constexpr bool kFp8 = P == GroupedProduct::kGmmFp8;
  static constexpr bool kKGrouped = P == GroupedProduct::kTgmm;
  // DeepGEMM's m, n, k (0: known at run time, the rows).
  static constexpr uint32_t kDgM = kKGrouped ? K : 0;
  static constexpr uint32_t kDgN = P == GroupedProduct::kGmmT ? K : N;
  static constexpr uint32_t kDgK = P == GroupedProduct::kGmmT ? N : kKGrouped ? 0 : K;
  static constexpr Major kMajorA = kKGrouped ? Major::MN : Major::K;
  static constexpr Major kMajorB = (P == GroupedProduct::kGmm || kKGrouped) ? Major::MN : Major::K;
  static constexpr uint32_t kElem = kFp8 ? 1 : 2, kBlockK = 128 / kElem;
  static constexpr uint32_t kMathThreads = BlockM <= 64 ? 128 : 256;
  static constexpr uint32_t kSwizzleA = kMajorA == Major::K ? 128 : swizzle_bytes(BlockM * kElem);
  static constexpr uint32_t kSwizzleB = kMajorB == Major::K ? 128 : swizzle_bytes(BlockN * kElem);
  static constexpr uint32_t kSwizzleD = swizzle_bytes(BlockN * 2);
  static constexpr uint32_t kScalesB = kBlockK % BlockN == 0 ? 1 : 2;  // FP8, per K step
  static constexpr uint32_t kPerStage =
      (BlockM + BlockN) * kBlockK * kElem + (kFp8 ? align_up(BlockM * 4, 128) : 0);
  static constexpr uint32_t kFixed = align_up(BlockM * BlockN * 2, 1024) + 16 * 8 * 2 +
                                     (kFp8 ? align_up(K / kBlockK * 4 * kScalesB, 8) : 0);
  static constexpr uint32_t kStages = std::min((kSmemCapacity - kFixed) / kPerStage, 16u);
  static constexpr uint32_t kSmem = kFixed + kStages * kPerStage;
  // DeepGEMM's own conditions on a configuration (enough stages to hide the loads, operand
  // swizzles of 64 bytes or more, FP8 tiles at most 192 wide: wider ones spill registers); it
  // turns multicast off for k-grouped products of more than 4 groups.
  static constexpr bool kValid =
      kStages >= 3 && (BlockM * BlockN >= 128 * 192 || kStages >= 4) && kSwizzleA % 64 == 0 &&
      kSwizzleB % 64 == 0 && !(BlockM > 128 && BlockN > 128) &&
      (!kFp8 || (BlockM == 128 && BlockN <= 192 && two_scale_blocks_unroll(BlockN, kBlockK))) &&
      (kKGrouped ? Cluster == 1 : BlockM == 128) &&
      (Cluster == 1 || (kDgN + BlockN - 1) / BlockN % Cluster == 0);

  static std::string name() {
    return "deepgemm " + std::to_string(BlockM) + "x" + std::to_string(BlockN) + " cluster " +
           std::to_string(Cluster) +
           (Cluster > 1 ? (SharedA ? " (A shared)" : " (B shared)") : "") + ", " +
           std::to_string(kStages) + " stages";
  }

  static Output output(const Operands& o) { return {o.out, o.out_elems, false}; }

  static auto kernel() {
    constexpr GemmType type =
        kKGrouped ? GemmType::KGroupedContiguous : GemmType::MGroupedContiguousWithPsumLayout;
    if constexpr (kFp8)
      return &deep_gemm::sm90_fp8_gemm_1d2d_impl<
          Major::MN, 0, N, K, kGroups, BlockM, BlockN, kBlockK, kSwizzleA, kSwizzleB, kSwizzleD,
          kStages, 128, kMathThreads, Cluster, SharedA, kSms, type, cutlass::bfloat16_t>;
    else
      return &deep_gemm::sm90_bf16_gemm_impl<kMajorA, kMajorB, kDgM, kDgN, kDgK, kGroups, BlockM,
                                             BlockN, kBlockK, kSwizzleA, kSwizzleB, kSwizzleD,
                                             kStages, 128, kMathThreads, Cluster, SharedA, kSms,
                                             type, false, cutlass::bfloat16_t>;
  }

  struct Launch {
    cudaLaunchConfig_t config{};
    cudaLaunchAttribute cluster{};
    CUtensorMap a, b, d, sfa{};
    const Operands* o;
    uint32_t m, n, k;

    explicit Launch(const Operands& operands, cudaStream_t stream) : o(&operands) {
      CHECK(cudaFuncSetAttribute(kernel(), cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
      const auto element = kFp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
      const auto bf16 = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
      const uint64_t rows = o->m;
      m = kKGrouped ? K : rows, n = kDgN, k = kKGrouped ? rows : kDgK;
      if constexpr (kKGrouped) {  // A [rows, K], B [rows, N], D [G, K, N]
        a = operand_map(o->lhs, element, kElem, m, rows, kBlockK, kSwizzleA);
        b = operand_map(o->rhs, element, kElem, n, rows, kBlockK, kSwizzleB);
        d = operand_map(o->out, bf16, 2, n, uint64_t(m) * kGroups, BlockM, kSwizzleD);
      } else {  // A [rows, k], B [G, k, n] or [G, n, k], D [rows, n]
        a = operand_map(o->lhs, element, kElem, k, rows, BlockM, kSwizzleA);
        b = kMajorB == Major::MN
                ? operand_map(o->rhs, element, kElem, n, uint64_t(k) * kGroups, kBlockK, kSwizzleB)
                : operand_map(o->rhs, element, kElem, k, uint64_t(n) * kGroups, BlockN, kSwizzleB);
        d = operand_map(o->out, bf16, 2, n, rows, BlockM, kSwizzleD);
      }
      if constexpr (kFp8) {
        const uint64_t m_padded = align_up(uint32_t(rows), 4);
        sfa = tensor_map(o->lhs_scales_t, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, m_padded, K / kBlockK,
                         m_padded * 4, BlockM, 1, 0);
      }
      config.gridDim = dim3(kSms);
      config.blockDim = dim3(128 + kMathThreads);
      config.dynamicSmemBytes = kSmem;
      config.stream = stream;
      cluster.id = cudaLaunchAttributeClusterDimension;
      cluster.val.clusterDim.x = Cluster;
      cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
      config.numAttrs = Cluster > 1;  // as DeepGEMM launches: no cluster attribute for one CTA
    }
    void operator()() {
      config.attrs = &cluster;  // here, not in the constructor: a copy must point at its own
      int32_t* layout = kKGrouped ? o->group_sizes : o->group_ends;
      if constexpr (kFp8)
        CHECK(cudaLaunchKernelEx(&config, kernel(), o->rhs_scales, layout, m, n, k, a, b, d, sfa));
      else
        CHECK(cudaLaunchKernelEx(&config, kernel(), layout, m, n, k, a, b, d));
    }
  };
};

// DeepGEMM's FP8 weight gradient (sm90_fp8_gemm_1d1d, k-grouped, one warpgroup per 64 rows of
// the tile): out[g] [K, N] += lhs_t[g] [K, rows] rhs_t[g]^T, both operands scaled per 128 rows
// of the sum and per column, the products promoted in float32 every 128 rows. DeepGEMM turns
// multicast off for more than 4 groups and keeps its tiles at most 160 wide.
template <uint32_t K, uint32_t N, uint32_t BlockM, uint32_t BlockN, uint32_t Cluster, bool SharedA>
struct DeepGemmWgradFp8 {
  static constexpr uint32_t kMathThreads = BlockM <= 64 ? 128 : 256;
  static constexpr uint32_t kPerStage =
      (BlockM + BlockN) * 128 + align_up(BlockM * 4, 128) + align_up(BlockN * 4, 128);
  static constexpr uint32_t kFixed = align_up(BlockM * BlockN * 4, 1024) + 16 * 8 * 2 + 4 * 128;
  static constexpr uint32_t kStages = std::min((kSmemCapacity - kFixed) / kPerStage, 16u);
  static constexpr uint32_t kSmem = kFixed + kStages * kPerStage;
  static constexpr bool kValid = Cluster == 1 && !SharedA && (BlockM == 64 || BlockM == 128) &&
                                 BlockN <= 160 && kStages >= 3 &&
                                 (BlockM * BlockN >= 128 * 192 || kStages >= 4);

  static std::string name() {
    return "deepgemm " + std::to_string(BlockM) + "x" + std::to_string(BlockN) + ", " +
           std::to_string(kStages) + " stages";
  }

  static Output output(const Operands& o) { return {o.out_f32, o.out_elems, true}; }

  static auto kernel() {
    return &deep_gemm::sm90_fp8_gemm_1d1d_impl<K, N, 0, kGroups, BlockM, BlockN, 128, 128, 128,
                                               kStages, 128, kMathThreads, 1, false, kSms,
                                               GemmType::KGroupedContiguous, float>;
  }

  struct Launch {
    cudaLaunchConfig_t config{};
    CUtensorMap a, b, sfa, sfb, d;
    const Operands* o;
    cute::TmaDescriptor* maps;  // the kernel's per-SM copies of A's and B's maps

    explicit Launch(const Operands& operands, cudaStream_t stream) : o(&operands) {
      CHECK(cudaFuncSetAttribute(kernel(), cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
      static cute::TmaDescriptor* buffer = [] {
        cute::TmaDescriptor* p;
        CHECK(cudaMalloc(&p, 2 * kSms * sizeof(*p)));
        return p;
      }();
      maps = buffer;
      const uint64_t first = o->first_group_rows, blocks = o->m / 128;
      const auto fp8 = CU_TENSOR_MAP_DATA_TYPE_UINT8, f32 = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
      // The first group's maps: the kernel moves them to each group's rows.
      a = tensor_map(o->lhs_t, fp8, first, K, first, 128, BlockM, 128);
      b = tensor_map(o->rhs_t, fp8, first, N, first, 128, BlockN, 128);
      sfa = tensor_map(o->lhs_t_scales, f32, K, blocks, K * 4, BlockM, 1, 0);
      sfb = tensor_map(o->rhs_t_scales, f32, N, blocks, N * 4, BlockN, 1, 0);
      d = tensor_map(o->out_f32, f32, N, uint64_t(K) * kGroups, N * 4, BlockN, 64, 0);
      config.gridDim = dim3(kSms);
      config.blockDim = dim3(128 + kMathThreads);
      config.dynamicSmemBytes = kSmem;
      config.stream = stream;
    }
    void operator()() {
      CHECK(cudaLaunchKernelEx(&config, kernel(), o->lhs_t, o->rhs_t, o->group_sizes, maps, K, N,
                               uint32_t(o->m), a, b, sfa, sfb, d));
    }
  };
};

// --- timing and comparing ----------------------------------------------------------------------

// Sums over the outputs of (out - reference)^2 and reference^2, in float64.
template <class T>
__global__ void distance_kernel(const T* out, const __nv_bfloat16* reference, int64_t n,
                                double* sums) {
  double diff = 0, norm = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const double x = float(out[i]), r = __bfloat162float(reference[i]);
    diff += (x - r) * (x - r);
    norm += r * r;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    diff += __shfl_down_sync(0xffffffffu, diff, offset);
    norm += __shfl_down_sync(0xffffffffu, norm, offset);
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(sums, diff);
    atomicAdd(sums + 1, norm);
  }
}

// The relative L2 distance of an output from `reference`, on the device.
double relative_distance(const Output& out, const __nv_bfloat16* reference, cudaStream_t stream) {
  static double* sums = [] {
    double* p;
    CHECK(cudaMalloc(&p, 2 * sizeof(double)));
    return p;
  }();
  CHECK(cudaMemsetAsync(sums, 0, 2 * sizeof(double), stream));
  if (out.f32)
    distance_kernel<<<1024, 256, 0, stream>>>(static_cast<const float*>(out.data), reference,
                                              out.elems, sums);
  else
    distance_kernel<<<1024, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(out.data),
                                              reference, out.elems, sums);
  CHECK(cudaGetLastError());
  double host[2];
  CHECK(cudaMemcpyAsync(host, sums, sizeof(host), cudaMemcpyDeviceToHost, stream));
  CHECK(cudaStreamSynchronize(stream));
  return std::sqrt(host[0] / host[1]);
}

// Prints `name: ` before the first call (so that a configuration that fails or hangs is named in
// the output), then the rate and, given a reference, the distance from it.
template <class Call>
void time_and_print(const std::string& name, const Operands& o, const Output& out,
                    cudaStream_t stream, const __nv_bfloat16* reference, Call&& make_call) {
  std::printf("%s: ", name.c_str());
  std::fflush(stdout);
  auto call = make_call();
  CHECK(cudaMemsetAsync(out.data, 0, out.elems * (out.f32 ? 4 : 2), stream));
  call();
  CHECK(cudaStreamSynchronize(stream));
  std::string compared;
  if (reference) {
    char text[64];
    std::snprintf(text, sizeof(text), ", relative L2 distance from jax_ep's %.2e",
                  relative_distance(out, reference, stream));
    compared = text;
  }
  for (int i = 0; i < 3; ++i) call();
  const auto ms = jax_ep::alone::sorted_sample_ms(stream, kSamples, [&] {
    for (int i = 0; i < kCalls; ++i) call();
  });
  const double tflop_ms = 2.0 * o.m * o.k * o.n * kCalls / 1e9;
  std::printf("%.1f TFLOP/s (best %.1f)%s\n", tflop_ms / ms[kSamples / 2], tflop_ms / ms[0],
              compared.c_str());
  std::fflush(stdout);
}

// The DeepGEMM configurations of a run, numbered in order, and those to run (all when empty).
struct Numbering {
  std::vector<int> wanted;
  int next = 0;
};

template <class Config>
void time_deepgemm(const Operands& o, cudaStream_t stream, const __nv_bfloat16* reference,
                   Numbering& numbering) {
  if constexpr (Config::kValid) {
    const int index = numbering.next++;
    const auto& wanted = numbering.wanted;
    if (!wanted.empty() && std::find(wanted.begin(), wanted.end(), index) == wanted.end()) return;
    const std::string name = "deepgemm[" + std::to_string(index) + "] " + Config::name();
    time_and_print(name, o, Config::output(o), stream, reference,
                   [&] { return typename Config::Launch(o, stream); });
  }
}

// The configurations DeepGEMM's heuristics choose among at these shapes (BlockM x BlockN tiles,
// clusters sharing A's or B's loads); those it would rule out are skipped at compile time.
template <uint32_t BlockM, uint32_t BlockN, uint32_t Cluster, bool SharedA>
struct Tile {};
template <class... Tiles>
struct TileList {};
using Configurations =
    TileList<Tile<128, 128, 1, false>, Tile<128, 128, 2, true>, Tile<128, 128, 2, false>,
             Tile<128, 144, 2, true>, Tile<128, 160, 1, false>, Tile<128, 192, 1, false>,
             Tile<128, 192, 2, true>, Tile<128, 192, 2, false>, Tile<128, 256, 1, false>,
             Tile<128, 256, 2, true>, Tile<128, 256, 2, false>, Tile<64, 256, 1, false>,
             Tile<256, 128, 1, false>>;

using WgradConfigurations =
    TileList<Tile<128, 104, 1, false>, Tile<128, 120, 1, false>, Tile<128, 136, 1, false>,
             Tile<128, 152, 1, false>, Tile<64, 120, 1, false>, Tile<64, 152, 1, false>>;

// The configurations of one product at one shape.
template <GroupedProduct P, uint32_t K, uint32_t N>
struct ProductFamily {
  template <uint32_t BlockM, uint32_t BlockN, uint32_t Cluster, bool SharedA>
  using Config = DeepGemm<P, K, N, BlockM, BlockN, Cluster, SharedA>;
  using Tiles = Configurations;
};
template <uint32_t K, uint32_t N>
struct WgradFp8Family {
  template <uint32_t BlockM, uint32_t BlockN, uint32_t Cluster, bool SharedA>
  using Config = DeepGemmWgradFp8<K, N, BlockM, BlockN, Cluster, SharedA>;
  using Tiles = WgradConfigurations;
};

template <class Family, uint32_t BlockM, uint32_t BlockN, uint32_t Cluster, bool SharedA>
void time_tile(Tile<BlockM, BlockN, Cluster, SharedA>, const Operands& o, cudaStream_t stream,
               const __nv_bfloat16* reference, Numbering& numbering) {
  time_deepgemm<typename Family::template Config<BlockM, BlockN, Cluster, SharedA>>(
      o, stream, reference, numbering);
}

template <class Family, class... Tiles>
void time_tiles(TileList<Tiles...>, const Operands& o, cudaStream_t stream,
                const __nv_bfloat16* reference, Numbering& numbering) {
  (time_tile<Family>(Tiles{}, o, stream, reference, numbering), ...);
}

// How many of a family's configurations DeepGEMM runs (the numbers the runs go by).
template <class Family, uint32_t... BlockM, uint32_t... BlockN, uint32_t... Cluster,
          bool... SharedA>
constexpr int valid_configurations(TileList<Tile<BlockM, BlockN, Cluster, SharedA>...>) {
  return (int(Family::template Config<BlockM, BlockN, Cluster, SharedA>::kValid) + ... + 0);
}

// Prints how many configurations the family has, then runs those wanted.
template <class Family>
void time_family(const Operands& o, cudaStream_t stream, const __nv_bfloat16* reference,
                 const std::vector<int>& wanted) {
  std::printf("deepgemm configurations: %d\n",
              valid_configurations<Family>(typename Family::Tiles{}));
  std::fflush(stdout);
  Numbering numbering{wanted, 0};
  time_tiles<Family>(typename Family::Tiles{}, o, stream, reference, numbering);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::printf("usage: %s gmm|gmm_t|tgmm|gmm_fp8|tgmm_fp8 K N uniform|zipf [i,j,...]\n", argv[0]);
    return 2;
  }
  const std::string name = argv[1], distribution = argv[4];
  // The DeepGEMM configurations to run, by number ("3,5,7"); none given: all.
  std::vector<int> wanted;
  std::stringstream list(argc > 5 ? argv[5] : "");
  for (std::string number; std::getline(list, number, ',');) wanted.push_back(std::stoi(number));
  if (distribution != "uniform" && distribution != "zipf") {
    std::printf("groups: uniform or zipf (multiples of 128 rows)\n");
    return 2;
  }
  const bool wgrad_fp8 = name == "tgmm_fp8";  // jax_ep's reference: its bf16 tgmm
  Operands o{};
  o.product = name == "gmm"                 ? GroupedProduct::kGmm
              : name == "gmm_t"             ? GroupedProduct::kGmmT
              : name == "tgmm" || wgrad_fp8 ? GroupedProduct::kTgmm
              : name == "gmm_fp8"           ? GroupedProduct::kGmmFp8
                                            : GroupedProduct(-1);
  if (int(o.product) < 0) {
    std::printf("unknown product %s\n", name.c_str());
    return 2;
  }
  o.m = kRows, o.k = std::atoll(argv[2]), o.n = std::atoll(argv[3]);
  const int64_t k = o.k, n = o.n, blocks = k / 128;
  if (o.product == GroupedProduct::kGmmFp8) {  // values spread over e4m3's range, and scales
    o.lhs = device_random<Fp8>(kRows * k, 1, 448.f);
    o.rhs = device_random<Fp8>(int64_t(kGroups) * n * k, 2, 448.f);
    o.lhs_scales = device_random<float>(kRows * blocks, 3, 0.5f / 448, 1.f / 448);
    o.rhs_scales = device_random<float>(kGroups * blocks * (n / 128), 4, 0.5f / 448, 1.f / 448);
    const int64_t m_padded = align_up(uint32_t(kRows), 4);
    CHECK(cudaMalloc(&o.lhs_scales_t, blocks * m_padded * sizeof(float)));
    transpose_scales_kernel<<<1024, 256>>>(o.lhs_scales, o.lhs_scales_t, kRows, blocks, m_padded);
    CHECK(cudaGetLastError());
  }
  const auto sizes = jax_ep::alone::group_sizes(distribution, kRows, kGroups);
  std::vector<int32_t> ends(kGroups);
  for (uint32_t g = 0, end = 0; g < kGroups; ++g) ends[g] = end += sizes[g];
  CHECK(cudaMalloc(&o.group_sizes, kGroups * sizeof(int32_t)));
  CHECK(cudaMalloc(&o.group_ends, kGroups * sizeof(int32_t)));
  CHECK(cudaMemcpy(o.group_sizes, sizes.data(), kGroups * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(o.group_ends, ends.data(), kGroups * 4, cudaMemcpyHostToDevice));
  o.out_elems = o.product == GroupedProduct::kTgmm
                    ? kGroups * k * n
                    : kRows * (o.product == GroupedProduct::kGmmT ? k : n);
  CHECK(cudaMalloc(&o.out, o.out_elems * sizeof(*o.out)));
  if (wgrad_fp8) {  // e4m3 rows transposed per group, power-of-two scales; jax_ep's bf16 copies
    o.lhs_t = device_random<Fp8>(kRows * k, 1, 448.f);
    o.rhs_t = device_random<Fp8>(kRows * n, 2, 448.f);
    CHECK(cudaMalloc(&o.lhs_t_scales, kRows / 128 * k * sizeof(float)));
    CHECK(cudaMalloc(&o.rhs_t_scales, kRows / 128 * n * sizeof(float)));
    power_of_two_scales_kernel<<<1024, 256>>>(o.lhs_t_scales, kRows / 128 * k, 3);
    power_of_two_scales_kernel<<<1024, 256>>>(o.rhs_t_scales, kRows / 128 * n, 4);
    __nv_bfloat16 *lhs, *rhs;
    CHECK(cudaMalloc(&lhs, kRows * k * sizeof(*lhs)));
    CHECK(cudaMalloc(&rhs, kRows * n * sizeof(*rhs)));
    dequantize_transposed_kernel<<<1024, 256>>>(o.lhs_t, o.lhs_t_scales, o.group_ends, kRows, k,
                                                lhs);
    dequantize_transposed_kernel<<<1024, 256>>>(o.rhs_t, o.rhs_t_scales, o.group_ends, kRows, n,
                                                rhs);
    CHECK(cudaGetLastError());
    o.lhs = lhs, o.rhs = rhs;
    o.first_group_rows = sizes[0];
    CHECK(cudaMalloc(&o.out_f32, o.out_elems * sizeof(float)));
  } else if (o.product != GroupedProduct::kGmmFp8) {  // as grouped_gemm_alone.cu makes them
    const int64_t lhs_cols = o.product == GroupedProduct::kGmmT ? n : k;
    const int64_t rhs_elems = o.product == GroupedProduct::kTgmm ? kRows * n : kGroups * k * n;
    o.lhs = device_random<__nv_bfloat16>(kRows * lhs_cols, 1);
    o.rhs = device_random<__nv_bfloat16>(rhs_elems, 2, 1.f / 64);
  }

  jax_ep::cuda::GroupedGemmArgs a{};
  a.product = o.product;
  a.m = kRows, a.k = k, a.n = n, a.groups = kGroups, a.raster = 0, a.swizzle = 1;
  a.lhs = o.lhs, a.rhs = o.rhs, a.group_sizes = o.group_sizes;
  a.lhs_scales = o.lhs_scales, a.rhs_scales = o.rhs_scales, a.out = o.out;
  void* workspace;
  CHECK(cudaMalloc(&workspace, jax_ep::cuda::grouped_gemm_workspace_bytes(a, 0) + 256));
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));

  std::printf("%s K %lld N %lld, %lld rows in %u %s groups\n", name.c_str(), (long long)k,
              (long long)n, (long long)kRows, kGroups, distribution.c_str());
  const auto jax_ep_call = [&] {
    const std::string error = jax_ep::cuda::grouped_gemm(a, 0, workspace, stream);
    if (!error.empty()) {
      std::printf("%s\n", error.c_str());
      std::exit(1);
    }
  };
  time_and_print("jax_ep (cutlass)", o, {o.out, o.out_elems, false}, stream, nullptr,
                 [&] { return jax_ep_call; });
  __nv_bfloat16* reference;  // jax_ep's output
  CHECK(cudaMalloc(&reference, o.out_elems * sizeof(*reference)));
  CHECK(cudaMemcpy(reference, o.out, o.out_elems * sizeof(*reference), cudaMemcpyDeviceToDevice));

  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (sms != int(kSms)) {
    std::printf("deepgemm: built for %u SMs, the device has %d\n", kSms, sms);
    return 1;
  }
  // Every configuration of the product's family at this shape.
  const auto time_shape = [&](auto k_constant, auto n_constant) {
    constexpr uint32_t K = decltype(k_constant)::value, N = decltype(n_constant)::value;
    if (wgrad_fp8)
      time_family<WgradFp8Family<K, N>>(o, stream, reference, wanted);
    else if (o.product == GroupedProduct::kGmm)
      time_family<ProductFamily<GroupedProduct::kGmm, K, N>>(o, stream, reference, wanted);
    else if (o.product == GroupedProduct::kGmmT)
      time_family<ProductFamily<GroupedProduct::kGmmT, K, N>>(o, stream, reference, wanted);
    else if (o.product == GroupedProduct::kTgmm)
      time_family<ProductFamily<GroupedProduct::kTgmm, K, N>>(o, stream, reference, wanted);
    else
      time_family<ProductFamily<GroupedProduct::kGmmFp8, K, N>>(o, stream, reference, wanted);
  };
  using std::integral_constant;
  if (k == 7168 && n == 2048)
    time_shape(integral_constant<uint32_t, 7168>{}, integral_constant<uint32_t, 2048>{});
  else if (k == 2048 && n == 7168)
    time_shape(integral_constant<uint32_t, 2048>{}, integral_constant<uint32_t, 7168>{});
  else
    std::printf("deepgemm: not built for K %lld N %lld\n", (long long)k, (long long)n);
}
