// jax_ep's custom calls, written once for every backend: one handler per operation and half,
// each decoding its buffers into the structs of kernels/ops.h and checking them against the
// Buffer's window, then handing them to the backend. Every target shares one instantiate
// handler, which decodes the attributes once into the call's state (its rank and its static
// configuration); the execute handlers bind no attributes.
//
// A backend B supplies Context (decoded from the execution context), State (CallState of its
// rank type), Result (ffi::Error, or ffi::Future when it completes asynchronously), error(),
// dispatch(), combine() and expert_layout().
#pragma once
#include <string>
#include <utility>

#include "ffi/buffers.h"
#include "kernels/ops.h"
#include "kernels/window.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {
namespace ffi = xla::ffi;

// Every cross-rank call takes the Buffer's XLA token and returns the next one (jax_ep/_jax.py
// threads it through the program as an ordered effect), so XLA runs a Buffer's calls in program
// order; no kernel reads it. Every call also returns its op's number (low 32 bits): a send
// half's ticket, which its recv half takes to name its op.
using OrderArg = ffi::Token;
using OrderRet = ffi::Result<ffi::Token>;

struct Tokens {
  const int32_t* ticket;  // recv halves
  int32_t* out;
};

using TokenArg = ffi::Buffer<ffi::S32, 1>;
using TokenRet = ffi::ResultBuffer<ffi::S32, 1>;

inline ffi::Error invalid(const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_ep: " + what);
}

inline ffi::Error to_error(const std::string& err) {
  return err.empty() ? ffi::Error::Success() : ffi::Error(ffi::ErrorCode::kInternal, err);
}

inline bool to_dtype(ffi::DataType t, Dtype* out) {
  if (t == ffi::DataType::F32) return *out = Dtype::kF32, true;
  if (t == ffi::DataType::BF16) return *out = Dtype::kBF16, true;
  return false;
}

inline ffi::Error check_tokens(TokenArg ticket, TokenRet token_out) {
  if (ticket.element_count() != 1 || token_out->element_count() != 1)
    return invalid("an op's ticket must hold one int32");
  return ffi::Error::Success();
}

inline ffi::Error check_tokens(TokenRet token_out) {
  if (token_out->element_count() != 1) return invalid("an op's ticket must hold one int32");
  return ffi::Error::Success();
}

// ---- decoding, shared by the targets of a kind

// A dispatch's send half; topk_idx and topk_weights are null for a cached dispatch.
inline ffi::Error decode_send(const Window& w, const CallConfig& cfg, ffi::AnyBuffer x,
                              const int32_t* topk_idx, const float* topk_weights, int num_topk,
                              int32_t* send_pos, int64_t send_pos_rows, int64_t send_pos_cols,
                              int32_t* num_invalid, DispatchSend* a) {
  if (x.dimensions().size() != 2) return invalid("dispatch: x must be [tokens, hidden]");
  *a = DispatchSend{};
  a->num_experts = w.num_ranks * w.experts_per_rank;
  a->num_topk = num_topk;
  a->num_tokens = int(x.dimensions()[0]);
  a->hidden = int(x.dimensions()[1]);
  a->fp8 = cfg.fp8;
  a->round_scale = cfg.round_scale;
  a->x = x.untyped_data();
  a->topk_idx = topk_idx;
  a->topk_weights = topk_weights;
  a->send_pos = send_pos;
  a->num_invalid = num_invalid;
  if (!to_dtype(x.element_type(), &a->x_dtype))
    return invalid("dispatch: x must be float32 or bfloat16");
  if (a->num_tokens > w.rows_per_source)
    return invalid("dispatch: more tokens than the Buffer's max_tokens_per_rank");
  if (a->hidden > w.hidden || (a->fp8 && a->hidden % kFp8Block))
    return invalid("dispatch: rows wider than the Buffer's hidden, or fp8 with hidden % 128 != 0");
  if (a->wire_row_bytes() > w.payload_bytes())
    return invalid("dispatch: x's element type is wider than the Buffer's rows (max_row_dtype)");
  if (topk_idx && num_topk != w.num_topk)
    return invalid("dispatch: topk_idx does not match num_topk");
  if (send_pos_rows != a->num_tokens || send_pos_cols != w.num_ranks)
    return invalid("dispatch: the handle does not match x");
  return ffi::Error::Success();
}

