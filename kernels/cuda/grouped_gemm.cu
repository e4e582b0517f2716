// Grouped matmuls on Hopper with CUTLASS's persistent, warp-specialized grouped kernels (TMA
// loads, two consumer warpgroups, a cluster sharing its tiles' loads). CUTLASS rather than our
// own kernels: it is the library made for this job, its kernels are what torch's grouped GEMMs
// run, and its FP8 kernel applies DeepSeek-style block scales (1 x 128 rows, 128 x 128 weights)
// in the accumulation, which is jax_ep's FP8 format.
//
// The group sizes live on the device: one small setup kernel turns them into each group's
// problem shape and operand pointers (CUTLASS's "ptr-array" arguments) in the call's scratch,
// and CUTLASS's tile scheduler reads them there. No host synchronisation. With deep_gemm,
// DeepGEMM's kernel (deep_gemm.h) runs first, and the setup kernel leaves CUTLASS the groups it
// cannot take.
#include <cub/block/block_scan.cuh>

#include <atomic>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "kernels/cuda/deep_gemm.h"
#include "kernels/cuda/grouped_gemm.h"
#include "kernels/fp8.h"

namespace jax_ep::cuda {
namespace {

using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // per group M, N, K
using Shape3 = ProblemShape::UnderlyingProblemShape;
using Bf16 = cutlass::bfloat16_t;
using E4m3 = cutlass::float_e4m3_t;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

// The scale factors' layouts of a block-scaled kernel (none: int, a placeholder).
template <class ScaleConfig>
struct ScaleLayouts {
  using A = decltype(ScaleConfig::deduce_layoutSFA());
  using B = decltype(ScaleConfig::deduce_layoutSFB());
};
template <>
struct ScaleLayouts<void> {
  using A = int;
  using B = int;
};

// One CUTLASS grouped GEMM: D (bf16, row-major) = A @ B per group, in float32, no C operand.
template <class ElementAB, class LayoutA, class LayoutB, class Tile, class Cluster, class Schedule,
          class EpilogueSchedule, class ScaleConfig = void>
struct GroupedKernel {
  static constexpr bool kBlockScaled = !std::is_void_v<ScaleConfig>;
  static constexpr int kAlignment = 16 / sizeof(ElementAB);  // elements in a TMA's 16 bytes
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RowMajor*, 8, Bf16,
      RowMajor*, 8, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Bf16, float, void, float>>::CollectiveOp;
  using LayoutSFA = typename ScaleLayouts<ScaleConfig>::A;
  using LayoutSFB = typename ScaleLayouts<ScaleConfig>::B;
  using OperandA = std::conditional_t<kBlockScaled, cute::tuple<LayoutA*, LayoutSFA*>, LayoutA*>;
  using OperandB = std::conditional_t<kBlockScaled, cute::tuple<LayoutB*, LayoutSFB*>, LayoutB*>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, OperandA, kAlignment,
      ElementAB, OperandB, kAlignment, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;

