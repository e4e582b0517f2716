// What the custom calls (ffi/calls.h) decode, and the checks a caller's error comes from: XLA's
// buffers and attributes into the argument structs of kernels/ops.h, checked against the
// Buffer's window. Nothing here depends on a backend.
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
using TokenArg = ffi::Buffer<ffi::S32, 1>;
using TokenRet = ffi::ResultBuffer<ffi::S32, 1>;

struct Tokens {
  const int32_t* ticket;  // recv halves
  int32_t* out;
};

// The attributes of every call on a Buffer (jax_ep/ffi_path.py, _Config.attributes), decoded
// once, when XLA instantiates the call.
struct CallAttrs {
  int64_t buffer;  // the Buffer's key
  CallConfig config;
};

// The attributes of an expert layout (jax_ep/ffi_path.py, expert_layout).
struct ExpertLayoutAttrs {
  int32_t alignment;
};

// The attributes of an FP8 row quantization (jax_ep/ffi_path.py, quantize_rows).
struct QuantizeRowsAttrs {
  bool round_scale;
};

// The results of a fresh dispatch's recv half (jax_ep/ffi_path.py, _received_shapes): its rows,
// then their routing. bind() lists them for XLA, in the same order.
struct FreshReceived {
  ffi::Result<ffi::AnyBuffer> x_out, scales_out;
  ffi::ResultBuffer<ffi::S32, 2> topk_out;
  ffi::ResultBuffer<ffi::F32, 2> weights_out;
  ffi::ResultBuffer<ffi::S32, 1> recv_counts, tokens_per_expert;
  ffi::ResultBuffer<ffi::S32, 0> num_recv, num_dropped, group_invalid;

