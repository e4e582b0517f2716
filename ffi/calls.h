// jax_ep's custom calls, written once for every backend: one target per operation and half. Each
// handler decodes its buffers (ffi/decode.h), checks them against the Buffer's window and hands
// them to the backend; right after it, bind_<name>() says how XLA binds it, inferred from the
// handler's parameters where it can be (XLA's auto-binding). Every call on a Buffer shares one
// instantiate handler, which decodes the attributes once into the call's state; the execute
// handlers take no attributes.
//
// A backend B supplies Context (decoded from the execution context), Rank, State (CallState of
// its rank type), Result (ffi::Error, or ffi::Future when it completes asynchronously), traits
// (XLA's traits of its execute handlers), error(), dispatch(), combine(), expert_layout(),
// expert_padded(), place_rows(), quantize_rows() and quantize_weights().
#pragma once
#include <memory>
#include <string>
#include <utility>

#include "ffi/backends.h"
#include "ffi/decode.h"

namespace jax_ep {

template <class B>
struct Calls {
  using Ctx = typename B::Context;
  using State = typename B::State;
  using Rank = typename B::Rank;
  using Result = typename B::Result;

  // ---- the instantiate handler of every call on a Buffer

  static ffi::ErrorOr<std::unique_ptr<State>> instantiate(CallAttrs attrs) {
    auto native = find_buffer(attrs.buffer);
    if (!native)
      return ffi::Unexpected(ffi::Error(
          ffi::ErrorCode::kFailedPrecondition,
          "jax_ep: this program uses a Buffer that was closed before it was compiled (or was "
          "never created in this process)"));
    return std::unique_ptr<State>(new State{std::move(native), attrs.config});
  }
  static auto bind_instantiate() {
    return ffi::Ffi::BindInstantiate().Attrs<CallAttrs>().To(instantiate);
  }

  // ---- dispatch

  // A fresh dispatch, whole: its send half's results, then its recv half's (`received`: the
  // results of FreshReceived).
  template <class... Received>
  static Result dispatch(Ctx ctx, State* st, OrderArg, ffi::AnyBuffer x,
                         ffi::Buffer<ffi::S32, 2> topk_idx, ffi::Buffer<ffi::F32, 2> topk_weights,
                         OrderRet, TokenRet token_out, ffi::ResultBuffer<ffi::S32, 2> send_pos,
                         ffi::ResultBuffer<ffi::S32, 0> num_invalid, Received... received) {
    Rank* rank = rank_of(ctx, *st);
    if (!rank) return no_rank(ctx);
    const Window& w = rank->window;
    DispatchSend send;
    DispatchRecv recv;
    ffi::Error err = check_tokens(token_out);
    if (err.success())
      err =
          decode_fresh_send(w, st->config, x, topk_idx, topk_weights, send_pos, num_invalid, &send);
    if (err.success()) err = decode_fresh_recv(w, st->config, FreshReceived{received...}, &recv);
    if (err.success()) err = check_whole(send, recv);
    if (err.failure()) return B::error(std::move(err));
    return B::dispatch(ctx, *st, *rank, Part::kWhole, &send, &recv,
                       {nullptr, token_out->typed_data()});
  }
  // By hand: XLA binds one result per parameter; the lambda hands `received` on as a pack.
  static auto bind_dispatch() {
    return FreshReceived::bind(call()
                                   .template Arg<OrderArg>()
                                   .template Arg<ffi::AnyBuffer>()
                                   .template Arg<ffi::Buffer<ffi::S32, 2>>()
                                   .template Arg<ffi::Buffer<ffi::F32, 2>>()
                                   .template Ret<OrderArg>()
                                   .template Ret<TokenArg>()
                                   .template Ret<ffi::Buffer<ffi::S32, 2>>()
                                   .template Ret<ffi::Buffer<ffi::S32, 0>>())
        .To([](auto... decoded) { return dispatch(decoded...); }, B::traits);
  }

