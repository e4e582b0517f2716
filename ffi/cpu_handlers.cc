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

struct CpuBackend {
  using Context = CpuContext;
  static std::string dispatch(const Context&, BufferState& s, Place p, const DispatchArgs& a) {
    return cpu::dispatch(*s.cpu_groups[p.group], a, s.timeout_s);
  }
  static std::string combine(const Context&, BufferState& s, Place p, const CombineArgs& a) {
    return cpu::combine(*s.cpu_groups[p.group], a, s.timeout_s);
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
