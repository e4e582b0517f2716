// CUDA handlers: XLA calls each device's handler on its own host thread; the handler only
// enqueues kernels on the stream XLA gives it (no host synchronisation, no per-op host state),
// so the calls can be captured in command buffers (CUDA graphs) and replayed.
#include <atomic>

#include "ffi/backends.h"
#include "ffi/calls.h"
#include "kernels/cuda/rank.h"
#ifdef JAX_EP_WITH_GROUPED_GEMM
#include "kernels/cuda/deep_gemm.h"
#include "kernels/cuda/grouped_gemm.h"
#include "kernels/fp8.h"
#include "kernels/limits.h"
#endif

namespace jax_ep {

struct CudaContext {
  int32_t device;
  cudaStream_t stream;
};

}  // namespace jax_ep

// Decoded once per call, and a handler parameter XLA binds by its type.
namespace xla::ffi {
template <>
struct CtxBinding<jax_ep::CudaContext> {
  using Ctx = jax_ep::CudaContext;
};
template <>
struct CtxDecoding<jax_ep::CudaContext> {
  using Type = jax_ep::CudaContext;
  static std::optional<Type> Decode(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx,
                                    DiagnosticEngine& diagnostic) {
    auto device = CtxDecoding<DeviceOrdinal>::Decode(api, ctx, diagnostic);
    auto stream = CtxDecoding<PlatformStream<cudaStream_t>>::Decode(api, ctx, diagnostic);
    if (!device || !stream) return std::nullopt;
    return Type{*device, *stream};
  }
};
}  // namespace xla::ffi

namespace jax_ep {
namespace {

using CudaState = CallState<cuda::Rank>;

// Handler runs in this process: a command buffer (CUDA graph) replays kernels without them.
std::atomic<int64_t> handler_calls{0};

struct CudaBackend {
  using Context = CudaContext;
  using Rank = cuda::Rank;
  using State = CudaState;
  using Result = ffi::Error;  // the kernels are enqueued: the handler is done
  // The handlers only enqueue kernels: XLA may capture them in command buffers.
  static constexpr std::initializer_list<ffi::Traits> traits = {ffi::Traits::kCmdBufferCompatible};

  static ffi::Error error(ffi::Error error) { return error; }

  static ffi::Error dispatch(const Context& c, State& st, Rank& rank, Part part,
                             const DispatchSend* send, const DispatchRecv* recv, Tokens tokens) {
    handler_calls.fetch_add(1, std::memory_order_relaxed);
    return to_error(cuda::dispatch(rank, c.stream, part, send, recv, st.config.low_latency,
                                   tokens.ticket, tokens.out));
  }

  static ffi::Error combine(const Context& c, State&, Rank& rank, Part part,
                            const CombineSend* send, const CombineRecv* recv, Tokens tokens) {
    handler_calls.fetch_add(1, std::memory_order_relaxed);
    return to_error(cuda::combine(rank, c.stream, part, send, recv, tokens.ticket, tokens.out));
  }

  static std::string expert_layout(const Context& c, const ExpertLayoutArgs& a) {
    return cuda::expert_layout(c.stream, a);
  }

  static std::string expert_padded(const Context& c, const ExpertPaddedArgs& a) {
    return cuda::expert_padded(c.stream, a);
  }

  static std::string place_rows(const Context& c, const PlaceRowsArgs& a) {
    return cuda::place_rows(c.stream, a);
  }

  static std::string quantize_rows(const Context& c, const QuantizeRowsArgs& a) {
    return cuda::quantize_rows(c.stream, a);
  }