  static Result dispatch_send(Ctx ctx, State* st, OrderArg, ffi::AnyBuffer x,
                              ffi::Buffer<ffi::S32, 2> topk_idx,
                              ffi::Buffer<ffi::F32, 2> topk_weights, OrderRet, TokenRet ticket,
                              ffi::ResultBuffer<ffi::S32, 2> send_pos,
                              ffi::ResultBuffer<ffi::S32, 0> num_invalid) {
    Rank* rank = rank_of(ctx, *st);
    if (!rank) return no_rank(ctx);
    DispatchSend send;
    ffi::Error err = check_tokens(ticket);
    if (err.success())
      err = decode_fresh_send(rank->window, st->config, x, topk_idx, topk_weights, send_pos,
                              num_invalid, &send);
    if (err.failure()) return B::error(std::move(err));
    return B::dispatch(ctx, *st, *rank, Part::kSend, &send, nullptr,
                       {nullptr, ticket->typed_data()});
  }
  static auto bind_dispatch_send() { return ffi::Ffi::BindTo(dispatch_send, B::traits); }

  // (`received`: the results of FreshReceived.)
  template <class... Received>
  static Result dispatch_recv(Ctx ctx, State* st, OrderArg, TokenArg ticket, OrderRet,
                              TokenRet token_out, Received... received) {
    Rank* rank = rank_of(ctx, *st);
    if (!rank) return no_rank(ctx);
    DispatchRecv recv;
    ffi::Error err = check_tokens(ticket, token_out);
    if (err.success())
      err = decode_fresh_recv(rank->window, st->config, FreshReceived{received...}, &recv);
    if (err.failure()) return B::error(std::move(err));
    return B::dispatch(ctx, *st, *rank, Part::kRecv, nullptr, &recv,
                       {ticket.typed_data(), token_out->typed_data()});
  }
  // By hand, as bind_dispatch.
  static auto bind_dispatch_recv() {
    return FreshReceived::bind(call()
                                   .template Arg<OrderArg>()
                                   .template Arg<TokenArg>()
                                   .template Ret<OrderArg>()
                                   .template Ret<TokenArg>())
        .To([](auto... decoded) { return dispatch_recv(decoded...); }, B::traits);
  }

  // A dispatch along a handle's routes, whole: only x moves.
  static Result dispatch_cached(Ctx ctx, State* st, OrderArg, ffi::AnyBuffer x,
                                ffi::Buffer<ffi::S32, 2> send_pos, OrderRet, TokenRet token_out,
                                ffi::Result<ffi::AnyBuffer> x_out,
                                ffi::Result<ffi::AnyBuffer> scales_out) {
    Rank* rank = rank_of(ctx, *st);
    if (!rank) return no_rank(ctx);
    const Window& w = rank->window;
    DispatchSend send;
    DispatchRecv recv;
    ffi::Error err = check_tokens(token_out);
    if (err.success()) err = decode_cached_send(w, st->config, x, send_pos, &send);
    if (err.success()) err = decode_recv(w, st->config, *x_out, *scales_out, &recv);
    if (err.success()) err = check_whole(send, recv);
    if (err.failure()) return B::error(std::move(err));
    return B::dispatch(ctx, *st, *rank, Part::kWhole, &send, &recv,
                       {nullptr, token_out->typed_data()});
  }
  static auto bind_dispatch_cached() { return ffi::Ffi::BindTo(dispatch_cached, B::traits); }

  static Result dispatch_cached_send(Ctx ctx, State* st, OrderArg, ffi::AnyBuffer x,
                                     ffi::Buffer<ffi::S32, 2> send_pos, OrderRet, TokenRet ticket) {
    Rank* rank = rank_of(ctx, *st);
    if (!rank) return no_rank(ctx);
    DispatchSend send;
    ffi::Error err = check_tokens(ticket);
    if (err.success()) err = decode_cached_send(rank->window, st->config, x, send_pos, &send);
    if (err.failure()) return B::error(std::move(err));
    return B::dispatch(ctx, *st, *rank, Part::kSend, &send, nullptr,
                       {nullptr, ticket->typed_data()});
  }
  static auto bind_dispatch_cached_send() {
    return ffi::Ffi::BindTo(dispatch_cached_send, B::traits);
  }

  static Result dispatch_cached_recv(Ctx ctx, State* st, OrderArg, TokenArg ticket, OrderRet,
                                     TokenRet token_out, ffi::Result<ffi::AnyBuffer> x_out,
                                     ffi::Result<ffi::AnyBuffer> scales_out) {
    Rank* rank = rank_of(ctx, *st);
    if (!rank) return no_rank(ctx);
    DispatchRecv recv;
    ffi::Error err = check_tokens(ticket, token_out);
    if (err.success()) err = decode_recv(rank->window, st->config, *x_out, *scales_out, &recv);
    if (err.failure()) return B::error(std::move(err));
    return B::dispatch(ctx, *st, *rank, Part::kRecv, nullptr, &recv,
                       {ticket.typed_data(), token_out->typed_data()});
  }
  static auto bind_dispatch_cached_recv() {
    return ffi::Ffi::BindTo(dispatch_cached_recv, B::traits);
  }

