// The XLA FFI signatures of jax_ep's custom calls, written once for every backend.
// A backend supplies a Context (decoded from the call's execution context), the Result its
// cross-rank handlers return (an ffi::Error, or an ffi::Future when the handler completes
// asynchronously) and functions that run the ops of kernels/ops.h; the handlers here only
// decode and check buffers and attributes.
#pragma once
#include <string>
#include <utility>

#include "ffi/registry.h"
#include "kernels/ops.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {
namespace ffi = xla::ffi;

inline ffi::Error invalid(const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_ep: " + what);
}

inline bool to_dtype(ffi::DataType t, Dtype* out) {
  if (t == ffi::DataType::F32) return *out = Dtype::kF32, true;
  if (t == ffi::DataType::BF16) return *out = Dtype::kBF16, true;
  return false;
}

// Resolves which rank of which group the calling device is.
template <class Backend>
ffi::Error with_place(const typename Backend::Context& ctx, int64_t buffer_id,
                      std::shared_ptr<BufferState>* state, Place* place) {
  std::string err = locate(buffer_id, ctx.device, state, place);
  return err.empty() ? ffi::Error::Success() : ffi::Error(ffi::ErrorCode::kNotFound, err);
}

template <class Backend>
using Result = typename Backend::Result;

// What both dispatch handlers take from the buffer, the rank and the attributes.
inline ffi::Error dispatch_common(const BufferState& state, Place place, ffi::AnyBuffer x,
                                  int64_t op_key, int32_t out_rows, bool fp8, bool round_scale,
                                  DispatchArgs* a) {
  a->op_key = op_key;
  a->num_ranks = state.num_ranks;
  a->rank = place.rank;
  a->num_experts = state.num_experts;
  a->hidden = int(x.dimensions()[1]);
  a->num_tokens = int(x.dimensions()[0]);
  a->out_rows = out_rows;
  a->fp8 = fp8;
  a->round_scale = round_scale;
  a->x = x.untyped_data();
  if (!to_dtype(x.element_type(), &a->x_dtype))
    return invalid("dispatch: x must be float32 or bfloat16");
  return ffi::Error::Success();
}

// What both combine handlers take from the buffer, the rank, the rows, the bias and the output.
inline ffi::Error combine_common(const BufferState& state, Place place, ffi::AnyBuffer rows,
                                 ffi::Buffer<ffi::S32, 2> send_pos, ffi::AnyBuffer bias,
                                 ffi::AnyBuffer out, bool has_bias, CombineArgs* a) {
  a->num_ranks = state.num_ranks;
  a->rank = place.rank;
  a->num_tokens = int(send_pos.dimensions()[0]);
  a->rows = int(rows.dimensions()[0]);
  a->width = int(rows.dimensions()[1]);
  a->has_bias = has_bias;
  if (!to_dtype(rows.element_type(), &a->rows_dtype) || !to_dtype(out.element_type(), &a->out_dtype) ||
      (has_bias && !to_dtype(bias.element_type(), &a->bias_dtype)))
    return invalid("combine: rows, bias and output must be float32 or bfloat16");
  if (send_pos.dimensions()[1] != a->num_ranks) return invalid("combine: the handle does not match");
  a->row_data = rows.untyped_data();
  a->send_pos = send_pos.typed_data();
  a->bias = has_bias ? bias.untyped_data() : nullptr;
  a->out = out.untyped_data();
  return ffi::Error::Success();
}

// Where a dispatch writes its rows (and their FP8 scales).
inline void rows_outputs(ffi::Result<ffi::AnyBuffer> x_out, ffi::Result<ffi::AnyBuffer> scales_out,
                         DispatchArgs* a) {
  a->x_out = x_out->untyped_data();
  a->scales_out = a->fp8 ? static_cast<float*>(scales_out->untyped_data()) : nullptr;
}

