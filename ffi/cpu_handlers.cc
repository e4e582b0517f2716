// CPU handlers: each device of an EP group runs its handler on its own host thread.
#include "ffi/handlers.h"
#include "ffi/targets.h"
#include "kernels/cpu/exchange.h"

namespace jax_ep {

struct CpuContext {
  int32_t device;
};

}  // namespace jax_ep

namespace xla::ffi {
template <>
struct CtxDecoding<jax_ep::CpuContext> {
  using Type = jax_ep::CpuContext;
  static std::optional<Type> Decode(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx,
                                    DiagnosticEngine& diagnostic) {
    auto device = CtxDecoding<DeviceOrdinal>::Decode(api, ctx, diagnostic);
    if (!device) return std::nullopt;
    return Type{*device};
  }
};
}  // namespace xla::ffi

namespace jax_ep {
namespace {

// The call completes once the rank that completes the op has run it (see kernels/cpu).
ffi::Future join(BufferState& state, Place place, int64_t key, cpu::Call call) {
  ffi::Promise promise;
  ffi::Future future(promise);
  call.done = [promise](const std::string& error) mutable {
    if (error.empty())
      promise.SetAvailable();
    else
      promise.SetError(ffi::Error(ffi::ErrorCode::kInternal, error));
  };
  state.cpu_groups[place.group]->join(place.rank, key, std::move(call));
  return future;
}

struct CpuBackend {
  using Context = CpuContext;
  using Result = ffi::Future;
  static ffi::Future error(ffi::Error error) {
    ffi::Promise promise;
    ffi::Future future(promise);
    promise.SetError(std::move(error));
    return future;
  }
  static ffi::Future dispatch(const Context&, BufferState& s, Place p, const DispatchArgs& a) {
    return join(s, p, a.op_key, cpu::Call{cpu::Call::kDispatch, a, {}, {}});
  }
  static ffi::Future combine(const Context&, BufferState& s, Place p, const CombineArgs& a) {
    return join(s, p, a.op_key, cpu::Call{cpu::Call::kCombine, {}, a, {}});
  }
  static std::string expert_layout(const Context&, const ExpertLayoutArgs& a) {
    cpu::expert_layout(a);
    return {};
  }
};

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_ep_cpu_dispatch, Dispatch<CpuBackend>, dispatch_binding<CpuBackend>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_ep_cpu_dispatch_cached, DispatchCached<CpuBackend>,
                              dispatch_cached_binding<CpuBackend>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_ep_cpu_combine, Combine<CpuBackend>, combine_binding<CpuBackend>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_ep_cpu_expert_layout, ExpertLayout<CpuBackend>,
                              expert_layout_binding<CpuBackend>());

Targets cpu_targets() {
  return {{"dispatch", jax_ep_cpu_dispatch},
          {"dispatch_cached", jax_ep_cpu_dispatch_cached},
          {"combine", jax_ep_cpu_combine},
          {"expert_layout", jax_ep_cpu_expert_layout}};
}

}  // namespace jax_ep
