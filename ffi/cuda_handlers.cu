// CUDA handlers: XLA calls each device's handler on its own host thread; the handler only
// enqueues kernels on the stream XLA gives it (no host synchronisation), so the handlers can be
// captured in command buffers (CUDA graphs).
#include <atomic>

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

// Handler runs in this process: a command buffer (CUDA graph) replays kernels without them.
std::atomic<int64_t> handler_calls{0};

cuda::Comm& counted(BufferState& state) {
  handler_calls.fetch_add(1, std::memory_order_relaxed);
  return comm_of(state);
}

struct CudaBackend {
  using Context = CudaContext;
  using Result = ffi::Error;  // kernels are enqueued: the handler is done
  static ffi::Error error(ffi::Error error) { return error; }
  static ffi::Error dispatch(const Context& c, BufferState& s, Place, const DispatchArgs& a) {
    return to_error(cuda::dispatch(counted(s), c.device, c.stream, a));
  }
  static ffi::Error combine(const Context& c, BufferState& s, Place, const CombineArgs& a) {
    return to_error(cuda::combine(counted(s), c.device, c.stream, a));
  }
  static std::string expert_layout(const Context& c, const ExpertLayoutArgs& a) {
    return cuda::expert_layout(c.stream, a);
  }
};

constexpr auto kGraphSafe = ffi::Traits::kCmdBufferCompatible;

// A known half, with the one-element ticket it reads (recv) or writes (send).
bool valid_half(int32_t half, ffi::Buffer<ffi::S32, 1> ticket_in,
                ffi::ResultBuffer<ffi::S32, 1> ticket_out) {
  return half >= cuda::kSend && half <= cuda::kBoth &&
         (half != cuda::kRecv || ticket_in.element_count() == 1) &&
         (half != cuda::kSend || ticket_out->element_count() == 1);
}

// The low-latency dispatch, whole or one half (attribute `half`): one signature for all; the
// outputs a half does not produce, and the inputs it does not read, are empty arrays.
ffi::Error LowLatencyDispatch(
    CudaContext ctx, ffi::AnyBuffer x, ffi::Buffer<ffi::S32, 2> topk_idx,
    ffi::Buffer<ffi::F32, 2> topk_weights, ffi::Buffer<ffi::S32, 2> send_pos_in,
    ffi::Buffer<ffi::S32, 1> recv_counts_in, ffi::Buffer<ffi::S32, 1> ticket_in,
    ffi::ResultBuffer<ffi::S32, 1> ticket_out, ffi::ResultBuffer<ffi::S32, 2> send_pos,
    ffi::ResultBuffer<ffi::S32, 0> num_invalid, ffi::Result<ffi::AnyBuffer> x_out,
    ffi::Result<ffi::AnyBuffer> scales_out, ffi::ResultBuffer<ffi::S32, 2> topk_out,
    ffi::ResultBuffer<ffi::F32, 2> weights_out, ffi::ResultBuffer<ffi::S32, 1> recv_counts,
    ffi::ResultBuffer<ffi::S32, 1> tokens_per_expert, ffi::ResultBuffer<ffi::S32, 0> num_recv,
    ffi::ResultBuffer<ffi::S32, 0> num_dropped, int64_t buffer_id, int32_t half, bool cached,
    int32_t out_rows, bool fp8, bool round_scale) {
  std::shared_ptr<BufferState> state;
  Place place;
  if (auto err = with_place<CudaBackend>(ctx, buffer_id, &state, &place); err.failure()) return err;
  cuda::LowLatencyDispatchArgs d{};
  DispatchArgs& a = d.a;
  if (auto err = dispatch_common(*state, place, x, 0, out_rows, fp8, round_scale, &a); err.failure())
    return err;
  if (!valid_half(half, ticket_in, ticket_out))
    return invalid("low-latency dispatch: bad half or ticket");
  a.cached = cached;
  a.num_topk = int(topk_idx.dimensions()[1]);
  a.topk_idx = topk_idx.typed_data();
  a.topk_weights = topk_weights.typed_data();
  a.send_pos = cached ? const_cast<int32_t*>(send_pos_in.typed_data()) : send_pos->typed_data();
  dispatch_outputs(x_out, scales_out, topk_out, weights_out, recv_counts, tokens_per_expert,
                   num_recv, num_dropped, num_invalid, &a);
  d.recv_counts_in = recv_counts_in.typed_data();
  d.ticket_in = ticket_in.typed_data();
  d.ticket_out = half == cuda::kSend ? ticket_out->typed_data() : nullptr;
  d.half = half;
  return to_error(cuda::low_latency_dispatch(counted(*state), ctx.device, ctx.stream, d));
}