// A dispatch's recv half: x_out's shape and type say the rows' width and type.
inline ffi::Error decode_recv(const Window& w, const CallConfig& cfg, ffi::AnyBuffer x_out,
                              ffi::AnyBuffer scales_out, DispatchRecv* a) {
  if (x_out.dimensions().size() != 2) return invalid("dispatch: rows must be [rows, hidden]");
  *a = DispatchRecv{};
  a->out_rows = int(x_out.dimensions()[0]);
  a->hidden = int(x_out.dimensions()[1]);
  a->num_topk = w.num_topk;
  a->fp8 = cfg.fp8;
  a->x_out = x_out.untyped_data();
  a->scales_out = cfg.fp8 ? static_cast<float*>(scales_out.untyped_data()) : nullptr;
  if (cfg.fp8) {
    if (x_out.element_type() != ffi::DataType::F8E4M3FN ||
        scales_out.element_count() != int64_t(a->out_rows) * (a->hidden / kFp8Block))
      return invalid("dispatch: fp8 rows must be float8_e4m3fn with one scale per 128 channels");
  } else if (!to_dtype(x_out.element_type(), &a->x_dtype)) {
    return invalid("dispatch: rows must be float32 or bfloat16");
  }
  if (a->hidden > w.hidden || a->wire_row_bytes() > w.payload_bytes())
    return invalid("dispatch: rows wider than the Buffer's");
  return ffi::Error::Success();
}

// The recv half of a fresh dispatch: its rows and its routing outputs.
inline ffi::Error decode_fresh_recv(
    const Window& w, const CallConfig& cfg, ffi::AnyBuffer x_out, ffi::AnyBuffer scales_out,
    ffi::ResultBuffer<ffi::S32, 2> topk_out, ffi::ResultBuffer<ffi::F32, 2> weights_out,
    ffi::ResultBuffer<ffi::S32, 1> recv_counts, ffi::ResultBuffer<ffi::S32, 1> tokens_per_expert,
    ffi::ResultBuffer<ffi::S32, 0> num_recv, ffi::ResultBuffer<ffi::S32, 0> num_dropped,
    ffi::ResultBuffer<ffi::S32, 0> group_invalid, DispatchRecv* a) {
  if (auto err = decode_recv(w, cfg, x_out, scales_out, a); err.failure()) return err;
  if (topk_out->dimensions()[0] != a->out_rows || topk_out->dimensions()[1] != w.num_topk ||
      weights_out->dimensions()[0] != a->out_rows || weights_out->dimensions()[1] != w.num_topk ||
      recv_counts->element_count() != w.num_ranks ||
      tokens_per_expert->element_count() != w.experts_per_rank)
    return invalid("dispatch: the routing outputs do not match the Buffer");
  a->topk_out = topk_out->typed_data();
  a->weights_out = weights_out->typed_data();
  a->recv_counts = recv_counts->typed_data();
  a->tokens_per_expert = tokens_per_expert->typed_data();
  a->num_recv = num_recv->typed_data();
  a->num_dropped = num_dropped->typed_data();
  a->group_invalid = group_invalid->typed_data();
  return ffi::Error::Success();
}

// A combine's send half: the rank-level rows of this rank and the dispatch's counts.
inline ffi::Error decode_combine_send(const Window& w, ffi::AnyBuffer rows,
                                      ffi::Buffer<ffi::S32, 1> recv_counts,
                                      ffi::Buffer<ffi::S32, 0> num_rows, CombineSend* a) {
  if (rows.dimensions().size() != 2) return invalid("combine: rows must be [rows, width]");
  *a = CombineSend{};
  a->rows = int(rows.dimensions()[0]);
  a->width = int(rows.dimensions()[1]);
  a->row_data = rows.untyped_data();
  a->recv_counts = recv_counts.typed_data();
  a->num_rows = num_rows.typed_data();
  if (!to_dtype(rows.element_type(), &a->rows_dtype))
    return invalid("combine: rows must be float32 or bfloat16");
  if (a->width > w.hidden || int64_t(a->width) * dtype_size(a->rows_dtype) > w.payload_bytes())
    return invalid("combine: rows wider than the Buffer's (hidden, max_row_dtype)");
  if (recv_counts.element_count() != w.num_ranks)
    return invalid("combine: the handle does not match");
  return ffi::Error::Success();
}