// Where a fresh dispatch writes its rows and routing (both dispatch signatures return these).
inline void dispatch_outputs(ffi::Result<ffi::AnyBuffer> x_out,
                             ffi::Result<ffi::AnyBuffer> scales_out,
                             ffi::ResultBuffer<ffi::S32, 2> topk_out,
                             ffi::ResultBuffer<ffi::F32, 2> weights_out,
                             ffi::ResultBuffer<ffi::S32, 1> recv_counts,
                             ffi::ResultBuffer<ffi::S32, 1> tokens_per_expert,
                             ffi::ResultBuffer<ffi::S32, 0> num_recv,
                             ffi::ResultBuffer<ffi::S32, 0> num_dropped,
                             ffi::ResultBuffer<ffi::S32, 0> num_invalid, DispatchArgs* a) {
  rows_outputs(x_out, scales_out, a);
  a->topk_out = topk_out->typed_data();
  a->weights_out = weights_out->typed_data();
  a->recv_counts = recv_counts->typed_data();
  a->tokens_per_expert = tokens_per_expert->typed_data();
  a->num_recv = num_recv->typed_data();
  a->num_dropped = num_dropped->typed_data();
  a->num_invalid = num_invalid->typed_data();
}

template <class Binding>
constexpr auto dispatch_attrs(Binding binding) {
  return std::move(binding).template Attr<int64_t>("buffer_id")
      .template Attr<int64_t>("op_key")
      .template Attr<int32_t>("out_rows")
      .template Attr<bool>("fp8")
      .template Attr<bool>("round_scale");
}

inline ffi::Error to_error(const std::string& err) {
  return err.empty() ? ffi::Error::Success() : ffi::Error(ffi::ErrorCode::kInternal, err);
}

// ---- dispatch (fresh routing) ----
template <class Backend>
Result<Backend> Dispatch(typename Backend::Context ctx, ffi::AnyBuffer x, ffi::Buffer<ffi::S32, 2> topk_idx,
                    ffi::Buffer<ffi::F32, 2> topk_weights, ffi::Result<ffi::AnyBuffer> x_out,
                    ffi::Result<ffi::AnyBuffer> scales_out, ffi::ResultBuffer<ffi::S32, 2> topk_out,
                    ffi::ResultBuffer<ffi::F32, 2> weights_out, ffi::ResultBuffer<ffi::S32, 2> send_pos,
                    ffi::ResultBuffer<ffi::S32, 1> recv_counts,
                    ffi::ResultBuffer<ffi::S32, 1> tokens_per_expert,
                    ffi::ResultBuffer<ffi::S32, 0> num_recv, ffi::ResultBuffer<ffi::S32, 0> num_dropped,
                    ffi::ResultBuffer<ffi::S32, 0> num_invalid, int64_t buffer_id, int64_t op_key,
                    int32_t out_rows, bool fp8, bool round_scale) {
  std::shared_ptr<BufferState> state;
  Place place;
  if (auto err = with_place<Backend>(ctx, buffer_id, &state, &place); err.failure())
    return Backend::error(std::move(err));
  DispatchArgs a{};
  if (auto err = dispatch_common(*state, place, x, op_key, out_rows, fp8, round_scale, &a);
      err.failure())
    return Backend::error(std::move(err));
  a.num_topk = int(topk_idx.dimensions()[1]);
  if (topk_idx.dimensions()[0] != a.num_tokens || topk_weights.dimensions()[0] != a.num_tokens)
    return Backend::error(
        invalid("dispatch: x, topk_idx and topk_weights disagree on the number of tokens"));
  a.topk_idx = topk_idx.typed_data();
  a.topk_weights = topk_weights.typed_data();
  a.send_pos = send_pos->typed_data();
  dispatch_outputs(x_out, scales_out, topk_out, weights_out, recv_counts, tokens_per_expert,
                   num_recv, num_dropped, num_invalid, &a);
  return Backend::dispatch(ctx, *state, place, a);
}

