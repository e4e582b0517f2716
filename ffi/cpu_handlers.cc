// CPU handlers: every cross-rank call runs what of its op would not wait at once, queues the rest
// on the rank's worker and returns a future (kernels/cpu/rank.h says why); the op's number is
// drawn here, in the order XLA calls the handlers of the device, which the Buffer's XLA token
// fixes (so a rank's calls come one after another, each once the last completed).
#include "ffi/backends.h"
#include "ffi/calls.h"
#include "kernels/cpu/rank.h"

namespace jax_ep {

struct CpuContext {
  int32_t device;
};

}  // namespace jax_ep

// Decoded once per call, and a handler parameter XLA binds by its type.
namespace xla::ffi {
template <>
struct CtxBinding<jax_ep::CpuContext> {
  using Ctx = jax_ep::CpuContext;
};
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

using CpuState = CallState<cpu::Rank>;

ffi::Future queued(cpu::Rank& rank, uint64_t op, std::function<std::string()> job,
                   std::function<void()> poison) {
  ffi::Promise promise;
  ffi::Future future(promise);
  rank.run(op, std::move(job), std::move(poison), [promise](const std::string& error) mutable {
    if (error.empty())
      promise.SetAvailable();
    else
      promise.SetError(ffi::Error(ffi::ErrorCode::kInternal, error));
  });
  return future;
}

ffi::Future available() {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetAvailable();
  return future;
}

// Op `op`'s part (its send stage, its recv stage, or both): each stage that would not wait runs
// here, on XLA's thread, at once (Rank::ready_to_send / ready_soon): at small sizes the
// hand-offs to the worker and back are most of an op. The first stage that would wait, and what
// follows it, go to the worker. A stage that fails here leaves the part's poison and breaks the
// rank, as on the worker.
ffi::Future run_part(cpu::Rank& rank, uint64_t op, Part part, std::function<std::string()> send,
                     std::function<std::string()> recv, std::function<void()> poison) {
  bool sending = sends(part), receiving = receives(part);
  // A stage that fails here: the failed op's parts leave NaN; later ops fail with the error.
  auto failed = [&](const std::function<std::string()>& stage) {
    cpu::FlushDenormals flushing;  // as on the worker: its sums round as XLA's and the reference's
    std::string error = stage();
    if (error.empty()) return false;
    rank.broken(op, error);
    poison();
    return true;
  };
  if (sending && rank.ready_to_send(op)) {
    if (failed(send)) return available();
    sending = false;
  }
  if (!sending && receiving && rank.ready_soon(op)) {
    if (failed(recv)) return available();
    receiving = false;
  }
  if (!sending && !receiving) return available();
  return queued(
      rank, op,
      [sending, receiving, send = std::move(send), recv = std::move(recv)] {
        std::string err = sending ? send() : "";
        return err.empty() && receiving ? recv() : err;
      },
      std::move(poison));
}

uint64_t op_of_call(cpu::Rank& r, Part part, const Tokens& tokens) {
  const uint64_t op = sends(part) ? r.next_op() : r.op_of_ticket(*tokens.ticket);
  *tokens.out = int32_t(op);
  return op;
}

struct CpuBackend {
  using Context = CpuContext;
  using Rank = cpu::Rank;
  using State = CpuState;
  using Result = ffi::Future;
  static constexpr std::initializer_list<ffi::Traits> traits = {};

  static ffi::Future error(ffi::Error error) {
    ffi::Promise promise;
    ffi::Future future(promise);
    promise.SetError(std::move(error));
    return future;
  }

  // The state outlives the calls in flight, and with it the rank (the job's raw pointer).
  static ffi::Future dispatch(Context, State&, Rank& rank, Part part, const DispatchSend* send,
                              const DispatchRecv* recv, Tokens tokens) {
    const uint64_t op = op_of_call(rank, part, tokens);
    // The structs hold pointers into XLA's buffers, which stay ours until the call completes.
    DispatchSend s = send ? *send : DispatchSend{};
    DispatchRecv v = recv ? *recv : DispatchRecv{};
    const Window& w = rank.window;
    return run_part(
        rank, op, part, [r = &rank, op, s] { return cpu::dispatch_send(*r, op, s); },
        [r = &rank, op, v] { return cpu::dispatch_recv(*r, op, v); },
        [part, s, v, R = w.num_ranks, El = w.experts_per_rank] {
          if (sends(part)) cpu::poison(s, R);
          if (receives(part)) cpu::poison(v, R, El);
        });
  }

  static ffi::Future combine(Context, State&, Rank& rank, Part part, const CombineSend* send,
                             const CombineRecv* recv, Tokens tokens) {
    const uint64_t op = op_of_call(rank, part, tokens);
    CombineSend s = send ? *send : CombineSend{};
    CombineRecv v = recv ? *recv : CombineRecv{};
    return run_part(
        rank, op, part, [r = &rank, op, s] { return cpu::combine_send(*r, op, s); },
        [r = &rank, op, v] { return cpu::combine_recv(*r, op, v); },
        [part, v] {
          if (receives(part)) cpu::poison(v);
        });
  }

  static std::string expert_layout(Context, const ExpertLayoutArgs& a) {
    cpu::expert_layout(a);
    return {};
  }

  static std::string expert_padded(Context, const ExpertPaddedArgs& a) {
    return cpu::expert_padded(a);
  }

  static std::string place_rows(Context, const PlaceRowsArgs& a) { return cpu::place_rows(a); }

  static std::string quantize_rows(Context, const QuantizeRowsArgs& a) {
    cpu::quantize_rows(a);
    return {};
  }

  static std::string quantize_weights(Context, const QuantizeWeightsArgs& a) {
    cpu::quantize_weights(a);
    return {};
  }
};

}  // namespace

Targets cpu_targets() { return targets<CpuBackend>(); }
XLA_FFI_TypeId* cpu_state_type_id() { return &CpuState::id; }
const XLA_FFI_TypeInfo* cpu_state_type_info() { return state_type_info<CpuState>(); }

}  // namespace jax_ep