// A combine's recv half: where each token went and the output.
inline ffi::Error decode_combine_recv(const Window& w, Dtype rows_dtype,
                                      ffi::Buffer<ffi::S32, 2> send_pos, ffi::AnyBuffer out,
                                      CombineRecv* a) {
  *a = CombineRecv{};
  a->num_tokens = int(send_pos.dimensions()[0]);
  a->width = out.dimensions().size() == 2 ? int(out.dimensions()[1]) : -1;
  a->send_pos = send_pos.typed_data();
  a->rows_dtype = rows_dtype;
  a->out = out.untyped_data();
  if (send_pos.dimensions()[1] != w.num_ranks || a->num_tokens > w.rows_per_source)
    return invalid("combine: the handle does not match the Buffer");
  if (a->width < 0 || out.dimensions()[0] != a->num_tokens || a->width > w.hidden ||
      !to_dtype(out.element_type(), &a->out_dtype))
    return invalid("combine: the output must be [tokens, width] float32 or bfloat16");
  return ffi::Error::Success();
}

// The optional bias of a combine: the call's remaining argument, if any.
inline ffi::Error decode_bias(ffi::RemainingArgs bias, CombineRecv* a) {
  if (bias.size() == 0) return ffi::Error::Success();
  auto b = bias.get<ffi::AnyBuffer>(0);
  if (bias.size() > 1 || !b.has_value() ||
      b->element_count() != int64_t(a->num_tokens) * a->width ||
      !to_dtype(b->element_type(), &a->bias_dtype))
    return invalid("combine: bias must be one [tokens, width] float32 or bfloat16 array");
  a->bias = b->untyped_data();
  return ffi::Error::Success();
}

// A whole dispatch writes the rows a rank sends itself straight into its outputs: they must agree.
inline ffi::Error check_whole(const DispatchSend& s, const DispatchRecv& v) {
  if (s.hidden != v.hidden || (!s.fp8 && s.x_dtype != v.x_dtype))
    return invalid("dispatch: the rows out differ from x in width or type");
  return ffi::Error::Success();
}

// ---- the targets

template <class B>
struct Calls {
  using Ctx = typename B::Context;
  using State = typename B::State;
  using Rank = typename B::Rank;
  using Result = typename B::Result;

  // This device's rank of the call's Buffer.
  static Rank* rank_of(const Ctx& ctx, const State& st) { return st.rank_on(ctx.device); }
  static Result no_rank(const Ctx& ctx) {
    return B::error(
        invalid("device " + std::to_string(ctx.device) + " is not in the mesh of this Buffer"));
  }