  // The per-group arguments, in the call's scratch.
  struct Groups {
    Shape3* shapes;
    const ElementAB** a;
    const ElementAB** b;
    Bf16** d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideD* stride_d;
    const float** sfa;
    const float** sfb;
    LayoutSFA* layout_sfa;
    LayoutSFB* layout_sfb;
    int32_t* rows;      // each group's rows, clamped
    int64_t* offsets;   // each group's first row
    int64_t* total;     // their sum
    float* sfa_packed;  // FP8: A's scales rearranged, each group's [K/128, rows] in turn
  };
};

// bf16: 128 x 256 output tiles over two consumer warpgroups, pairs of CTAs along N sharing
// their A tile's loads. Along N, not M: CUTLASS's group scheduler rounds each group's tiles up
// to whole clusters, and a group of 128 rows (EP1's 256 experts) in a cluster of two along M
// computes one empty tile for each full one; N (here 2048 to 7168, a multiple of 512; K in
// gmm_t) fills the pairs.
using Bf16Tile = Shape<_128, _256, _64>;
using Bf16Cluster = Shape<_1, _2, _1>;
template <class LayoutA, class LayoutB>
using Bf16Kernel = GroupedKernel<Bf16, LayoutA, LayoutB, Bf16Tile, Bf16Cluster,
                                 cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                 cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
// B is [K, N] row-major (gmm: the weights; tgmm: rows of the output's gradient), or [N, K]
// row-major ("column-major" to CUTLASS: gmm_t's weights); tgmm's A is lhs's rows transposed.
using GmmKernel = Bf16Kernel<RowMajor, RowMajor>;
using GmmTKernel = Bf16Kernel<RowMajor, ColumnMajor>;
using TgmmKernel = Bf16Kernel<ColumnMajor, RowMajor>;
// FP8: 128 x 128 tiles, 128 deep (one scale block per step).
using Fp8Scales = cutlass::detail::Sm90BlockwiseScaleConfig<1, kFp8Block, kFp8Block>;
using Fp8Kernel =
    GroupedKernel<E4m3, RowMajor, ColumnMajor, Shape<_128, _128, _128>, Shape<_1, _2, _1>,
                  cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                  cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, Fp8Scales>;

constexpr int kSetupThreads = 1024;

// Each group's rows (clamped so that no group reaches past M), their offsets and sum; then, once
// the sum is known, each group's problem shape and operand pointers: none for a group that
// DeepGEMM's kernel computes (with a.deep_gemm). One block, looping over the groups
// (kMaxGroupedMatmulGroups at most).
template <class K, GroupedProduct P>
__global__ void __launch_bounds__(kSetupThreads)
    setup_kernel(GroupedGemmArgs a, typename K::Groups g, typename K::StrideA stride_a,
                 typename K::StrideB stride_b, typename K::StrideD stride_d,
                 typename K::LayoutSFB layout_sfb) {
  using Scan = cub::BlockScan<int64_t, kSetupThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int64_t total;
  int64_t carry = 0;
  bool misaligned = false;  // a group DeepGEMM's weight gradient cannot take
  for (int base = 0; base < a.groups; base += kSetupThreads) {
    const int e = base + threadIdx.x;
    const int64_t asked = e < a.groups ? max(a.group_sizes[e], 0) : 0;
    int64_t offset, chunk;
    Scan(scan).ExclusiveSum(asked, offset, chunk);
    offset = a.group_stride ? e * a.group_stride : min(offset + carry, a.m);
    carry += chunk;
    __syncthreads();  // the scan's storage is reused by the next chunk
    if (e >= a.groups) continue;
    g.rows[e] = int(min(asked, a.group_stride ? a.group_stride : a.m - offset));
    g.offsets[e] = offset;
    misaligned |= !deep_gemm_takes_k_group(g.rows[e]);
  }
  if (threadIdx.x == 0) *g.total = total = a.group_stride ? a.m : min(carry, a.m);  // no tail
  const bool all_k_groups = !__syncthreads_or(misaligned);  // and `total` seen by every thread

  using Element = std::remove_cv_t<std::remove_pointer_t<std::remove_pointer_t<decltype(g.a)>>>;
  const auto* lhs = static_cast<const Element*>(a.lhs);
  const auto* rhs = static_cast<const Element*>(a.rhs);
  auto* out = static_cast<Bf16*>(a.out);
  const int64_t k = a.k, n = a.n;
  for (int e = threadIdx.x; e < a.groups; e += kSetupThreads) {
    const int64_t offset = g.offsets[e];
    const bool deep_gemm_takes =
        P == GroupedProduct::kTgmm ? all_k_groups : deep_gemm_takes_group(offset, g.rows[e], total);
    const int rows = a.deep_gemm && deep_gemm_takes ? 0 : g.rows[e];
    g.stride_a[e] = stride_a;
    g.stride_b[e] = stride_b;
    g.stride_d[e] = stride_d;
    if constexpr (P == GroupedProduct::kGmm || P == GroupedProduct::kGmmFp8) {
      g.shapes[e] = Shape3{rows, int(n), int(k)};
      g.a[e] = lhs + offset * k;
      g.b[e] = rhs + e * k * n;
      g.d[e] = out + offset * n;
    } else if constexpr (P == GroupedProduct::kGmmT) {  // out [M, K] = lhs [M, N] @ rhs[g]^T
      g.shapes[e] = Shape3{rows, int(k), int(n)};
      g.a[e] = lhs + offset * n;
      g.b[e] = rhs + e * k * n;
      g.d[e] = out + offset * k;
    } else {  // tgmm: out[g] [K, N] = lhs rows^T @ rhs rows; an empty group has no tiles
      g.shapes[e] = Shape3{rows ? int(k) : 0, int(n), rows};
      g.a[e] = lhs + offset * k;
      g.b[e] = rhs + offset * n;
      g.d[e] = out + e * k * n;
    }
    if constexpr (P == GroupedProduct::kGmmFp8) {
      // The kernel reads each group's scales packed (its own layout from the group's shape;
      // the layouts passed are not read): pack_scales_kernel rearranges A's.
      g.sfa[e] = g.sfa_packed + offset * (k / kFp8Block);
      g.layout_sfa[e] = Fp8Scales::tile_atom_to_shape_SFA(make_shape(rows, int(n), int(k), 1));
      g.sfb[e] = a.rhs_scales + e * (k / kFp8Block) * (n / kFp8Block);
      g.layout_sfb[e] = layout_sfb;
    }
  }
}

// FP8: A's scales [M, K/128] as the kernel reads them, group by group [K/128, rows of g] (the
// groups CUTLASS computes).
__global__ void pack_scales_kernel(GroupedGemmArgs a, const Shape3* shapes, const int64_t* offsets,
                                   float* packed) {
  const int e = blockIdx.y, blocks = int(a.k / kFp8Block), n = get<0>(shapes[e]);
  const float* src = a.lhs_scales + offsets[e] * blocks;
  float* dst = packed + offsets[e] * blocks;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n * blocks; i += gridDim.x * blockDim.x)
    dst[i] = src[int64_t(i % n) * blocks + i / n];  // dst [block][row]
}

// The rows the GEMM does not write: gmm / gmm_t's rows past the groups, tgmm's empty groups.
__global__ void zero_unwritten_kernel(GroupedGemmArgs a, const int32_t* rows,
                                      const int64_t* total) {
  const bool per_group = a.product == GroupedProduct::kTgmm;
  const int64_t width = a.product == GroupedProduct::kGmmT ? a.k : a.n;
  int64_t begin, end;  // in 16-byte words of out
  if (per_group) {
    if (rows[blockIdx.y] != 0) return;
    begin = blockIdx.y * a.k * a.n / 8;
    end = begin + a.k * a.n / 8;
  } else {
    begin = *total * width / 8;
    end = a.m * width / 8;
  }
  auto* out = static_cast<uint4*>(a.out);
  for (int64_t i = begin + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < end;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = make_uint4(0, 0, 0, 0);
}

// A device's SM count and whether it is compute capability 9.0 (the kernels are built for
// sm_90a only), asked once per device: XLA calls each device's handler on its own thread.
struct DeviceInfo {
  int sms;
  bool sm90;
};
DeviceInfo device_info(int device) {
  static std::atomic<int> known[64];  // 0: not asked yet, else SMs * 2 + sm90
  if (device < 0 || device >= 64) return {0, false};
  int info = known[device].load(std::memory_order_relaxed);
  if (!info) {
    int sms = 0, major = 0, minor = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    info = sms * 2 + (major == 9 && minor == 0);
    known[device].store(info, std::memory_order_relaxed);
  }
  return {info / 2, info % 2 == 1};
}

// The scratch of one call: the per-group arrays, DeepGEMM's, then CUTLASS's workspace.
template <class K>
struct Scratch {
  typename K::Groups groups;
  void* deep_gemm_scratch;
  void* cutlass_workspace;
  size_t bytes;

  Scratch(void* base, const GroupedGemmArgs& a) {
    const int n = a.groups;
    size_t at = 0;
    auto* bytes_base = static_cast<uint8_t*>(base);
    auto take = [&](auto*& p, size_t count) {
      at = (at + 255) / 256 * 256;
      p = reinterpret_cast<std::remove_reference_t<decltype(p)>>(bytes_base + at);
      at += count * sizeof(*p);
    };
    auto per_group = [&](auto*&... arrays) { (take(arrays, n), ...); };
    auto& g = groups;
    per_group(g.shapes, g.a, g.b, g.d, g.stride_a, g.stride_b, g.stride_d, g.sfa, g.sfb,
              g.layout_sfa, g.layout_sfb, g.rows, g.offsets);
    take(g.total, 1);
    take(g.sfa_packed, K::kBlockScaled ? a.m * (a.k / kFp8Block) : 0);
    uint8_t* deep_gemm_bytes;
    take(deep_gemm_bytes, a.deep_gemm ? deep_gemm_scratch_bytes(a) : 0);
    deep_gemm_scratch = deep_gemm_bytes;
    at = (at + 255) / 256 * 256;
    cutlass_workspace = bytes_base + at;
    bytes = at;
  }
};

template <class K>
typename K::Gemm::Arguments arguments(const GroupedGemmArgs& a, int device,
                                      const typename K::Groups& g) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = device_info(device).sms;
  typename K::Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {a.groups, g.shapes, nullptr};  // the shapes are on the device only
  if constexpr (K::kBlockScaled)
    args.mainloop = {g.a, g.stride_a, g.b, g.stride_b, g.sfa, g.layout_sfa, g.sfb, g.layout_sfb};
  else
    args.mainloop = {g.a, g.stride_a, g.b, g.stride_b};
  args.epilogue = {{}, nullptr, nullptr, g.d, g.stride_d};
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  args.hw_info = hw;
  using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
  args.scheduler.raster_order = a.raster ? Raster::AlongN : Raster::AlongM;
  args.scheduler.max_swizzle_size = a.swizzle;
  return args;
}

template <class K>
size_t workspace_bytes(const GroupedGemmArgs& a, int device) {
  Scratch<K> s(nullptr, a);
  return s.bytes + K::Gemm::get_workspace_size(arguments<K>(a, device, s.groups));
}

std::string cuda_error(const char* what) {
  return std::string("grouped matmul: ") + what + ": " + cudaGetErrorString(cudaGetLastError());
}

template <class K, GroupedProduct P>
std::string run(const GroupedGemmArgs& a, int device, void* workspace, cudaStream_t stream) {
  Scratch<K> s(workspace, a);
  // The strides of every group's operands: packed, as the operands are row-major blocks.
  const int64_t m_a = P == GroupedProduct::kTgmm ? a.k : 1,
                k_a = P == GroupedProduct::kGmmT ? a.n : a.k;
  const int64_t n_b = P == GroupedProduct::kGmmT ? a.k : a.n;
  const int64_t k_b = P == GroupedProduct::kGmmT ? a.n : a.k;
  const int64_t n_d = P == GroupedProduct::kGmmT ? a.k : a.n;
  const auto stride_a =
      cutlass::make_cute_packed_stride(typename K::StrideA{}, {int(m_a), int(k_a), 1});
  const auto stride_b =
      cutlass::make_cute_packed_stride(typename K::StrideB{}, {int(n_b), int(k_b), 1});
  const auto stride_d = cutlass::make_cute_packed_stride(typename K::StrideD{}, {1, int(n_d), 1});
  typename K::LayoutSFB layout_sfb{};
  if constexpr (K::kBlockScaled)
    layout_sfb = Fp8Scales::tile_atom_to_shape_SFB(make_shape(1, int(a.n), int(a.k), 1));
  setup_kernel<K, P>
      <<<1, kSetupThreads, 0, stream>>>(a, s.groups, stride_a, stride_b, stride_d, layout_sfb);
  if (cudaPeekAtLastError() != cudaSuccess) return cuda_error("setup");
  if (a.deep_gemm) {  // first: CUTLASS's kernel and the zeroing overwrite what its tiles wrote
    const std::string error =
        deep_gemm(a, s.groups.rows, s.groups.offsets, s.deep_gemm_scratch, stream);
    if (!error.empty()) return "grouped matmul: " + error;
  }
  if constexpr (K::kBlockScaled) {
    pack_scales_kernel<<<dim3(4, a.groups), 256, 0, stream>>>(a, s.groups.shapes, s.groups.offsets,
                                                              s.groups.sfa_packed);
    if (cudaPeekAtLastError() != cudaSuccess) return cuda_error("scales");
  }

  const int threads = 256, sms = device_info(device).sms;
  dim3 zero_grid(P == GroupedProduct::kTgmm ? 8 : 2 * sms,
                 P == GroupedProduct::kTgmm ? a.groups : 1);
  zero_unwritten_kernel<<<zero_grid, threads, 0, stream>>>(a, s.groups.rows, s.groups.total);
  if (cudaPeekAtLastError() != cudaSuccess) return cuda_error("zeroing");

  typename K::Gemm gemm;
  auto args = arguments<K>(a, device, s.groups);
  if (gemm.initialize(args, s.cutlass_workspace, stream) != cutlass::Status::kSuccess)
    return cuda_error("CUTLASS initialize");
  if (gemm.run(stream) != cutlass::Status::kSuccess) return cuda_error("CUTLASS run");
  return "";
}

}  // namespace

