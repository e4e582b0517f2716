// CUDA handlers: XLA calls each device's handler on its own host thread; the handler only
// enqueues kernels on the stream XLA gives it (no host synchronisation, no per-op host state),
// so the calls can be captured in command buffers (CUDA graphs) and replayed.
#include <atomic>

#include "ffi/backends.h"
#include "ffi/calls.h"
#include "kernels/cuda/rank.h"

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

  static std::string place_rows(const Context& c, const PlaceRowsArgs& a) {
    return cuda::place_rows(c.stream, a);
  }
};

}  // namespace

Targets cuda_targets() { return targets<CudaBackend>(); }
XLA_FFI_TypeId* cuda_state_type_id() { return &CudaState::id; }
const XLA_FFI_TypeInfo* cuda_state_type_info() { return state_type_info<CudaState>(); }

int64_t cuda_handler_calls() { return handler_calls.load(); }

}  // namespace jax_ep