// The low-latency combine, whole or one half, like LowLatencyDispatch.
ffi::Error LowLatencyCombine(CudaContext ctx, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32, 2> send_pos,
                             ffi::Buffer<ffi::S32, 1> recv_counts, ffi::Buffer<ffi::S32, 0> num_rows,
                             ffi::AnyBuffer bias, ffi::Buffer<ffi::S32, 1> ticket_in,
                             ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::S32, 1> ticket_out,
                             int64_t buffer_id, int32_t half, bool has_bias) {
  std::shared_ptr<BufferState> state;
  Place place;
  if (auto err = with_place<CudaBackend>(ctx, buffer_id, &state, &place); err.failure()) return err;
  if (!valid_half(half, ticket_in, ticket_out))
    return invalid("low-latency combine: bad half or ticket");
  cuda::LowLatencyCombineArgs c{};
  if (auto err = combine_common(*state, place, rows, send_pos, bias, *out, has_bias, &c.a);
      err.failure())
    return err;
  if (recv_counts.element_count() != c.a.num_ranks)
    return invalid("combine: the handle does not match");
  c.recv_counts = recv_counts.typed_data();
  c.num_rows = num_rows.typed_data();
  c.ticket_in = ticket_in.typed_data();
  c.ticket_out = half == cuda::kSend ? ticket_out->typed_data() : nullptr;
  c.half = half;
  return to_error(cuda::low_latency_combine(counted(*state), ctx.device, ctx.stream, c));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_ep_cuda_dispatch, Dispatch<CudaBackend>,
                              dispatch_binding<CudaBackend>(), {kGraphSafe});
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_ep_cuda_dispatch_cached, DispatchCached<CudaBackend>,
                              dispatch_cached_binding<CudaBackend>(), {kGraphSafe});
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_ep_cuda_combine, Combine<CudaBackend>,
                              combine_binding<CudaBackend>(), {kGraphSafe});
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_ep_cuda_expert_layout, ExpertLayout<CudaBackend>,
                              expert_layout_binding<CudaBackend>(), {kGraphSafe});

namespace {
auto ll_dispatch_binding() {
  return ffi::Ffi::Bind()
    .Ctx<CudaContext>()
    .Arg<ffi::AnyBuffer>()
    .Arg<ffi::Buffer<ffi::S32, 2>>()
    .Arg<ffi::Buffer<ffi::F32, 2>>()
    .Arg<ffi::Buffer<ffi::S32, 2>>()
    .Arg<ffi::Buffer<ffi::S32, 1>>()
    .Arg<ffi::Buffer<ffi::S32, 1>>()
    .Ret<ffi::Buffer<ffi::S32, 1>>()
    .Ret<ffi::Buffer<ffi::S32, 2>>()
    .Ret<ffi::Buffer<ffi::S32, 0>>()
    .Ret<ffi::AnyBuffer>()
    .Ret<ffi::AnyBuffer>()
    .Ret<ffi::Buffer<ffi::S32, 2>>()
    .Ret<ffi::Buffer<ffi::F32, 2>>()
    .Ret<ffi::Buffer<ffi::S32, 1>>()
    .Ret<ffi::Buffer<ffi::S32, 1>>()
    .Ret<ffi::Buffer<ffi::S32, 0>>()
    .Ret<ffi::Buffer<ffi::S32, 0>>()
    .Attr<int64_t>("buffer_id")
    .Attr<int32_t>("half")
    .Attr<bool>("cached")
    .Attr<int32_t>("out_rows")
    .Attr<bool>("fp8")
    .Attr<bool>("round_scale");
}

auto ll_combine_binding() {
  return ffi::Ffi::Bind()
    .Ctx<CudaContext>()
    .Arg<ffi::AnyBuffer>()
    .Arg<ffi::Buffer<ffi::S32, 2>>()
    .Arg<ffi::Buffer<ffi::S32, 1>>()
    .Arg<ffi::Buffer<ffi::S32, 0>>()
    .Arg<ffi::AnyBuffer>()
    .Arg<ffi::Buffer<ffi::S32, 1>>()
    .Ret<ffi::AnyBuffer>()
    .Ret<ffi::Buffer<ffi::S32, 1>>()
    .Attr<int64_t>("buffer_id")
    .Attr<int32_t>("half")
    .Attr<bool>("has_bias");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_ep_cuda_ll_dispatch, LowLatencyDispatch, ll_dispatch_binding(),
                              {kGraphSafe});
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_ep_cuda_ll_combine, LowLatencyCombine, ll_combine_binding(),
                              {kGraphSafe});

Targets cuda_targets() {
  return {{"ll_dispatch", jax_ep_cuda_ll_dispatch},
          {"ll_combine", jax_ep_cuda_ll_combine},
          {"dispatch", jax_ep_cuda_dispatch},
          {"dispatch_cached", jax_ep_cuda_dispatch_cached},
          {"combine", jax_ep_cuda_combine},
          {"expert_layout", jax_ep_cuda_expert_layout}};
}

std::shared_ptr<void> cuda_connect(const std::vector<std::vector<int>>& groups,
                                   int experts_per_rank, int hidden, int num_topk,
                                   int low_latency_tokens, int num_sms, double timeout_s) {
  return cuda::connect(groups, cuda::Shape{experts_per_rank, hidden, num_topk, low_latency_tokens},
                       cuda::Knobs{num_sms, timeout_s});
}

int64_t cuda_handler_calls() { return handler_calls.load(); }

double cuda_peer_gbps(int src, int dst, int64_t bytes, int blocks, int mode, int iters,
                      bool both_ways, uintptr_t dst_buffer) {
  return cuda::peer_gbps(src, dst, bytes, blocks, mode, iters, both_ways,
                         reinterpret_cast<void*>(dst_buffer));
}

}  // namespace jax_ep