  // ---- combine

  // A combine, whole: out = bias + the rows each token sent, summed in rank order.
  static Result combine(Ctx ctx, State* st, OrderArg, ffi::AnyBuffer rows,
                        ffi::Buffer<ffi::S32, 2> send_pos, ffi::Buffer<ffi::S32, 1> recv_counts,
                        ffi::Buffer<ffi::S32, 0> num_rows, ffi::RemainingArgs bias, OrderRet,
                        TokenRet token_out, ffi::Result<ffi::AnyBuffer> out) {
    Rank* rank = rank_of(ctx, *st);
    if (!rank) return no_rank(ctx);
    const Window& w = rank->window;
    CombineSend send;
    CombineRecv recv;
    ffi::Error err = check_tokens(token_out);
    if (err.success())
      err = decode_whole_combine(w, st->config, rows, send_pos, recv_counts, num_rows, *out, &send,
                                 &recv);
    if (err.success()) err = decode_bias(bias, &recv);
    if (err.success() && recv.width != send.width)
      err = invalid("combine: rows and output widths differ");
    if (err.failure()) return B::error(std::move(err));
    return B::combine(ctx, *st, *rank, Part::kWhole, &send, &recv,
                      {nullptr, token_out->typed_data()});
  }
  static auto bind_combine() {
    return bias_then_output(call()
                                .template Arg<OrderArg>()
                                .template Arg<ffi::AnyBuffer>()
                                .template Arg<ffi::Buffer<ffi::S32, 2>>()
                                .template Arg<ffi::Buffer<ffi::S32, 1>>()
                                .template Arg<ffi::Buffer<ffi::S32, 0>>())
        .To(combine, B::traits);
  }

  static Result combine_send(Ctx ctx, State* st, OrderArg, ffi::AnyBuffer rows,
                             ffi::Buffer<ffi::S32, 1> recv_counts,
                             ffi::Buffer<ffi::S32, 0> num_rows, OrderRet, TokenRet ticket) {
    Rank* rank = rank_of(ctx, *st);
    if (!rank) return no_rank(ctx);
    CombineSend send;
    ffi::Error err = check_tokens(ticket);
    if (err.success())
      err = decode_combine_send(rank->window, st->config, rows, recv_counts, num_rows, &send);
    if (err.success() && send.rows_dtype != st->config.rows_dtype)
      err = invalid("combine: rows of another type than the call was built for");
    if (err.failure()) return B::error(std::move(err));
    return B::combine(ctx, *st, *rank, Part::kSend, &send, nullptr,
                      {nullptr, ticket->typed_data()});
  }
  static auto bind_combine_send() { return ffi::Ffi::BindTo(combine_send, B::traits); }

  static Result combine_recv(Ctx ctx, State* st, OrderArg, TokenArg ticket,
                             ffi::Buffer<ffi::S32, 2> send_pos, ffi::RemainingArgs bias, OrderRet,
                             TokenRet token_out, ffi::Result<ffi::AnyBuffer> out) {
    Rank* rank = rank_of(ctx, *st);
    if (!rank) return no_rank(ctx);
    CombineRecv recv;
    ffi::Error err = check_tokens(ticket, token_out);
    if (err.success())
      err = decode_combine_recv(rank->window, st->config.rows_dtype, send_pos, *out, &recv);
    if (err.success()) err = decode_bias(bias, &recv);
    if (err.failure()) return B::error(std::move(err));
    return B::combine(ctx, *st, *rank, Part::kRecv, nullptr, &recv,
                      {ticket.typed_data(), token_out->typed_data()});
  }
  static auto bind_combine_recv() {
    return bias_then_output(call()
                                .template Arg<OrderArg>()
                                .template Arg<TokenArg>()
                                .template Arg<ffi::Buffer<ffi::S32, 2>>())
        .To(combine_recv, B::traits);
  }