  static std::string quantize_weights(const Context& c, const QuantizeWeightsArgs& a) {
    return cuda::quantize_weights(c.stream, a);
  }
};

#ifdef JAX_EP_WITH_GROUPED_GEMM
// ---- grouped matmuls (jax_ep/nn/grouped.py; no Buffer): operands checked, scratch taken from
// XLA, kernels enqueued. Not in command buffers: the scratch is XLA's per-call allocation.

ffi::Error run_grouped_gemm(const CudaContext& c, ffi::ScratchAllocator& scratch,
                            cuda::GroupedGemmArgs& a, int32_t raster, int32_t swizzle,
                            bool deep_gemm) {
  if ((raster != 0 && raster != 1) ||
      (swizzle != 1 && swizzle != 2 && swizzle != 4 && swizzle != 8))
    return invalid("grouped matmul: raster must be 0 or 1 and swizzle 1, 2, 4 or 8");
  a.raster = raster;
  a.swizzle = swizzle;
  if (a.groups < 1 || a.groups > kMaxGroupedMatmulGroups)
    return invalid("grouped matmul: 1 to " + std::to_string(kMaxGroupedMatmulGroups) +
                   " groups, got " + std::to_string(a.groups));
  if (!cuda::grouped_gemm_available(c.device))
    return invalid("grouped matmul: the CUTLASS kernels run on compute capability 9.0 only");
  if (deep_gemm) {
    const std::string misfit = cuda::deep_gemm_misfit(a, c.device);
    if (!misfit.empty()) return invalid("grouped matmul: " + misfit);
  }
  a.deep_gemm = deep_gemm;
  // XLA aligns scratch to at most 16 bytes: the kernels' arrays want 256.
  constexpr size_t kAlign = 256;
  auto workspace = scratch.Allocate(cuda::grouped_gemm_workspace_bytes(a, c.device) + kAlign);
  if (!workspace) return invalid("grouped matmul: XLA gave no scratch memory");
  const auto aligned = (reinterpret_cast<uintptr_t>(*workspace) + kAlign - 1) / kAlign * kAlign;
  return to_error(cuda::grouped_gemm(a, c.device, reinterpret_cast<void*>(aligned), c.stream));
}

// lhs [M, *], rhs [G, *, *] or [M, *], out: bfloat16; the product decides the rest.
ffi::Error grouped_gemm(CudaContext c, ffi::ScratchAllocator scratch, ffi::AnyBuffer lhs,
                        ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32, 1> group_sizes,
                        ffi::Result<ffi::AnyBuffer> out, int32_t product, int64_t group_stride,
                        int32_t raster, int32_t swizzle, bool deep_gemm) {
  const auto l = lhs.dimensions(), r = rhs.dimensions(), o = out->dimensions();
  if (lhs.element_type() != ffi::DataType::BF16 || rhs.element_type() != ffi::DataType::BF16 ||
      out->element_type() != ffi::DataType::BF16)
    return invalid("grouped matmul: the operands must be bfloat16");
  if (l.size() != 2) return invalid("grouped matmul: lhs must be [M, *]");
  cuda::GroupedGemmArgs a{};
  a.product = cuda::GroupedProduct(product);
  a.groups = int32_t(group_sizes.dimensions()[0]);
  a.m = l[0];
  bool fits = false;
  switch (a.product) {
    case cuda::GroupedProduct::kGmm:  // [M, K] x [G, K, N] -> [M, N]
      a.k = l[1], a.n = r.size() == 3 ? r[2] : 0;
      fits = r.size() == 3 && r[0] == a.groups && r[1] == a.k && o.size() == 2 && o[0] == a.m &&
             o[1] == a.n;
      break;
    case cuda::GroupedProduct::kGmmT:  // [M, N] x [G, K, N] -> [M, K]
      a.n = l[1], a.k = r.size() == 3 ? r[1] : 0;
      fits = r.size() == 3 && r[0] == a.groups && r[2] == a.n && o.size() == 2 && o[0] == a.m &&
             o[1] == a.k;
      break;
    case cuda::GroupedProduct::kTgmm:  // [M, K] x [M, N] -> [G, K, N]
      a.k = l[1], a.n = r.size() == 2 ? r[1] : 0;
      fits = r.size() == 2 && r[0] == a.m && o.size() == 3 && o[0] == a.groups && o[1] == a.k &&
             o[2] == a.n;
      break;
    default:
      return invalid("grouped matmul: unknown product " + std::to_string(product));
  }
  if (!fits) return invalid("grouped matmul: the operands' shapes do not fit the product");
  if (a.k % kGroupedMatmulAlignment || a.n % kGroupedMatmulAlignment || a.k <= 0 || a.n <= 0)
    return invalid("grouped matmul: K and N must be positive multiples of " +
                   std::to_string(kGroupedMatmulAlignment));
  if (group_stride < 0 ||
      (group_stride && (a.product != cuda::GroupedProduct::kGmm || group_stride * a.groups != a.m)))
    return invalid("grouped matmul: group_stride needs gmm over G x group_stride rows");
  a.group_stride = group_stride;
  a.lhs = lhs.untyped_data();
  a.rhs = rhs.untyped_data();
  a.group_sizes = group_sizes.typed_data();
  a.out = out->untyped_data();
  return run_grouped_gemm(c, scratch, a, raster, swizzle, deep_gemm);
}

// lhs_q [M, K] e4m3 with scales [M, K/128], rhs_q [G, N, K] e4m3 with scales [G, K/128, N/128]
// (float32; the weights' with their N block fastest, as the kernel reads them) -> out [M, N]
// bfloat16.
ffi::Error grouped_gemm_fp8(CudaContext c, ffi::ScratchAllocator scratch, ffi::AnyBuffer lhs,
                            ffi::Buffer<ffi::F32, 2> lhs_scales, ffi::AnyBuffer rhs,
                            ffi::Buffer<ffi::F32, 3> rhs_scales,
                            ffi::Buffer<ffi::S32, 1> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                            int32_t raster, int32_t swizzle, bool deep_gemm) {
  const auto l = lhs.dimensions(), r = rhs.dimensions(), o = out->dimensions();
  const auto ls = lhs_scales.dimensions(), rs = rhs_scales.dimensions();
  if (lhs.element_type() != ffi::DataType::F8E4M3FN ||
      rhs.element_type() != ffi::DataType::F8E4M3FN || out->element_type() != ffi::DataType::BF16)
    return invalid("grouped FP8 matmul: the operands must be e4m3fn and the output bfloat16");
  if (l.size() != 2 || r.size() != 3 || o.size() != 2)
    return invalid("grouped FP8 matmul: lhs must be [M, K], rhs [G, N, K], out [M, N]");
  cuda::GroupedGemmArgs a{};
  a.product = cuda::GroupedProduct::kGmmFp8;
  a.groups = int32_t(group_sizes.dimensions()[0]);
  a.m = l[0], a.k = l[1], a.n = r[1];
  constexpr int64_t b = kFp8Block;
  if (r[0] != a.groups || r[2] != a.k || o[0] != a.m || o[1] != a.n || a.k % b || a.n % b ||
      a.k <= 0 || a.n <= 0 || ls[0] != a.m || ls[1] != a.k / b || rs[0] != a.groups ||
      rs[1] != a.k / b || rs[2] != a.n / b)
    return invalid(
        "grouped FP8 matmul: the operands' shapes do not fit (K and N multiples of 128)");
  a.lhs = lhs.untyped_data();
  a.rhs = rhs.untyped_data();
  a.lhs_scales = lhs_scales.typed_data();
  a.rhs_scales = rhs_scales.typed_data();
  a.group_sizes = group_sizes.typed_data();
  a.out = out->untyped_data();
  return run_grouped_gemm(c, scratch, a, raster, swizzle, deep_gemm);
}

auto bind_grouped_gemm() {
  return ffi::Ffi::Bind()
      .Ctx<CudaContext>()
      .Ctx<ffi::ScratchAllocator>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32, 1>>()
      .Ret<ffi::AnyBuffer>()
      .Attr<int32_t>("product")
      .Attr<int64_t>("group_stride")
      .Attr<int32_t>("raster")
      .Attr<int32_t>("swizzle")
      .Attr<bool>("deep_gemm")
      .To(grouped_gemm);
}

auto bind_grouped_gemm_fp8() {
  return ffi::Ffi::Bind()
      .Ctx<CudaContext>()
      .Ctx<ffi::ScratchAllocator>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F32, 2>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F32, 3>>()
      .Arg<ffi::Buffer<ffi::S32, 1>>()
      .Ret<ffi::AnyBuffer>()
      .Attr<int32_t>("raster")
      .Attr<int32_t>("swizzle")
      .Attr<bool>("deep_gemm")
      .To(grouped_gemm_fp8);
}
#endif

}  // namespace

Targets cuda_targets() {
  Targets t = targets<CudaBackend>();
#ifdef JAX_EP_WITH_GROUPED_GEMM
  t["grouped_gemm"] = {nullptr, handler<bind_grouped_gemm>};
  t["grouped_gemm_fp8"] = {nullptr, handler<bind_grouped_gemm_fp8>};
#endif
  return t;
}
XLA_FFI_TypeId* cuda_state_type_id() { return &CudaState::id; }
const XLA_FFI_TypeInfo* cuda_state_type_info() { return state_type_info<CudaState>(); }

int64_t cuda_handler_calls() { return handler_calls.load(); }

}  // namespace jax_ep
