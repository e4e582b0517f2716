#include "kernels/cpu/exchange.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "kernels/fp8.h"
#include "kernels/layout.h"

namespace jax_ep::cpu {

Group::Group(int num_ranks) : num_ranks_(num_ranks), boxes_(num_ranks) {
  for (auto& b : boxes_) b.counts.assign(num_ranks, 0);
}

std::string Group::barrier(int rank, const char* op, double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!broken_.empty()) return broken_;
  uint64_t gen = generation_;
  if (++arrived_ == num_ranks_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return {};
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  if (!cv_.wait_until(lock, deadline, [&] { return generation_ != gen || !broken_.empty(); })) {
    broken_ = "jax_ep " + std::string(op) + ": rank " + std::to_string(rank) + " waited " +
              std::to_string(timeout_s) + " s for the other ranks of its EP group, which never " +
              "arrived (every device of the group must run the same sequence of jax_ep ops); " +
              "this Buffer is unusable from now on";
    cv_.notify_all();
  }
  return broken_;
}

namespace {

// One token's row as it goes on the wire: x (or its e4m3 bytes and scales).
struct WireRow {
  std::vector<uint8_t> bytes;
  std::vector<float> scales;
};

void encode_row(const DispatchArgs& a, int t, WireRow& row) {
  const int64_t in_row = int64_t(a.hidden) * dtype_size(a.x_dtype);
  const uint8_t* src = static_cast<const uint8_t*>(a.x) + t * in_row;
  if (!a.fp8) {
    row.bytes.assign(src, src + in_row);
    return;
  }
  row.bytes.resize(a.hidden);
  row.scales.resize(a.scales_per_row());
  for (int g = 0; g < a.scales_per_row(); ++g) {
    float max_abs = 0.f;
    for (int c = g * kFp8Block; c < (g + 1) * kFp8Block; ++c)
      max_abs = std::max(max_abs, std::fabs(load_float(src, c, a.x_dtype)));
    Fp8Block block = Fp8Block::make(max_abs, a.round_scale);
    row.scales[g] = block.scale;
    for (int c = g * kFp8Block; c < (g + 1) * kFp8Block; ++c)
      row.bytes[c] = float_to_e4m3(block.scaled(load_float(src, c, a.x_dtype)));
  }
}

void write_row(const DispatchArgs& a, const WireRow& row, const Mailbox& dest, int dest_rank,
               int t, int64_t pos) {
  const int64_t row_bytes = a.x_out_row_bytes();
  memcpy(static_cast<uint8_t*>(dest.x_out) + pos * row_bytes, row.bytes.data(), row_bytes);
  if (a.fp8)
    memcpy(dest.scales_out + pos * a.scales_per_row(), row.scales.data(),
           sizeof(float) * a.scales_per_row());
  if (a.cached) return;
  for (int k = 0; k < a.num_topk; ++k) {
    int32_t e = a.topk_idx[int64_t(t) * a.num_topk + k];
    int32_t local = local_expert_on(e, dest_rank, a.num_experts, a.experts_per_rank());
    dest.topk_out[pos * a.num_topk + k] = local;
    dest.weights_out[pos * a.num_topk + k] =
        local >= 0 ? a.topk_weights[int64_t(t) * a.num_topk + k] : 0.f;
  }
}

// Padding rows: zeros, expert -1, weight 0.
void clear_rows(const DispatchArgs& a, int64_t from) {
  const int64_t n = a.out_rows - from;
  if (n <= 0) return;
  memset(static_cast<uint8_t*>(a.x_out) + from * a.x_out_row_bytes(), 0, n * a.x_out_row_bytes());
  if (a.fp8) memset(a.scales_out + from * a.scales_per_row(), 0, n * a.scales_per_row() * 4);
  if (a.cached) return;
  std::fill(a.topk_out + from * a.num_topk, a.topk_out + a.out_rows * int64_t(a.num_topk), -1);
  std::fill(a.weights_out + from * a.num_topk, a.weights_out + a.out_rows * int64_t(a.num_topk),
            0.f);
}

}  // namespace

std::string dispatch(Group& group, const DispatchArgs& a, double timeout_s) {
  const int R = a.num_ranks, T = a.num_tokens;
  Mailbox& mine = group.mailbox(a.rank);
  mine.x_out = a.x_out;
  mine.scales_out = a.scales_out;
  mine.topk_out = a.topk_out;
  mine.weights_out = a.weights_out;

  // Route: the slot of each token among those this rank sends to d, in token order.
  std::vector<int32_t> slot(int64_t(T) * R, -1);
  int invalid = 0;
  if (!a.cached) {
    std::fill(mine.counts.begin(), mine.counts.end(), 0);
    for (int t = 0; t < T; ++t) {
      const int32_t* topk = a.topk_idx + int64_t(t) * a.num_topk;
      invalid += count_invalid(topk, a.num_topk, a.num_experts);
      uint32_t mask = dest_rank_mask(topk, a.num_topk, a.num_experts, a.experts_per_rank());
      for (int d = 0; d < R; ++d)
        if (mask >> d & 1u) slot[int64_t(t) * R + d] = mine.counts[d]++;
    }
  }
  if (auto err = group.barrier(a.rank, "dispatch", timeout_s); !err.empty()) return err;

  // Rows from lower ranks come first at every destination.
  int64_t received = 0;
  std::vector<int64_t> first_row(R, 0);
  std::vector<const Mailbox*> peers(R);
  for (int d = 0; d < R; ++d) peers[d] = &group.mailbox(d);
  if (a.cached) {
    received = *a.cached_num_recv;
  } else {
    for (int s = 0; s < R; ++s) {
      int32_t n = peers[s]->counts[a.rank];
      a.recv_counts[s] = n;
      received += n;
      for (int d = 0; d < R; ++d)
        if (s < a.rank) first_row[d] += peers[s]->counts[d];
    }
  }
  const int64_t present = std::min<int64_t>(received, a.out_rows);
  clear_rows(a, present);

  WireRow row;
  for (int t = 0; t < T; ++t) {
    bool encoded = false;
    for (int d = 0; d < R; ++d) {
      int32_t& pos = a.send_pos[int64_t(t) * R + d];
      if (!a.cached) {
        int32_t s = slot[int64_t(t) * R + d];
        pos = s >= 0 && first_row[d] + s < a.out_rows ? int32_t(first_row[d] + s) : -1;
      }
      if (pos < 0) continue;
      if (!encoded) encode_row(a, t, row), encoded = true;
      write_row(a, row, *peers[d], d, t, pos);
    }
  }
  if (auto err = group.barrier(a.rank, "dispatch", timeout_s); !err.empty()) return err;
  if (a.cached) return {};

  // Every peer has written: count what arrived.
  const int El = a.experts_per_rank();
  std::fill(a.tokens_per_expert, a.tokens_per_expert + El, 0);
  for (int64_t p = 0; p < present; ++p)
    for (int e = 0; e < El; ++e)
      a.tokens_per_expert[e] += row_has_expert(a.topk_out + p * a.num_topk, a.num_topk, e);
  *a.num_recv = int32_t(present);
  *a.num_dropped = int32_t(received - present);
  *a.num_invalid = invalid;
  if (invalid > 0)
    return "jax_ep dispatch: topk_idx holds " + std::to_string(invalid) +
           " expert id(s) outside [-1, num_experts=" + std::to_string(a.num_experts) +
           ") on rank " + std::to_string(a.rank) + "; they were excluded";
  return {};
}

std::string combine(Group& group, const CombineArgs& a, double timeout_s) {
  const int R = a.num_ranks;
  group.mailbox(a.rank).rows = a.row_data;
  if (auto err = group.barrier(a.rank, "combine", timeout_s); !err.empty()) return err;
  std::vector<const void*> rows(R);
  for (int d = 0; d < R; ++d) rows[d] = group.mailbox(d).rows;
  std::vector<float> acc(a.width);
  for (int t = 0; t < a.num_tokens; ++t) {
    for (int c = 0; c < a.width; ++c)
      acc[c] = a.has_bias ? load_float(a.bias, int64_t(t) * a.width + c, a.bias_dtype) : 0.f;
    for (int d = 0; d < R; ++d) {
      int32_t pos = a.send_pos[int64_t(t) * R + d];
      if (pos < 0) continue;
      for (int c = 0; c < a.width; ++c)
        acc[c] += load_float(rows[d], int64_t(pos) * a.width + c, a.rows_dtype);
    }
    for (int c = 0; c < a.width; ++c) store_float(a.out, int64_t(t) * a.width + c, a.out_dtype, acc[c]);
  }
  return group.barrier(a.rank, "combine", timeout_s);
}

}  // namespace jax_ep::cpu
