// The operations both backends implement, as plain argument structs.
// ffi/ decodes XLA buffers and attributes into these; kernels/cpu and kernels/cuda run them.
#pragma once
#include "kernels/dtype.h"
#include "kernels/layout.h"

namespace jax_ep {

// Rank-level dispatch: every token goes once to each rank holding one of its experts and lands
// in row `send_pos[t, d]` there; rows are ordered by (source rank, source token).
struct DispatchArgs {
  int64_t op_key;    // names the op the same way on every rank (a trace-time id)
  int num_ranks, rank, num_experts, num_topk, hidden, num_tokens;
  int out_rows;      // rows of the receiving buffer (the capacity); later rows are dropped
  bool fp8, round_scale;
  bool cached;       // reuse send_pos / num_recv of an earlier dispatch: only x moves
  Dtype x_dtype;     // kF32 or kBF16
  const void* x;                 // [T, H]
  const int32_t* topk_idx;       // [T, K] (fresh only)
  const float* topk_weights;     // [T, K] (fresh only)
  void* x_out;                   // [out_rows, H] x_dtype, or e4m3 bytes when fp8
  float* scales_out;             // [out_rows, H / 128] when fp8
  int32_t* topk_out;             // [out_rows, K] local expert ids or -1 (fresh only)
  float* weights_out;            // [out_rows, K] (fresh only)
  int32_t* send_pos;             // [T, R]: output when fresh, input when cached
  const int32_t* cached_num_recv;  // []: input when cached
  // Fresh only:
  int32_t* recv_counts;          // [R] rows each source sent here, before capacity
  int32_t* tokens_per_expert;    // [E / R] distinct (row, local expert) pairs present
  int32_t* num_recv;             // [] rows present
  int32_t* num_dropped;          // [] rows beyond out_rows
  int32_t* num_invalid;          // [] this rank's expert ids outside [-1, E)

  JAX_EP_HD int experts_per_rank() const { return num_experts / num_ranks; }
  JAX_EP_HD int64_t x_out_row_bytes() const { return fp8 ? hidden : int64_t(hidden) * dtype_size(x_dtype); }
  JAX_EP_HD int scales_per_row() const { return hidden / 128; }
};

// Rank-level combine: out[t] = bias[t] + sum over ranks d (in order) of rows_d[send_pos[t, d]],
// accumulated in float32 and rounded once.
struct CombineArgs {
  int64_t op_key;    // names the op the same way on every rank (a trace-time id)
  int num_ranks, rank, num_tokens, width;
  int rows;                      // rows of each rank's `rows` buffer
  Dtype rows_dtype, out_dtype, bias_dtype;
  bool has_bias;
  const void* row_data;          // [rows, width] on this rank, read by every rank
  const int32_t* send_pos;       // [T, R]
  const void* bias;              // [T, width]
  void* out;                     // [T, width]
};

// Receiver-local: rank-layout rows -> expert-layout positions (by local expert, then row).
struct ExpertLayoutArgs {
  int rows, num_topk, experts_per_rank, alignment, capacity;
  int block_rows;                // > 0: expert e's rows are [e * block_rows, (e + 1) * block_rows)
  const int32_t* topk_rows;      // [rows, K] local expert ids or -1
  int32_t* expert_src;           // [capacity] rank-layout row of each expert row, -1 on padding
  int32_t* expert_rows;          // [rows, M] expert rows of each rank-layout row by expert, -1
  int32_t* expert_of_row;        // [capacity] local expert of each expert row, -1 on padding
  int32_t* tokens_per_expert;    // [E_l] rows present per expert
  int32_t* num_dropped;          // [] (row, expert) items beyond capacity
  int32_t* expert_counts;        // [E_l] rows per expert before the capacity (scratch)
  JAX_EP_HD int max_per_row() const { return max_experts_per_row(num_topk, experts_per_rank); }
};

}  // namespace jax_ep