  // A fresh dispatch, whole.
  static Result dispatch(
      Ctx ctx, State* st, OrderArg, ffi::AnyBuffer x, ffi::Buffer<ffi::S32, 2> topk_idx,
      ffi::Buffer<ffi::F32, 2> topk_weights, OrderRet, TokenRet token_out,
      ffi::Result<ffi::AnyBuffer> x_out, ffi::Result<ffi::AnyBuffer> scales_out,
      ffi::ResultBuffer<ffi::S32, 2> topk_out, ffi::ResultBuffer<ffi::F32, 2> weights_out,
      ffi::ResultBuffer<ffi::S32, 1> recv_counts, ffi::ResultBuffer<ffi::S32, 1> tokens_per_expert,
      ffi::ResultBuffer<ffi::S32, 0> num_recv, ffi::ResultBuffer<ffi::S32, 0> num_dropped,
      ffi::ResultBuffer<ffi::S32, 0> group_invalid, ffi::ResultBuffer<ffi::S32, 2> send_pos,
      ffi::ResultBuffer<ffi::S32, 0> num_invalid) {
    Rank* rank = rank_of(ctx, *st);
    if (!rank) return no_rank(ctx);
    const Window& w = rank->window;
    DispatchSend send;
    DispatchRecv recv;
    ffi::Error err = check_tokens(token_out);
    if (err.success())
      err =
          decode_fresh_send(w, st->config, x, topk_idx, topk_weights, send_pos, num_invalid, &send);
    if (err.success())
      err =
          decode_fresh_recv(w, st->config, *x_out, *scales_out, topk_out, weights_out, recv_counts,
                            tokens_per_expert, num_recv, num_dropped, group_invalid, &recv);
    if (err.success()) err = check_whole(send, recv);
    if (err.failure()) return B::error(std::move(err));
    return B::dispatch(ctx, *st, *rank, Part::kWhole, &send, &recv,
                       {nullptr, token_out->typed_data()});
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

  static Result dispatch_recv(
      Ctx ctx, State* st, OrderArg, TokenArg ticket, OrderRet, TokenRet token_out,
      ffi::Result<ffi::AnyBuffer> x_out, ffi::Result<ffi::AnyBuffer> scales_out,
      ffi::ResultBuffer<ffi::S32, 2> topk_out, ffi::ResultBuffer<ffi::F32, 2> weights_out,
      ffi::ResultBuffer<ffi::S32, 1> recv_counts, ffi::ResultBuffer<ffi::S32, 1> tokens_per_expert,
      ffi::ResultBuffer<ffi::S32, 0> num_recv, ffi::ResultBuffer<ffi::S32, 0> num_dropped,
      ffi::ResultBuffer<ffi::S32, 0> group_invalid) {
    Rank* rank = rank_of(ctx, *st);
    if (!rank) return no_rank(ctx);
    const Window& w = rank->window;
    DispatchRecv recv;
    ffi::Error err = check_tokens(token_out);
    if (err.success()) err = check_tokens(ticket, token_out);
    if (err.success())
      err =
          decode_fresh_recv(w, st->config, *x_out, *scales_out, topk_out, weights_out, recv_counts,
                            tokens_per_expert, num_recv, num_dropped, group_invalid, &recv);
    if (err.failure()) return B::error(std::move(err));
    return B::dispatch(ctx, *st, *rank, Part::kRecv, nullptr, &recv,
                       {ticket.typed_data(), token_out->typed_data()});
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

  static Result dispatch_cached_recv(Ctx ctx, State* st, OrderArg, TokenArg ticket, OrderRet,
                                     TokenRet token_out, ffi::Result<ffi::AnyBuffer> x_out,
                                     ffi::Result<ffi::AnyBuffer> scales_out) {
    Rank* rank = rank_of(ctx, *st);
    if (!rank) return no_rank(ctx);
    DispatchRecv recv;
    ffi::Error err = check_tokens(token_out);
    if (err.success()) err = check_tokens(ticket, token_out);
    if (err.success()) err = decode_recv(rank->window, st->config, *x_out, *scales_out, &recv);
    if (err.failure()) return B::error(std::move(err));
    return B::dispatch(ctx, *st, *rank, Part::kRecv, nullptr, &recv,
                       {ticket.typed_data(), token_out->typed_data()});
  }

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
    if (err.success()) err = decode_combine_send(w, rows, recv_counts, num_rows, &send);
    if (err.success()) err = decode_combine_recv(w, send.rows_dtype, send_pos, *out, &recv);
    if (err.success()) err = decode_bias(bias, &recv);
    if (err.success() && recv.width != send.width)
      err = invalid("combine: rows and output widths differ");
    if (err.failure()) return B::error(std::move(err));
    return B::combine(ctx, *st, *rank, Part::kWhole, &send, &recv,
                      {nullptr, token_out->typed_data()});
  }

  static Result combine_send(Ctx ctx, State* st, OrderArg, ffi::AnyBuffer rows,
                             ffi::Buffer<ffi::S32, 1> recv_counts,
                             ffi::Buffer<ffi::S32, 0> num_rows, OrderRet, TokenRet ticket) {
    Rank* rank = rank_of(ctx, *st);
    if (!rank) return no_rank(ctx);
    CombineSend send;
    ffi::Error err = check_tokens(ticket);
    if (err.success()) err = decode_combine_send(rank->window, rows, recv_counts, num_rows, &send);
    if (err.success() && int32_t(send.rows_dtype) != st->config.rows_dtype)
      err = invalid("combine: rows of another type than the call was built for");
    if (err.failure()) return B::error(std::move(err));
    return B::combine(ctx, *st, *rank, Part::kSend, &send, nullptr,
                      {nullptr, ticket->typed_data()});
  }

  static Result combine_recv(Ctx ctx, State* st, OrderArg, TokenArg ticket,
                             ffi::Buffer<ffi::S32, 2> send_pos, ffi::RemainingArgs bias, OrderRet,
                             TokenRet token_out, ffi::Result<ffi::AnyBuffer> out) {
    Rank* rank = rank_of(ctx, *st);
    if (!rank) return no_rank(ctx);
    CombineRecv recv;
    ffi::Error err = check_tokens(token_out);
    if (err.success()) err = check_tokens(ticket, token_out);
    if (err.success())
      err = decode_combine_recv(rank->window, Dtype(st->config.rows_dtype), send_pos, *out, &recv);
    if (err.success()) err = decode_bias(bias, &recv);
    if (err.failure()) return B::error(std::move(err));
    return B::combine(ctx, *st, *rank, Part::kRecv, nullptr, &recv,
                      {ticket.typed_data(), token_out->typed_data()});
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
    if (err.success()) err = decode_combine_send(w, ct_rows, recv_counts, num_rows, &send);
    if (err.success()) err = decode_combine_recv(w, send.rows_dtype, send_pos, *ct_x, &recv);
    if (err.success() && recv.width != send.width)
      err = invalid("dispatch adjoint: the rows' and x's cotangents differ in width");
    const int64_t cols = ct_weights.dimensions()[1];
    if (err.success() &&
        (ct_weights.dimensions()[0] != send.rows || 4 * cols > w.meta_bytes() ||
         ct_w->dimensions()[0] != recv.num_tokens || ct_w->dimensions()[1] != cols))
      err = invalid("dispatch adjoint: the weights' cotangents do not match the rows");
    if (err.failure()) return B::error(std::move(err));
    send.extra = ct_weights.typed_data();
    send.extra_cols = recv.extra_cols = int(cols);
    recv.extra_out = ct_w->typed_data();
    return B::combine(ctx, *st, *rank, Part::kWhole, &send, &recv,
                      {nullptr, token_out->typed_data()});
  }

 private:
  static ffi::Error decode_fresh_send(const Window& w, const CallConfig& cfg, ffi::AnyBuffer x,
                                      ffi::Buffer<ffi::S32, 2> topk_idx,
                                      ffi::Buffer<ffi::F32, 2> topk_weights,
                                      ffi::ResultBuffer<ffi::S32, 2> send_pos,
                                      ffi::ResultBuffer<ffi::S32, 0> num_invalid, DispatchSend* a) {
    if (topk_idx.dimensions()[0] != x.dimensions()[0] ||
        topk_weights.dimensions()[0] != x.dimensions()[0] ||
        topk_weights.dimensions()[1] != topk_idx.dimensions()[1])
      return invalid("dispatch: x, topk_idx and topk_weights disagree on the tokens");
    return decode_send(w, cfg, x, topk_idx.typed_data(), topk_weights.typed_data(),
                       int(topk_idx.dimensions()[1]), send_pos->typed_data(),
                       send_pos->dimensions()[0], send_pos->dimensions()[1],
                       num_invalid->typed_data(), a);
  }

  static ffi::Error decode_cached_send(const Window& w, const CallConfig& cfg, ffi::AnyBuffer x,
                                       ffi::Buffer<ffi::S32, 2> send_pos, DispatchSend* a) {
    return decode_send(w, cfg, x, nullptr, nullptr, w.num_topk,
                       const_cast<int32_t*>(send_pos.typed_data()), send_pos.dimensions()[0],
                       send_pos.dimensions()[1], nullptr, a);
  }
};

// The targets that run on a Buffer, listed once: each is Calls<B>::name bound by name_binding<B>.
// clang-format off
#define JAX_EP_BUFFER_CALLS(X)                                                             \
  X(dispatch) X(dispatch_send) X(dispatch_recv) X(dispatch_cached) X(dispatch_cached_send) \
  X(dispatch_cached_recv) X(combine) X(combine_send) X(combine_recv) X(dispatch_adjoint)
// clang-format on

// The type information XLA keeps for a backend's call state.
template <class State>
const XLA_FFI_TypeInfo* state_type_info() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<State>();
  return &info;
}