template <class Backend>
constexpr auto dispatch_binding() {
  return dispatch_attrs(ffi::Ffi::Bind()
      .template Ctx<typename Backend::Context>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32, 2>>()
      .template Arg<ffi::Buffer<ffi::F32, 2>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::S32, 2>>()
      .template Ret<ffi::Buffer<ffi::F32, 2>>()
      .template Ret<ffi::Buffer<ffi::S32, 2>>()
      .template Ret<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<ffi::Buffer<ffi::S32, 0>>()
      .template Ret<ffi::Buffer<ffi::S32, 0>>()
      .template Ret<ffi::Buffer<ffi::S32, 0>>());
}

// ---- dispatch with the routing of an earlier one (send_pos, num_recv): only x moves ----
template <class Backend>
Result<Backend> DispatchCached(typename Backend::Context ctx, ffi::AnyBuffer x,
                          ffi::Buffer<ffi::S32, 2> send_pos, ffi::Buffer<ffi::S32, 0> num_recv,
                          ffi::Result<ffi::AnyBuffer> x_out, ffi::Result<ffi::AnyBuffer> scales_out,
                          int64_t buffer_id, int64_t op_key, int32_t out_rows, bool fp8,
                          bool round_scale) {
  std::shared_ptr<BufferState> state;
  Place place;
  if (auto err = with_place<Backend>(ctx, buffer_id, &state, &place); err.failure())
    return Backend::error(std::move(err));
  DispatchArgs a{};
  if (auto err = dispatch_common(*state, place, x, op_key, out_rows, fp8, round_scale, &a);
      err.failure())
    return Backend::error(std::move(err));
  a.cached = true;
  if (send_pos.dimensions()[0] != a.num_tokens || send_pos.dimensions()[1] != a.num_ranks)
    return Backend::error(invalid("dispatch: the handle does not match x"));
  a.send_pos = const_cast<int32_t*>(send_pos.typed_data());
  a.cached_num_recv = num_recv.typed_data();
  rows_outputs(x_out, scales_out, &a);
  return Backend::dispatch(ctx, *state, place, a);
}

template <class Backend>
constexpr auto dispatch_cached_binding() {
  return dispatch_attrs(ffi::Ffi::Bind()
                            .template Ctx<typename Backend::Context>()
                            .template Arg<ffi::AnyBuffer>()
                            .template Arg<ffi::Buffer<ffi::S32, 2>>()
                            .template Arg<ffi::Buffer<ffi::S32, 0>>()
                            .template Ret<ffi::AnyBuffer>()
                            .template Ret<ffi::AnyBuffer>());
}

// ---- combine: out[t] = bias[t] + sum_d rows_d[send_pos[t, d]] ----
template <class Backend>
Result<Backend> Combine(typename Backend::Context ctx, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32, 2> send_pos,
                   ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out, int64_t buffer_id,
                   int64_t op_key, bool has_bias) {
  std::shared_ptr<BufferState> state;
  Place place;
  if (auto err = with_place<Backend>(ctx, buffer_id, &state, &place); err.failure())
    return Backend::error(std::move(err));
  CombineArgs a{};
  a.op_key = op_key;
  if (auto err = combine_common(*state, place, rows, send_pos, bias, *out, has_bias, &a);
      err.failure())
    return Backend::error(std::move(err));
  return Backend::combine(ctx, *state, place, a);
}

template <class Backend>
constexpr auto combine_binding() {
  return ffi::Ffi::Bind()
      .template Ctx<typename Backend::Context>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32, 2>>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("buffer_id")
      .template Attr<int64_t>("op_key")
      .template Attr<bool>("has_bias");
}

// ---- expert layout of received rows (local to the rank) ----
template <class Backend>
ffi::Error ExpertLayout(typename Backend::Context ctx, ffi::Buffer<ffi::S32, 2> topk_rows,
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
  return to_error(Backend::expert_layout(ctx, a));
}

template <class Backend>
constexpr auto expert_layout_binding() {
  return ffi::Ffi::Bind()
      .template Ctx<typename Backend::Context>()
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