  template <class Binding>
  static auto bind(Binding binding) {
    return std::move(binding)
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
};

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

// ---- dispatch

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
  a->call_site = uint32_t(cfg.call_site);
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

// The send half of a fresh dispatch: it routes the tokens and writes their handle.
inline ffi::Error decode_fresh_send(const Window& w, const CallConfig& cfg, ffi::AnyBuffer x,
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

// The send half of a cached dispatch: it follows a fresh one's handle.
inline ffi::Error decode_cached_send(const Window& w, const CallConfig& cfg, ffi::AnyBuffer x,
                                     ffi::Buffer<ffi::S32, 2> send_pos, DispatchSend* a) {
  return decode_send(w, cfg, x, nullptr, nullptr, w.num_topk,
                     const_cast<int32_t*>(send_pos.typed_data()), send_pos.dimensions()[0],
                     send_pos.dimensions()[1], nullptr, a);
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

// The recv half of a fresh dispatch: its rows and their routing.
inline ffi::Error decode_fresh_recv(const Window& w, const CallConfig& cfg, FreshReceived r,
                                    DispatchRecv* a) {
  if (auto err = decode_recv(w, cfg, *r.x_out, *r.scales_out, a); err.failure()) return err;
  if (r.topk_out->dimensions()[0] != a->out_rows || r.topk_out->dimensions()[1] != w.num_topk ||
      r.weights_out->dimensions()[0] != a->out_rows ||
      r.weights_out->dimensions()[1] != w.num_topk ||
      r.recv_counts->element_count() != w.num_ranks ||
      r.tokens_per_expert->element_count() != w.experts_per_rank)
    return invalid("dispatch: the routing outputs do not match the Buffer");
  a->topk_out = r.topk_out->typed_data();
  a->weights_out = r.weights_out->typed_data();
  a->recv_counts = r.recv_counts->typed_data();
  a->tokens_per_expert = r.tokens_per_expert->typed_data();
  a->num_recv = r.num_recv->typed_data();
  a->num_dropped = r.num_dropped->typed_data();
  a->group_invalid = r.group_invalid->typed_data();
  return ffi::Error::Success();
}

// A whole dispatch writes the rows a rank sends itself straight into its outputs: they must agree.
inline ffi::Error check_whole(const DispatchSend& s, const DispatchRecv& v) {
  if (s.hidden != v.hidden || (!s.fp8 && s.x_dtype != v.x_dtype))
    return invalid("dispatch: the rows out differ from x in width or type");
  return ffi::Error::Success();
}

// ---- combine

// A combine's send half: the rank-level rows of this rank and the dispatch's counts.
inline ffi::Error decode_combine_send(const Window& w, const CallConfig& cfg, ffi::AnyBuffer rows,
                                      ffi::Buffer<ffi::S32, 1> recv_counts,
                                      ffi::Buffer<ffi::S32, 0> num_rows, CombineSend* a) {
  if (rows.dimensions().size() != 2) return invalid("combine: rows must be [rows, width]");
  *a = CombineSend{};
  a->call_site = uint32_t(cfg.call_site);
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

// Both halves of a whole combine: the rows go back to the tokens they came from, into out.
inline ffi::Error decode_whole_combine(const Window& w, const CallConfig& cfg, ffi::AnyBuffer rows,
                                       ffi::Buffer<ffi::S32, 2> send_pos,
                                       ffi::Buffer<ffi::S32, 1> recv_counts,
                                       ffi::Buffer<ffi::S32, 0> num_rows, ffi::AnyBuffer out,
                                       CombineSend* send, CombineRecv* recv) {
  if (auto err = decode_combine_send(w, cfg, rows, recv_counts, num_rows, send); err.failure())
    return err;
  return decode_combine_recv(w, send->rows_dtype, send_pos, out, recv);
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

// The adjoint of a dispatch's extra columns: the weights' cotangents, moved beside the rows'.
inline ffi::Error decode_weight_cotangents(const Window& w, ffi::Buffer<ffi::F32, 2> ct_weights,
                                           ffi::ResultBuffer<ffi::F32, 2> ct_w, CombineSend* send,
                                           CombineRecv* recv) {
  const int64_t cols = ct_weights.dimensions()[1];
  if (ct_weights.dimensions()[0] != send->rows || 4 * cols > w.meta_bytes() ||
      ct_w->dimensions()[0] != recv->num_tokens || ct_w->dimensions()[1] != cols)
    return invalid("dispatch adjoint: the weights' cotangents do not match the rows");
  send->extra = ct_weights.typed_data();
  send->extra_cols = recv->extra_cols = int(cols);
  recv->extra_out = ct_w->typed_data();
  return ffi::Error::Success();
}

// ---- expert layout

inline ffi::Error decode_expert_layout(
    ffi::Buffer<ffi::S32, 2> topk_rows, ffi::ResultBuffer<ffi::S32, 1> expert_src,
    ffi::ResultBuffer<ffi::S32, 2> expert_rows, ffi::ResultBuffer<ffi::S32, 1> expert_of_row,
    ffi::ResultBuffer<ffi::S32, 1> tokens_per_expert, ffi::ResultBuffer<ffi::S32, 0> num_dropped,
    ffi::ResultBuffer<ffi::S32, 1> expert_counts, ExpertLayoutAttrs attrs, ExpertLayoutArgs* a) {
  *a = ExpertLayoutArgs{};
  a->rows = int(topk_rows.dimensions()[0]);
  a->num_topk = int(topk_rows.dimensions()[1]);
  a->experts_per_rank = int(tokens_per_expert->dimensions()[0]);
  a->alignment = attrs.alignment;
  a->capacity = int(expert_src->dimensions()[0]);
  if (expert_rows->dimensions()[0] != a->rows || expert_rows->dimensions()[1] != a->max_per_row())
    return invalid("expert layout: expert_rows has the wrong shape");
  a->topk_rows = topk_rows.typed_data();
  a->expert_src = expert_src->typed_data();
  a->expert_rows = expert_rows->typed_data();
  a->expert_of_row = expert_of_row->typed_data();
  a->tokens_per_expert = tokens_per_expert->typed_data();
  a->num_dropped = num_dropped->typed_data();
  a->expert_counts = expert_counts->typed_data();
  return ffi::Error::Success();
}

// ---- a fresh dispatch's rows in the expert_padded layout

inline ffi::Error decode_expert_padded(
    ffi::Buffer<ffi::S32, 2> topk_rows, ffi::Buffer<ffi::F32, 2> weight_rows, ffi::AnyBuffer x_rows,
    ffi::AnyBuffer scale_rows, ffi::Result<ffi::AnyBuffer> x_out,
    ffi::Result<ffi::AnyBuffer> scales_out, ffi::ResultBuffer<ffi::F32, 1> weights_out,
    ffi::ResultBuffer<ffi::S32, 1> expert_src, ffi::ResultBuffer<ffi::S32, 2> expert_rows,
    ffi::ResultBuffer<ffi::S32, 1> expert_of_row, ffi::ResultBuffer<ffi::S32, 1> tokens_per_expert,
    ffi::ResultBuffer<ffi::S32, 1> expert_counts, ffi::ResultBuffer<ffi::S32, 2> chunk_counts,
    ExpertPaddedArgs* a) {
  *a = ExpertPaddedArgs{};
  a->rows = int(topk_rows.dimensions()[0]);
  a->num_topk = int(topk_rows.dimensions()[1]);
  a->experts_per_rank = int(tokens_per_expert->dimensions()[0]);
  const int64_t out_rows = expert_src->dimensions()[0];
  a->capacity = a->experts_per_rank ? int(out_rows / a->experts_per_rank) : 0;
  const auto rows_of = [](auto& buffer) {
    return buffer.dimensions().size() ? buffer.dimensions()[0] : -1;
  };
  if (a->rows == 0 || int64_t(a->capacity) * a->experts_per_rank != out_rows ||
      weight_rows.dimensions()[0] != a->rows || weight_rows.dimensions()[1] != a->num_topk ||
      rows_of(x_rows) != a->rows || rows_of(scale_rows) != a->rows || rows_of(*x_out) != out_rows ||
      rows_of(*scales_out) != out_rows || weights_out->dimensions()[0] != out_rows ||
      expert_of_row->dimensions()[0] != out_rows ||
      expert_counts->dimensions()[0] != a->experts_per_rank ||
      expert_rows->dimensions()[0] != a->rows || expert_rows->dimensions()[1] != a->max_per_row() ||
      chunk_counts->dimensions()[0] != a->chunks() ||
      chunk_counts->dimensions()[1] != a->experts_per_rank ||
      x_rows.element_type() != x_out->element_type() ||
      scale_rows.element_type() != scales_out->element_type() ||
      x_rows.size_bytes() * out_rows != x_out->size_bytes() * a->rows ||
      scale_rows.size_bytes() * out_rows != scales_out->size_bytes() * a->rows)
    return invalid("expert_padded: the rows, their experts and the outputs do not match");
  a->x_row_bytes = int64_t(x_rows.size_bytes() / a->rows);
  a->scale_row_bytes = int64_t(scale_rows.size_bytes() / a->rows);
  a->topk_rows = topk_rows.typed_data();
  a->weight_rows = weight_rows.typed_data();
  a->x_rows = static_cast<const uint8_t*>(x_rows.untyped_data());
  a->scale_rows = static_cast<const uint8_t*>(scale_rows.untyped_data());
  a->x_out = static_cast<uint8_t*>(x_out->untyped_data());
  a->scales_out = static_cast<uint8_t*>(scales_out->untyped_data());
  a->weights_out = weights_out->typed_data();
  a->expert_src = expert_src->typed_data();
  a->expert_rows = expert_rows->typed_data();
  a->expert_of_row = expert_of_row->typed_data();
  a->tokens_per_expert = tokens_per_expert->typed_data();
  a->expert_counts = expert_counts->typed_data();
  a->chunk_counts = chunk_counts->typed_data();
  return ffi::Error::Success();
}

// ---- rows placed in the expert_padded layout by a cached dispatch

inline ffi::Error decode_place_rows(ffi::AnyBuffer src, ffi::Buffer<ffi::S32, 2> expert_rows,
                                    ffi::Result<ffi::AnyBuffer> out, PlaceRowsArgs* a) {
  const auto in_dims = src.dimensions(), out_dims = out->dimensions();
  if (src.element_type() != out->element_type() || in_dims.size() != out_dims.size() ||
      in_dims.size() == 0 || expert_rows.dimensions()[0] != in_dims[0])
    return invalid("place rows: the rows, their expert rows and the output do not match");
  for (size_t d = 1; d < in_dims.size(); ++d)
    if (in_dims[d] != out_dims[d]) return invalid("place rows: rows and output differ in width");
  *a = PlaceRowsArgs{};
  a->rows = int(in_dims[0]);
  a->per_row = int(expert_rows.dimensions()[1]);
  a->out_rows = out_dims[0];
  a->row_bytes = a->rows ? int64_t(src.size_bytes() / a->rows) : 0;
  a->src = static_cast<const uint8_t*>(src.untyped_data());
  a->expert_rows = expert_rows.typed_data();
  a->out = static_cast<uint8_t*>(out->untyped_data());
  return ffi::Error::Success();
}

// ---- FP8 quantization of a grouped matmul's operands (local, no Buffer)

inline ffi::Error decode_quantize_rows(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                                       ffi::ResultBuffer<ffi::F32, 2> scales,
                                       QuantizeRowsAttrs attrs, QuantizeRowsArgs* a) {
  *a = QuantizeRowsArgs{};
  const auto dims = x.dimensions();
  if (dims.size() != 2 || !to_dtype(x.element_type(), &a->dtype))
    return invalid("quantize rows: x must be [rows, hidden] float32 or bfloat16");
  a->rows = dims[0];
  a->hidden = int(dims[1]);
  if (a->hidden % kFp8Block || q->element_type() != ffi::DataType::F8E4M3FN ||
      q->dimensions().size() != 2 || q->dimensions()[0] != a->rows ||
      q->dimensions()[1] != a->hidden || scales->dimensions()[0] != a->rows ||
      scales->dimensions()[1] != a->hidden / kFp8Block)
    return invalid(
        "quantize rows: hidden must be a multiple of 128, q e4m3 like x and scales "
        "[rows, hidden / 128]");
  a->round_scale = attrs.round_scale;
  a->x = x.untyped_data();
  a->q = static_cast<uint8_t*>(q->untyped_data());
  a->scales = scales->typed_data();
  return ffi::Error::Success();
}

// q_t and scales_t with no elements: the transposed copy is not asked for.
inline ffi::Error decode_quantize_weights(ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> q,
                                          ffi::ResultBuffer<ffi::F32, 3> scales,
                                          ffi::Result<ffi::AnyBuffer> q_t,
                                          ffi::ResultBuffer<ffi::F32, 3> scales_t,
                                          QuantizeWeightsArgs* a) {
  *a = QuantizeWeightsArgs{};
  const auto dims = w.dimensions();
  if (dims.size() != 3 || !to_dtype(w.element_type(), &a->dtype))
    return invalid("quantize weights: w must be [G, K, N] float32 or bfloat16");
  a->groups = int(dims[0]);
  a->k = int(dims[1]);
  a->n = int(dims[2]);
  const int64_t kb = a->k / kFp8Block, nb = a->n / kFp8Block;
  const bool transposed = q_t->element_count() > 0;
  auto is = [](auto d, int64_t x, int64_t y, int64_t z) {
    return d.size() == 3 && d[0] == x && d[1] == y && d[2] == z;
  };
  if (a->k % kFp8Block || a->n % kFp8Block || q->element_type() != ffi::DataType::F8E4M3FN ||
      !is(q->dimensions(), a->groups, a->n, a->k) || !is(scales->dimensions(), a->groups, nb, kb) ||
      (transposed && (q_t->element_type() != ffi::DataType::F8E4M3FN ||
                      !is(q_t->dimensions(), a->groups, a->k, a->n) ||
                      !is(scales_t->dimensions(), a->groups, kb, nb))))
    return invalid(
        "quantize weights: K and N must be multiples of 128, q e4m3 [G, N, K] with "
        "scales [G, N / 128, K / 128] (q_t [G, K, N], scales_t [G, K / 128, N / 128])");
  a->w = w.untyped_data();
  a->q = static_cast<uint8_t*>(q->untyped_data());
  a->scales = scales->typed_data();
  a->q_t = transposed ? static_cast<uint8_t*>(q_t->untyped_data()) : nullptr;
  a->scales_t = transposed ? scales_t->typed_data() : nullptr;
  return ffi::Error::Success();
}

}  // namespace jax_ep

// How XLA decodes the attributes (by name; XLA checks their number and types).
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jax_ep::Dtype);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_ep::CallAttrs,
                                      ::xla::ffi::StructMember<int64_t>("buffer"),
                                      ::xla::ffi::StructMember<bool>("fp8"),
                                      ::xla::ffi::StructMember<bool>("round_scale"),
                                      ::xla::ffi::StructMember<bool>("low_latency"),
                                      ::xla::ffi::StructMember<jax_ep::Dtype>("rows_dtype"),
                                      ::xla::ffi::StructMember<int64_t>("call_site"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_ep::ExpertLayoutAttrs,
                                      ::xla::ffi::StructMember<int32_t>("alignment"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_ep::QuantizeRowsAttrs,
                                      ::xla::ffi::StructMember<bool>("round_scale"));

// The call state as a handler's parameter (XLA's auto-binding: `CallState<Rank>*` is ffi::State).
namespace xla::ffi {
template <class Rank>
struct CtxBinding<jax_ep::CallState<Rank>*> {
  using Ctx = State<jax_ep::CallState<Rank>>;
};
}  // namespace xla::ffi
