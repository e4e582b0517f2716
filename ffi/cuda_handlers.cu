// CUDA handlers: XLA calls each device's handler on its own host thread; the handler only
// enqueues kernels on the stream XLA gives it (no host synchronisation), so the handlers can be
// captured in command buffers (CUDA graphs).
#include "ffi/handlers.h"
#include "ffi/targets.h"
#include "kernels/cuda/backend.h"

namespace jax_ep {

struct CudaContext {
  int32_t device;
  cudaStream_t stream;
};

}  // namespace jax_ep

namespace xla::ffi {
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

cuda::Comm& comm_of(BufferState& state) { return *static_cast<cuda::Comm*>(state.cuda.get()); }

struct CudaBackend {
  using Context = CudaContext;
  using Result = ffi::Error;  // kernels are enqueued: the handler is done
  static ffi::Error error(ffi::Error error) { return error; }
  static ffi::Error dispatch(const Context& c, BufferState& s, Place, const DispatchArgs& a) {
    return to_error(cuda::dispatch(comm_of(s), c.device, c.stream, a));
  }
  static ffi::Error combine(const Context& c, BufferState& s, Place, const CombineArgs& a) {
    return to_error(cuda::combine(comm_of(s), c.device, c.stream, a));
  }
  static std::string expert_layout(const Context& c, const ExpertLayoutArgs& a) {
    return cuda::expert_layout(c.stream, a);
  }
};

constexpr auto kGraphSafe = ffi::Traits::kCmdBufferCompatible;

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_ep_cuda_dispatch, Dispatch<CudaBackend>,
                              dispatch_binding<CudaBackend>(), {kGraphSafe});
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_ep_cuda_dispatch_cached, DispatchCached<CudaBackend>,
                              dispatch_cached_binding<CudaBackend>(), {kGraphSafe});
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_ep_cuda_combine, Combine<CudaBackend>,
                              combine_binding<CudaBackend>(), {kGraphSafe});
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_ep_cuda_expert_layout, ExpertLayout<CudaBackend>,
                              expert_layout_binding<CudaBackend>(), {kGraphSafe});

Targets cuda_targets() {
  return {{"dispatch", jax_ep_cuda_dispatch},
          {"dispatch_cached", jax_ep_cuda_dispatch_cached},
          {"combine", jax_ep_cuda_combine},
          {"expert_layout", jax_ep_cuda_expert_layout}};
}

std::shared_ptr<void> cuda_connect(const std::vector<std::vector<int>>& groups,
                                   int experts_per_rank, int num_sms, double timeout_s) {
  return cuda::connect(groups, experts_per_rank, cuda::Knobs{num_sms, timeout_s});
}

double cuda_peer_gbps(int src, int dst, int64_t bytes, int blocks, int mode, int iters,
                      bool both_ways) {
  return cuda::peer_gbps(src, dst, bytes, blocks, mode, iters, both_ways);
}

}  // namespace jax_ep