  // The adjoint of a dispatch: the cotangents of the rows and of their weights go back to the
  // tokens in one combine (the weights' as float32 columns beside the rows).
  static Result dispatch_adjoint(Ctx ctx, State* st, OrderArg, ffi::AnyBuffer ct_rows,
                                 ffi::Buffer<ffi::F32, 2> ct_weights,
                                 ffi::Buffer<ffi::S32, 2> send_pos,
                                 ffi::Buffer<ffi::S32, 1> recv_counts,
                                 ffi::Buffer<ffi::S32, 0> num_rows, OrderRet, TokenRet token_out,
                                 ffi::Result<ffi::AnyBuffer> ct_x,
                                 ffi::ResultBuffer<ffi::F32, 2> ct_w) {
    Rank* rank = rank_of(ctx, *st);
    if (!rank) return no_rank(ctx);
    const Window& w = rank->window;
    CombineSend send;
    CombineRecv recv;
    ffi::Error err = check_tokens(token_out);
    if (err.success())
      err = decode_whole_combine(w, st->config, ct_rows, send_pos, recv_counts, num_rows, *ct_x,
                                 &send, &recv);
    if (err.success() && recv.width != send.width)
      err = invalid("dispatch adjoint: the rows' and x's cotangents differ in width");
    if (err.success()) err = decode_weight_cotangents(w, ct_weights, ct_w, &send, &recv);
    if (err.failure()) return B::error(std::move(err));
    return B::combine(ctx, *st, *rank, Part::kWhole, &send, &recv,
                      {nullptr, token_out->typed_data()});
  }
  static auto bind_dispatch_adjoint() { return ffi::Ffi::BindTo(dispatch_adjoint, B::traits); }

  // ---- the expert layout of received rows (local to the rank, no Buffer)

  static ffi::Error expert_layout(
      Ctx ctx, ffi::Buffer<ffi::S32, 2> topk_rows, ffi::ResultBuffer<ffi::S32, 1> expert_src,
      ffi::ResultBuffer<ffi::S32, 2> expert_rows, ffi::ResultBuffer<ffi::S32, 1> expert_of_row,
      ffi::ResultBuffer<ffi::S32, 1> tokens_per_expert, ffi::ResultBuffer<ffi::S32, 0> num_dropped,
      ffi::ResultBuffer<ffi::S32, 1> expert_counts, ExpertLayoutAttrs attrs) {
    ExpertLayoutArgs a;
    if (auto err = decode_expert_layout(topk_rows, expert_src, expert_rows, expert_of_row,
                                        tokens_per_expert, num_dropped, expert_counts, attrs, &a);
        err.failure())
      return err;
    return to_error(B::expert_layout(ctx, a));
  }
  static auto bind_expert_layout() { return ffi::Ffi::BindTo(expert_layout, B::traits); }

  // ---- a fresh dispatch's rows in the expert_padded layout (local to the rank, no Buffer)

  static ffi::Error expert_padded(
      Ctx ctx, ffi::Buffer<ffi::S32, 2> topk_rows, ffi::Buffer<ffi::F32, 2> weight_rows,
      ffi::AnyBuffer x_rows, ffi::AnyBuffer scale_rows, ffi::Result<ffi::AnyBuffer> x_out,
      ffi::Result<ffi::AnyBuffer> scales_out, ffi::ResultBuffer<ffi::F32, 1> weights_out,
      ffi::ResultBuffer<ffi::S32, 1> expert_src, ffi::ResultBuffer<ffi::S32, 2> expert_rows,
      ffi::ResultBuffer<ffi::S32, 1> expert_of_row,
      ffi::ResultBuffer<ffi::S32, 1> tokens_per_expert,
      ffi::ResultBuffer<ffi::S32, 1> expert_counts, ffi::ResultBuffer<ffi::S32, 2> chunk_counts) {
    ExpertPaddedArgs a;
    if (auto err = decode_expert_padded(
            topk_rows, weight_rows, x_rows, scale_rows, x_out, scales_out, weights_out, expert_src,
            expert_rows, expert_of_row, tokens_per_expert, expert_counts, chunk_counts, &a);
        err.failure())
      return err;
    return to_error(B::expert_padded(ctx, a));
  }
  static auto bind_expert_padded() { return ffi::Ffi::BindTo(expert_padded, B::traits); }

  // ---- rows placed in the expert_padded layout by a cached dispatch (local, no Buffer)