bool grouped_gemm_available(int device) { return device_info(device).sm90; }

int grouped_gemm_sms(int device) { return device_info(device).sms; }

size_t grouped_gemm_workspace_bytes(const GroupedGemmArgs& a, int device) {
  switch (a.product) {
    case GroupedProduct::kGmm:
      return workspace_bytes<GmmKernel>(a, device);
    case GroupedProduct::kGmmT:
      return workspace_bytes<GmmTKernel>(a, device);
    case GroupedProduct::kTgmm:
      return workspace_bytes<TgmmKernel>(a, device);
    case GroupedProduct::kGmmFp8:
      return workspace_bytes<Fp8Kernel>(a, device);
  }
  return 0;
}

std::string grouped_gemm(const GroupedGemmArgs& a, int device, void* workspace,
                         cudaStream_t stream) {
  switch (a.product) {
    case GroupedProduct::kGmm:
      return run<GmmKernel, GroupedProduct::kGmm>(a, device, workspace, stream);
    case GroupedProduct::kGmmT:
      return run<GmmTKernel, GroupedProduct::kGmmT>(a, device, workspace, stream);
    case GroupedProduct::kTgmm:
      return run<TgmmKernel, GroupedProduct::kTgmm>(a, device, workspace, stream);
    case GroupedProduct::kGmmFp8:
      return run<Fp8Kernel, GroupedProduct::kGmmFp8>(a, device, workspace, stream);
  }
  return "grouped matmul: unknown product";
}

}  // namespace jax_ep::cuda