// The one instantiate handler of every target (the same attributes on each).
template <class B>
ffi::ErrorOr<std::unique_ptr<typename B::State>> Instantiate(int64_t buffer, bool fp8,
                                                             bool round_scale, bool low_latency,
                                                             int32_t rows_dtype) {
  return instantiate<typename B::Rank>(buffer,
                                       CallConfig{fp8, round_scale, low_latency, rows_dtype});
}

inline auto instantiate_binding() {
  return ffi::Ffi::BindInstantiate()
      .Attr<int64_t>("buffer")
      .Attr<bool>("fp8")
      .Attr<bool>("round_scale")
      .Attr<bool>("low_latency")
      .Attr<int32_t>("rows_dtype");
}

template <class B>
auto bind() {
  return ffi::Ffi::Bind()
      .template Ctx<typename B::Context>()
      .template Ctx<ffi::State<typename B::State>>();
}

// The execute bindings, in the order of the Targets' parameters.
// (A fresh dispatch returns what its recv half does, then what its send half does.)
template <class B>
auto dispatch_binding() {
  return bind<B>()
      .template Arg<OrderArg>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32, 2>>()
      .template Arg<ffi::Buffer<ffi::F32, 2>>()
      .template Ret<OrderArg>()
      .template Ret<TokenArg>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::S32, 2>>()
      .template Ret<ffi::Buffer<ffi::F32, 2>>()
      .template Ret<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<ffi::Buffer<ffi::S32, 0>>()
      .template Ret<ffi::Buffer<ffi::S32, 0>>()
      .template Ret<ffi::Buffer<ffi::S32, 0>>()
      .template Ret<ffi::Buffer<ffi::S32, 2>>()
      .template Ret<ffi::Buffer<ffi::S32, 0>>();
}