  static ffi::Error place_rows(Ctx ctx, ffi::AnyBuffer src, ffi::Buffer<ffi::S32, 2> expert_rows,
                               ffi::Result<ffi::AnyBuffer> out) {
    PlaceRowsArgs a;
    if (auto err = decode_place_rows(src, expert_rows, out, &a); err.failure()) return err;
    return to_error(B::place_rows(ctx, a));
  }
  static auto bind_place_rows() { return ffi::Ffi::BindTo(place_rows, B::traits); }

  // ---- FP8 quantization of a grouped matmul's operands (local, no Buffer)

  static ffi::Error quantize_rows(Ctx ctx, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                                  ffi::ResultBuffer<ffi::F32, 2> scales, QuantizeRowsAttrs attrs) {
    QuantizeRowsArgs a;
    if (auto err = decode_quantize_rows(x, q, scales, attrs, &a); err.failure()) return err;
    return to_error(B::quantize_rows(ctx, a));
  }
  static auto bind_quantize_rows() { return ffi::Ffi::BindTo(quantize_rows, B::traits); }

  static ffi::Error quantize_weights(Ctx ctx, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> q,
                                     ffi::ResultBuffer<ffi::F32, 3> scales,
                                     ffi::Result<ffi::AnyBuffer> q_t,
                                     ffi::ResultBuffer<ffi::F32, 3> scales_t) {
    QuantizeWeightsArgs a;
    if (auto err = decode_quantize_weights(w, q, scales, q_t, scales_t, &a); err.failure())
      return err;
    return to_error(B::quantize_weights(ctx, a));
  }
  static auto bind_quantize_weights() { return ffi::Ffi::BindTo(quantize_weights, B::traits); }

 private:
  // What every execute handler of a Buffer's calls takes first.
  static auto call() {
    return ffi::Ffi::Bind().template Ctx<Ctx>().template Ctx<ffi::State<State>>();
  }

  // The end of a combine's recv binding: the optional bias (bound by hand: XLA infers no
  // optional operand), then the order token, the ticket and the output.
  template <class Binding>
  static auto bias_then_output(Binding binding) {
    return std::move(binding)
        .RemainingArgs()
        .template Ret<OrderArg>()
        .template Ret<TokenArg>()
        .template Ret<ffi::AnyBuffer>();
  }

  // This device's rank of the call's Buffer.
  static Rank* rank_of(const Ctx& ctx, const State& st) { return st.rank_on(ctx.device); }
  static Result no_rank(const Ctx& ctx) {
    return B::error(
        invalid("device " + std::to_string(ctx.device) + " is not in the mesh of this Buffer"));
  }
};

// The XLA handler of one target: bind() binds it, on its first call.
template <auto bind>
XLA_FFI_Error* handler(XLA_FFI_CallFrame* frame) {
  static auto* bound = bind().release();
  return bound->Call(frame);
}

// Every target of backend B by name (jax_ep/ffi_path.py registers each as jax_ep_<name>).
template <class B>
Targets targets() {
  using C = Calls<B>;
  const Handler buffer = handler<C::bind_instantiate>;  // instantiates every call on a Buffer
  return {
      {"dispatch", {buffer, handler<C::bind_dispatch>}},
      {"dispatch_send", {buffer, handler<C::bind_dispatch_send>}},
      {"dispatch_recv", {buffer, handler<C::bind_dispatch_recv>}},
      {"dispatch_cached", {buffer, handler<C::bind_dispatch_cached>}},
      {"dispatch_cached_send", {buffer, handler<C::bind_dispatch_cached_send>}},
      {"dispatch_cached_recv", {buffer, handler<C::bind_dispatch_cached_recv>}},
      {"combine", {buffer, handler<C::bind_combine>}},
      {"combine_send", {buffer, handler<C::bind_combine_send>}},
      {"combine_recv", {buffer, handler<C::bind_combine_recv>}},
      {"dispatch_adjoint", {buffer, handler<C::bind_dispatch_adjoint>}},
      {"expert_layout", {nullptr, handler<C::bind_expert_layout>}},
      {"expert_padded", {nullptr, handler<C::bind_expert_padded>}},
      {"place_rows", {nullptr, handler<C::bind_place_rows>}},
      {"quantize_rows", {nullptr, handler<C::bind_quantize_rows>}},
      {"quantize_weights", {nullptr, handler<C::bind_quantize_weights>}},
  };
}

// The type information XLA keeps for a backend's call state.
template <class State>
const XLA_FFI_TypeInfo* state_type_info() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<State>();
  return &info;
}

}  // namespace jax_ep
