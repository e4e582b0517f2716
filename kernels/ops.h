// The operations both backends implement, as plain argument structs: ffi/ decodes XLA buffers
// and attributes into these; kernels/cpu and kernels/cuda run them. Every cross-rank op has a
// send half (rows into the peers' windows) and a recv half (rows out of this rank's window into
// XLA's buffers); a whole op runs both.
#pragma once
#include "kernels/dtype.h"
#include "kernels/layout.h"
#include "kernels/limits.h"
#include "kernels/signature.h"

namespace jax_ep {

// Which halves of an op a call runs.
enum class Part : int { kSend = 1, kRecv = 2, kWhole = 3 };
JAX_EP_HD bool sends(Part p) { return int(p) & int(Part::kSend); }
JAX_EP_HD bool receives(Part p) { return int(p) & int(Part::kRecv); }

// The payload bytes of a dispatched row: one e4m3 byte per element with fp8.
JAX_EP_HD int64_t dispatch_row_bytes(bool fp8, int hidden, Dtype x_dtype) {
  return fp8 ? hidden : int64_t(hidden) * dtype_size(x_dtype);
}

// Dispatch, send half: every token goes once to each rank holding one of its experts and lands
// in row j of this rank's block there (j: its index among the tokens this rank sends there).
struct DispatchSend {
  int num_experts, num_topk, hidden, num_tokens;
  bool fp8, round_scale;
  uint32_t call_site;         // where the program calls the op (kernels/signature.h)
  Dtype x_dtype;              // kF32 or kBF16
  const void* x;              // [T, H]
  const int32_t* topk_idx;    // [T, K]; null for a cached dispatch
  const float* topk_weights;  // [T, K]; null for a cached dispatch
  int32_t* send_pos;     // [T, R] j per destination or -1: written when fresh, read when cached
  int32_t* num_invalid;  // []: this rank's expert ids outside [-1, E) (fresh)
  JAX_EP_HD bool fresh() const { return topk_idx != nullptr; }
  JAX_EP_HD int64_t wire_row_bytes() const { return dispatch_row_bytes(fp8, hidden, x_dtype); }
};

// Dispatch, recv half: rows in (source rank, j) order; those past out_rows are dropped.
struct DispatchRecv {
  int hidden, num_topk, out_rows;
  bool fp8;
  Dtype x_dtype;
  void* x_out;        // [out_rows, H] x_dtype, or e4m3 bytes when fp8
  float* scales_out;  // [out_rows, H / 128] when fp8
  // Fresh only (null for a cached dispatch):
  int32_t* topk_out;           // [out_rows, K] local expert ids or -1
  float* weights_out;          // [out_rows, K]
  int32_t* recv_counts;        // [R] rows each source sent here, before capacity
  int32_t* tokens_per_expert;  // [E / R] distinct (row, local expert) pairs present
  int32_t* num_recv;           // [] rows present
  int32_t* num_dropped;        // [] rows beyond out_rows
  int32_t* group_invalid;      // [] expert ids outside [-1, E) on every rank of the group
  JAX_EP_HD bool fresh() const { return topk_out != nullptr; }
  JAX_EP_HD int64_t wire_row_bytes() const { return dispatch_row_bytes(fp8, hidden, x_dtype); }
};

// Combine, send half: each rank-level row this rank received goes back into row j of its
// source's window; rows dropped at dispatch stay here.
struct CombineSend {
  int width, rows;  // row_data is [rows, width]
  uint32_t call_site;
  Dtype rows_dtype;
  const void* row_data;
  const int32_t* recv_counts;  // [R] the dispatch's rows per source (before capacity)
  const int32_t* num_rows;     // [] rows present at dispatch
  const float* extra;          // [rows, extra_cols] float32 columns moved with the rows, or null
  int extra_cols;
};

// Combine, recv half: out[t] = bias[t] + sum over ranks d (in rank order) of the row token t
// sent to d, accumulated in float32 and rounded once; extra_out likewise, without bias.
struct CombineRecv {
  int num_tokens, width;
  const int32_t* send_pos;  // [T, R] j per destination or -1
  Dtype rows_dtype;         // what the ranks send back (the same on every rank)
  Dtype out_dtype, bias_dtype;
  const void* bias;  // [T, width] or null
  void* out;         // [T, width]
  float* extra_out;  // [T, extra_cols] or null
  int extra_cols;
};

// Receiver-local: rank-layout rows -> expert-layout positions (by local expert, then row).
struct ExpertLayoutArgs {
  int rows, num_topk, experts_per_rank, alignment, capacity;
  int block_rows;  // > 0 (the CPU backend's expert_padded): expert e's rows are [e * B, (e + 1) *
                   // B)
  const int32_t* topk_rows;    // [rows, K] local expert ids or -1
  int32_t* expert_src;         // [capacity] rank-layout row of each expert row, -1 on padding
  int32_t* expert_rows;        // [rows, M] expert rows of each rank-layout row by expert, -1
  int32_t* expert_of_row;      // [capacity] local expert of each expert row, -1 on padding
  int32_t* tokens_per_expert;  // [E_l] rows present per expert
  int32_t* num_dropped;        // [] (row, expert) items beyond capacity
  int32_t* expert_counts;      // [E_l] rows per expert before the capacity (scratch)
  JAX_EP_HD int max_per_row() const { return max_experts_per_row(num_topk, experts_per_rank); }
};

// Receiver-local, the expert_padded layout of a fresh dispatch in one step: expert e owns rows
// [e * C, (e + 1) * C) of every output and holds its rows there in rank-layout order (those past
// C drop); each rank-level row is copied to its experts' rows, with the token's weight for each
// expert (the sum over its slots naming it). Rows of x and scales past an expert's count are not
// written: a padded tensor costs the rows received. (The maps are expert_layout's with
// block_rows = C.)
struct ExpertPaddedArgs {
  int rows, num_topk, experts_per_rank, capacity;  // capacity C: rows per expert
  int64_t x_row_bytes, scale_row_bytes;            // scale_row_bytes 0: no scales
  const int32_t* topk_rows;                        // [rows, K] local expert ids or -1
  const float* weight_rows;                        // [rows, K]
  const uint8_t* x_rows;                           // [rows, x_row_bytes]
  const uint8_t* scale_rows;                       // [rows, scale_row_bytes]
  uint8_t* x_out;                                  // [E_l * C, x_row_bytes]
  uint8_t* scales_out;                             // [E_l * C, scale_row_bytes]
  float* weights_out;                              // [E_l * C], 0 on padding
  int32_t* expert_src;         // [E_l * C] rank-level row of each expert row, -1 on padding
  int32_t* expert_rows;        // [rows, M] expert rows of each rank-level row by expert, -1
  int32_t* expert_of_row;      // [E_l * C] local expert of each expert row, -1 on padding
  int32_t* tokens_per_expert;  // [E_l] rows present per expert
  int32_t* expert_counts;      // [E_l] rows per expert before the capacity
  int32_t* chunk_counts;       // [chunks, E_l] rows per expert of each kExpertChunkRows rows (GPUs)
  JAX_EP_HD int max_per_row() const { return max_experts_per_row(num_topk, experts_per_rank); }
  JAX_EP_HD int chunks() const { return (rows + kExpertChunkRows - 1) / kExpertChunkRows; }
};

// Receiver-local: each rank-layout row copied to its expert rows (a cached dispatch in the
// expert_padded layout). Rows of `out` that no row names are left as they were.
struct PlaceRowsArgs {
  int rows, per_row;            // S rank-layout rows, M expert rows at most per row
  int64_t row_bytes, out_rows;  // bytes of a row, rows of out
  const uint8_t* src;           // [rows, row_bytes]
  const int32_t* expert_rows;   // [rows, per_row] rows of out, or -1 (others: out of range)
  uint8_t* out;                 // [out_rows, row_bytes]
};

// Local (no Buffer): rows quantized by the FP8 rule (kernels/fp8.h), one scale per 1 x 128
// block, as a dispatch sends them.
struct QuantizeRowsArgs {
  int64_t rows;
  int hidden;  // a multiple of kFp8Block
  bool round_scale;
  Dtype dtype;    // of x: kF32 or kBF16
  const void* x;  // [rows, hidden]
  uint8_t* q;     // [rows, hidden] e4m3
  float* scales;  // [rows, hidden / kFp8Block]
};

// Local: expert weights [G, K, N] quantized by the FP8 rule, one scale per 128 x 128 block,
// stored K innermost ([G, N, K], as the FP8 forward reads them) and, when q_t is set, also N
// innermost ([G, K, N], as the FP8 row gradient reads them).
struct QuantizeWeightsArgs {
  int groups, k, n;  // K and N multiples of kFp8Block
  Dtype dtype;       // of w: kF32 or kBF16
  const void* w;     // [G, K, N]
  uint8_t* q;        // [G, N, K] e4m3
  float* scales;     // [G, N / 128, K / 128]
  uint8_t* q_t;      // [G, K, N] e4m3, or null
  float* scales_t;   // [G, K / 128, N / 128], or null
};

// The signatures both backends send with an op's counts (kernels/signature.h).
JAX_EP_HD Signature signature(const DispatchSend& a) {
  Signature s{};
  s.kind = a.fresh() ? OpKind::kDispatch : OpKind::kDispatchCached;
  s.fp8 = a.fp8;
  s.round_scale = a.fp8 && a.round_scale;
  s.dtype = a.x_dtype;
  s.width = a.hidden;
  s.columns = a.fresh() ? a.num_topk : 0;
  s.tokens = a.num_tokens;
  s.experts = a.num_experts;
  s.site = a.call_site;
  return s;
}

JAX_EP_HD Signature signature(const CombineSend& a, int num_experts) {
  Signature s{};
  s.kind = a.extra ? OpKind::kDispatchAdjoint : OpKind::kCombine;
  s.dtype = a.rows_dtype;
  s.width = a.width;
  s.columns = a.extra ? a.extra_cols : 0;
  s.tokens = a.rows;
  s.experts = num_experts;
  s.site = a.call_site;
  return s;
}

}  // namespace jax_ep