template <class B>
auto dispatch_send_binding() {
  return bind<B>()
      .template Arg<OrderArg>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32, 2>>()
      .template Arg<ffi::Buffer<ffi::F32, 2>>()
      .template Ret<OrderArg>()
      .template Ret<TokenArg>()
      .template Ret<ffi::Buffer<ffi::S32, 2>>()
      .template Ret<ffi::Buffer<ffi::S32, 0>>();
}

template <class B>
auto dispatch_recv_binding() {
  return bind<B>()
      .template Arg<OrderArg>()
      .template Arg<TokenArg>()
      .template Ret<OrderArg>()
      .template Ret<TokenArg>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::S32, 2>>()
      .template Ret<ffi::Buffer<ffi::F32, 2>>()
      .template Ret<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<ffi::Buffer<ffi::S32, 0>>()
      .template Ret<ffi::Buffer<ffi::S32, 0>>()
      .template Ret<ffi::Buffer<ffi::S32, 0>>();
}

template <class B>
auto dispatch_cached_binding() {
  return bind<B>()
      .template Arg<OrderArg>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32, 2>>()
      .template Ret<OrderArg>()
      .template Ret<TokenArg>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>();
}

template <class B>
auto dispatch_cached_send_binding() {
  return bind<B>()
      .template Arg<OrderArg>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32, 2>>()
      .template Ret<OrderArg>()
      .template Ret<TokenArg>();
}

template <class B>
auto dispatch_cached_recv_binding() {
  return bind<B>()
      .template Arg<OrderArg>()
      .template Arg<TokenArg>()
      .template Ret<OrderArg>()
      .template Ret<TokenArg>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>();
}

template <class B>
auto combine_binding() {
  return bind<B>()
      .template Arg<OrderArg>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32, 2>>()
      .template Arg<ffi::Buffer<ffi::S32, 1>>()
      .template Arg<ffi::Buffer<ffi::S32, 0>>()
      .RemainingArgs()
      .template Ret<OrderArg>()
      .template Ret<TokenArg>()
      .template Ret<ffi::AnyBuffer>();
}

template <class B>
auto combine_send_binding() {
  return bind<B>()
      .template Arg<OrderArg>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32, 1>>()
      .template Arg<ffi::Buffer<ffi::S32, 0>>()
      .template Ret<OrderArg>()
      .template Ret<TokenArg>();
}

template <class B>
auto combine_recv_binding() {
  return bind<B>()
      .template Arg<OrderArg>()
      .template Arg<TokenArg>()
      .template Arg<ffi::Buffer<ffi::S32, 2>>()
      .RemainingArgs()
      .template Ret<OrderArg>()
      .template Ret<TokenArg>()
      .template Ret<ffi::AnyBuffer>();
}

template <class B>
auto dispatch_adjoint_binding() {
  return bind<B>()
      .template Arg<OrderArg>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32, 2>>()
      .template Arg<ffi::Buffer<ffi::S32, 2>>()
      .template Arg<ffi::Buffer<ffi::S32, 1>>()
      .template Arg<ffi::Buffer<ffi::S32, 0>>()
      .template Ret<OrderArg>()
      .template Ret<TokenArg>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32, 2>>();
}

// ---- the expert layout of received rows (local to the rank, no Buffer)
template <class B>
ffi::Error ExpertLayout(typename B::Context ctx, ffi::Buffer<ffi::S32, 2> topk_rows,
                        ffi::ResultBuffer<ffi::S32, 1> expert_src,
                        ffi::ResultBuffer<ffi::S32, 2> expert_rows,
                        ffi::ResultBuffer<ffi::S32, 1> expert_of_row,
                        ffi::ResultBuffer<ffi::S32, 1> tokens_per_expert,
                        ffi::ResultBuffer<ffi::S32, 0> num_dropped,
                        ffi::ResultBuffer<ffi::S32, 1> expert_counts, int32_t alignment,
                        int32_t block_rows) {
  ExpertLayoutArgs a{};
  a.rows = int(topk_rows.dimensions()[0]);
  a.num_topk = int(topk_rows.dimensions()[1]);
  a.experts_per_rank = int(tokens_per_expert->dimensions()[0]);
  a.alignment = alignment;
  a.block_rows = block_rows;
  a.capacity = int(expert_src->dimensions()[0]);
  if (expert_rows->dimensions()[0] != a.rows || expert_rows->dimensions()[1] != a.max_per_row())
    return invalid("expert layout: expert_rows has the wrong shape");
  a.topk_rows = topk_rows.typed_data();
  a.expert_src = expert_src->typed_data();
  a.expert_rows = expert_rows->typed_data();
  a.expert_of_row = expert_of_row->typed_data();
  a.tokens_per_expert = tokens_per_expert->typed_data();
  a.num_dropped = num_dropped->typed_data();
  a.expert_counts = expert_counts->typed_data();
  return to_error(B::expert_layout(ctx, a));
}

template <class B>
auto expert_layout_binding() {
  return ffi::Ffi::Bind()
      .template Ctx<typename B::Context>()
      .template Arg<ffi::Buffer<ffi::S32, 2>>()
      .template Ret<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<ffi::Buffer<ffi::S32, 2>>()
      .template Ret<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<ffi::Buffer<ffi::S32, 0>>()
      .template Ret<ffi::Buffer<ffi::S32, 1>>()
      .template Attr<int32_t>("alignment")
      .template Attr<int32_t>("block_rows");
}

}  // namespace jax_ep
